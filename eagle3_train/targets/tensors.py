"""A few of a target's tensors (embeddings, lm_head, final norm) read from its safetensors files
alone, never the whole model: from the shards that hold them, downloaded alone for a hub id."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from eagle3_train.core.errors import BadInputError
from eagle3_train.targets.identity import text_config
from eagle3_train.targets.loading import resolve_local_dir
from eagle3_train.targets.tiny import build_tiny_model, is_tiny, tiny_config

# Which checkpoint tensor each name means (the first matching key wins). The final norm is the
# decoder's own (``model.norm`` / ``model.language_model.norm``), never a layer's or an MTP head's.
_TENSOR_KEYS = {
    "embed": lambda k: k.endswith("embed_tokens.weight") and "mtp" not in k,
    "head": lambda k: k.endswith("lm_head.weight"),
    "norm": lambda k: re.fullmatch(r"(.*\.)?(model|language_model)\.norm\.weight", k) is not None,
}


WEIGHT_INDEX = "model.safetensors.index.json"


def _shards_holding(directory: Path, names: tuple[str, ...]) -> list[str] | None:
    """The weight files that hold ``names``, by the checkpoint's index (None: no index, read every
    file). A 1T-parameter target keeps its final norm and lm_head in one or two of ~160 shards."""
    index = directory / WEIGHT_INDEX
    if not index.is_file():
        return None
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as e:
        raise BadInputError(f"{index} is not a safetensors weight index: {e}") from None
    wanted = set(names)
    if "head" in wanted and not any(_TENSOR_KEYS["head"](k) for k in weight_map):
        wanted.add("embed")  # a tied lm_head is the embedding matrix
    return sorted({f for k, f in weight_map.items() if any(_TENSOR_KEYS[n](k) for n in wanted)})


def load_target_tensors(
    target: str, names: tuple[str, ...], *, cache_dir: str | os.PathLike | None, trust_remote_code: bool = False
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The target's config and the tensors ``names`` (of ``embed``, ``head``, ``norm``: the final
    RMSNorm weight), read from its safetensors files: only those bytes, never the whole model."""
    if is_tiny(target):
        model = build_tiny_model(tiny_config(target))
        every = {
            "embed": model.get_input_embeddings().weight,
            "head": model.get_output_embeddings().weight,
            "norm": model.model.norm.weight,
        }
        return model.config, {n: every[n].detach() for n in names}
    local = resolve_local_dir(target, cache_dir)
    hub = local is None
    if local is None:  # a hub id: the config and the weight index first, then only the shards holding these tensors
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(target, allow_patterns=["*.json"]))
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(local), trust_remote_code=trust_remote_code)
    shards = _shards_holding(local, names)
    if hub:
        local = Path(snapshot_download(target, allow_patterns=shards or ["*.safetensors"]))
    files = [local / f for f in shards] if shards is not None else sorted(local.glob("*.safetensors"))
    if not files:
        raise BadInputError(f"target {target} ({local}) has no .safetensors weights")
    # Locate every wanted key by the file headers first; read only the tensors needed.
    located: dict[str, tuple[Path, str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                for name in (*names, "embed"):
                    if name not in located and _TENSOR_KEYS[name](key):
                        located[name] = (f, key)
    tied = getattr(text_config(config), "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)
    if "head" in names and "head" not in located:
        if not tied:
            raise BadInputError(f"no 'lm_head.weight' in {local} and the config does not tie it to the embeddings")
        if "embed" in located:  # tied: the head is the embedding matrix
            located["head"] = located["embed"]
    spelled = {"embed": "*embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
    for name in names:
        if located.get(name) is None:
            missing = "embed" if name == "head" else name  # a tied head without embeddings
            raise BadInputError(f"no '{spelled[missing]}' tensor in the safetensors files of {local}")
    read: dict[tuple[Path, str], torch.Tensor] = {}  # a tied head and the embeddings: one tensor, read once
    for f, key in {located[n] for n in names}:
        with safe_open(str(f), framework="pt") as st:
            read[(f, key)] = st.get_tensor(key)
    return config, {n: read[located[n]] for n in names}
