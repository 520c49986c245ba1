"""A new draft head for a target: its shape from the target's config, its embeddings and vocab map
from the target and the data, its lm_head and final norm as ``model.*`` options say."""

from __future__ import annotations

from dataclasses import replace

import torch

from eagle3_train.core.contract import CaptureSpec
from eagle3_train.core.vocab import VocabMap
from eagle3_train.model import DraftConfig, Eagle3Draft
from eagle3_train.training.config import ModelOptions
from eagle3_train.training.data import Source


def build_draft(
    options: ModelOptions, source: Source, spec: CaptureSpec, vocab: VocabMap, seed: int
) -> tuple[torch.Tensor, Eagle3Draft]:
    """The target's lm_head [V_target, H] (frozen: the training targets are its logits) and a new
    draft (fp32, on the CPU) for ``spec``'s aux layers and ``vocab``, initialised with ``seed``."""
    from_target = ("embed", "head", "norm") if options.lm_head_init == "target" else ("embed", "head")
    target_config, tensors = source.target_tensors(from_target)
    draft_cfg = DraftConfig.from_target(target_config, len(spec.aux_indices), vocab.draft_vocab_size)
    torch.manual_seed(seed)
    draft_cfg = replace(
        draft_cfg,
        **options.head_flags(),
        intermediate_size=options.intermediate_size or draft_cfg.intermediate_size,
    )
    model = Eagle3Draft(draft_cfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(tensors["embed"])
        model.d2t.copy_(vocab.d2t)
        model.t2d.copy_(vocab.t2d)
    init_head(model, options, vocab, tensors["head"], tensors.get("norm"))
    return tensors["head"], model


def init_head(
    model: Eagle3Draft, options: ModelOptions, vocab: VocabMap, head: torch.Tensor, norm: torch.Tensor | None
) -> None:
    """``model.lm_head_init`` and ``model.freeze_lm_head``; head [V_target, H], norm [H]."""
    if options.lm_head_init == "target":
        with torch.no_grad():
            # draft token i is target id t2d.nonzero()[i] (= i + d2t[i]): the draft vocab is sorted
            # by target id, so these rows are in draft order. [V_draft, H]
            model.lm_head.weight.copy_(head[vocab.t2d.nonzero().squeeze(1)])
            # The target's rows were fitted to read the output of its final norm. With that norm's
            # weight, the draft's logits are the target's own on whatever pre-norm state the layer
            # produces, so the layer starts by approximating the target's last pre-norm hidden
            # state; a unit weight would feed the rows differently scaled features.
            assert norm is not None  # fetched with the head when lm_head_init=target
            model.norm.weight.copy_(norm)
    model.lm_head.weight.requires_grad_(not options.freeze_lm_head)
