"""The target: loaded (:mod:`~eagle3_train.targets.loading`), identified
(:mod:`~eagle3_train.targets.identity`), its chat template (:mod:`~eagle3_train.targets.template`),
GGUF files converted (:mod:`~eagle3_train.targets.gguf`), a few tensors read alone
(:mod:`~eagle3_train.targets.tensors`); tiny test targets (:mod:`~eagle3_train.targets.tiny`).
"""

from eagle3_train.targets.gguf import EMBEDDED_GGUF, EMBEDDED_PACKAGE, convert_gguf
from eagle3_train.targets.identity import config_hash, target_identity, text_config, tokenizer_hash
from eagle3_train.targets.loading import (
    Target,
    eos_ids,
    load_target,
    resolve_dtype,
    resolve_local_dir,
    tensor_parallel_kwargs,
)
from eagle3_train.targets.template import (
    TEMPLATE_KWARGS_ATTR,
    chat_template_of,
    set_template_kwargs,
    template_kwargs,
)
from eagle3_train.targets.tensors import WEIGHT_INDEX, load_target_tensors

__all__ = [
    "EMBEDDED_GGUF",
    "EMBEDDED_PACKAGE",
    "TEMPLATE_KWARGS_ATTR",
    "WEIGHT_INDEX",
    "Target",
    "chat_template_of",
    "config_hash",
    "convert_gguf",
    "eos_ids",
    "load_target",
    "load_target_tensors",
    "resolve_dtype",
    "resolve_local_dir",
    "set_template_kwargs",
    "target_identity",
    "template_kwargs",
    "tensor_parallel_kwargs",
    "text_config",
    "tokenizer_hash",
]
