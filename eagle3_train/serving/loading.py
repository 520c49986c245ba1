"""A draft directory (ours, or another framework's export) built into an :class:`Eagle3Draft` as an
engine computes it: its config read by :mod:`eagle3_train.serving.drafts`, the forward flags that
engine honours, the weights it loads, and the target's embeddings (as SGLang does).

    draft, dd = load_draft_dir(Path("runs/x/export"), target, "vllm")
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from eagle3_train.core.errors import BadInputError, ContractError
from eagle3_train.model import DraftConfig, Eagle3Draft
from eagle3_train.serving.drafts import DraftDir, read_draft_dir
from eagle3_train.serving.export import draft_config_from_json
from eagle3_train.targets import Target

logger = logging.getLogger(__name__)


def load_draft(directory: Path, target: Target, engine: str = "sglang") -> tuple[Eagle3Draft, dict]:
    """Build the draft from a draft directory (ours or another framework's export) as ``engine``
    computes it; the embeddings are the target's. Returns the draft and its config.json."""
    draft, dd = load_draft_dir(directory, target, engine)
    return draft, dd.config


def load_draft_dir(
    directory: Path, target: Target, engine: str = "sglang", as_trained: bool = False
) -> tuple[Eagle3Draft, DraftDir]:
    """:func:`load_draft`, with the directory as read (:class:`eagle3_train.serving.drafts.DraftDir`):
    its producer, what it records, the forward flags ``engine`` honours (``as_trained``: those its
    producer trained with, where they differ)."""
    if not (directory / "config.json").is_file() or not list(directory.glob("*.safetensors")):
        raise BadInputError(
            f"{directory} lacks config.json or model.safetensors (or other *.safetensors weights): not an exported draft"
        )
    dd = read_draft_dir(directory)
    weights = dd.weights()
    if "fc.weight" not in weights:
        raise BadInputError(f"{directory}: its weights have no fc.weight")
    dc = _draft_config(directory, dd, weights["fc.weight"].shape[1], as_trained)
    for name in dd.skipped_by(engine):  # loaded and never applied by the engine: left out as it leaves them
        logger.warning(f"eagle3-eval: {directory} ({dd.title}): {engine} does not apply {name}; nor does eval")
        weights.pop(name)
    if (refusal := dd.refusal(engine, weights["fc.weight"].shape[1])) is not None:
        raise ContractError(f"{directory} ({dd.title}): {refusal}")
    dc = replace(dc, **vars(dd.trained_flags() if as_trained else dd.flags(engine)))
    if dc.vocab_size != target.vocab_size or dc.hidden_size != target.hidden_size:
        raise ContractError(
            f"{directory}: draft vocab {dc.vocab_size} / hidden {dc.hidden_size} do not fit target "
            f"{target.identity.path} (vocab {target.vocab_size}, hidden {target.hidden_size})"
        )
    model = Eagle3Draft(dc)
    weights["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().float()
    _complete_vocab_maps(weights, dc)
    _load_weights(model, weights, f"{directory} ({dd.title})")
    ids = weights["d2t"] + torch.arange(dc.draft_vocab_size)
    if ids.min() < 0 or ids.max() >= dc.vocab_size:
        raise ContractError(f"{directory}: d2t maps draft ids outside the target vocab of {dc.vocab_size}")
    return model.eval(), dd


def _draft_config(directory: Path, dd: DraftDir, fc_width: int, as_trained: bool) -> DraftConfig:
    """The draft's shapes from its config.json (``as_trained``: the layer its producer trained, which
    it must be able to say); a missing or malformed field is refused naming the file."""
    try:
        dc = draft_config_from_json(dd.trained_layer() if as_trained else dd.layer, fc_width)
    except KeyError as e:
        raise BadInputError(f"{directory}/config.json ({dd.title}): no {e.args[0]}") from e
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise BadInputError(
            f"{directory}/config.json ({dd.title}): a shape field is missing or not a number ({e})"
        ) from e
    if as_trained and (why := dd.as_trained_refusal()) is not None:
        raise ContractError(f"{directory} ({dd.title}): as_trained=true: {why}")
    return dc


def _complete_vocab_maps(weights: dict[str, torch.Tensor], dc: DraftConfig) -> None:
    """``d2t`` (zeros: the draft vocab is the target's first ids) and ``t2d`` (from ``d2t``) where
    the directory holds none."""
    if "d2t" not in weights:
        weights["d2t"] = torch.zeros(dc.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in weights:  # ModelOpt writes none: the engines do not read it
        ids = weights["d2t"] + torch.arange(dc.draft_vocab_size)
        weights["t2d"] = torch.zeros(dc.vocab_size, dtype=torch.bool).index_fill_(
            0, ids.clamp(0, dc.vocab_size - 1), True
        )


def _load_weights(model: Eagle3Draft, weights: dict[str, Any], where: str) -> None:
    """Load ``weights`` into ``model``, refusing any of another shape than the config makes it, and
    any missing or unexpected name."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [
        f"{k} {tuple(v.shape)} (the config makes it {shapes[k]})"
        for k, v in weights.items()
        if k in shapes and tuple(v.shape) != shapes[k]
    ]
    if wrong:
        raise BadInputError(f"{where}: weights of another shape than its config.json says: {wrong}")
    missing, unexpected = model.load_state_dict({k: v for k, v in weights.items()}, strict=False)
    if missing or unexpected:
        raise BadInputError(f"{where}: weights missing {missing}, unexpected {unexpected}")
