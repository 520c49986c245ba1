"""The draft vocabulary map (docs/concepts/storage.md): which target tokens the draft's lm_head predicts.

``vocab_map.safetensors`` holds ``d2t`` int64 [V_draft] as offsets (``target_id = draft_id +
d2t[draft_id]``), ``t2d`` bool [V_target] (which target ids are in the draft vocab), and
``token_counts`` int64 [V_target] (the loss-masked counts it was chosen from). The draft vocab is
the V_draft most frequent loss-masked target tokens (ties: lower id first), sorted by target id.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from eagle3_train.core.errors import BadInputError, ConfigError
from eagle3_train.core.fileio import atomic_write_bytes

logger = logging.getLogger(__name__)

DRAFT_VOCAB_SIZE = 32000  # the default size of the draft vocab (eagle3-standardize, online training)


@dataclass
class VocabMap:
    """A draft vocabulary: ``draft_ids`` (target ids, ascending) and the counts behind it."""

    draft_ids: torch.Tensor  # int64 [V_draft], ascending target ids
    token_counts: torch.Tensor  # int64 [V_target]

    @property
    def target_vocab_size(self) -> int:
        return int(self.token_counts.numel())

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        """Offsets: ``target_id = draft_id + d2t[draft_id]``."""
        return self.draft_ids - torch.arange(self.draft_vocab_size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.draft_ids] = True
        return mask

    def coverage(self) -> float:
        """Fraction of the counted tokens that the draft vocab contains."""
        total = int(self.token_counts.sum())
        return float(self.token_counts[self.draft_ids].sum()) / total if total else 0.0

    def to_bytes(self) -> bytes:
        return save({"d2t": self.d2t, "t2d": self.t2d, "token_counts": self.token_counts})

    def save(self, path: Path) -> str:
        """Write atomically; return the file's sha256 (recorded in manifests)."""
        data = self.to_bytes()
        atomic_write_bytes(path, data)
        return hashlib.sha256(data).hexdigest()


def capped_draft_size(draft_vocab_size: int, target_vocab_size: int) -> int:
    """The draft vocab size asked for, capped at the target's vocab (with a warning)."""
    if draft_vocab_size > target_vocab_size:
        logger.warning(
            f"warning: draft_vocab_size {draft_vocab_size} capped at the target vocab size {target_vocab_size}"
        )
    return min(draft_vocab_size, target_vocab_size)


def build_vocab_map(token_counts: torch.Tensor, draft_vocab_size: int) -> VocabMap:
    """The ``draft_vocab_size`` most frequent tokens (ties: lower id), sorted by target id.

    When fewer distinct tokens were seen, the lowest unseen ids fill the rest, with a warning.
    """
    counts = token_counts.to(torch.int64)
    v = counts.numel()
    if draft_vocab_size <= 0:
        raise ConfigError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    if draft_vocab_size > v:
        raise ConfigError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocab size {v}")
    # Sort by count descending, then id ascending: a stable sort on -count keeps ids ascending.
    order = torch.sort(-counts, stable=True).indices
    chosen = order[:draft_vocab_size]
    seen = int((counts > 0).sum())
    if seen < draft_vocab_size:
        logger.warning(
            f"warning: only {seen} distinct tokens occur in the training data; the draft vocab of "
            f"{draft_vocab_size} is filled with the {draft_vocab_size - seen} lowest unseen ids"
        )
    return VocabMap(torch.sort(chosen).values, counts)


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size] counts of the loss-masked tokens."""
    ids = input_ids[loss_mask.bool()].to(torch.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise BadInputError(f"token id {int(ids.max())} outside the target vocab of {vocab_size}")
    return torch.bincount(ids, minlength=vocab_size)


def load_vocab_map(path: str | Path, target_vocab_size: int | None = None) -> tuple[VocabMap, str]:
    """Read and check a ``vocab_map.safetensors``; return it and its sha256."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise BadInputError(f"vocab map {path} does not exist")
    data = path.read_bytes()
    try:
        t = load_file(str(path))
    except Exception as e:
        raise BadInputError(f"vocab map {path} is corrupt: {e}") from None
    missing = {"d2t", "t2d", "token_counts"} - set(t)
    if missing:
        raise BadInputError(f"vocab map {path} lacks {sorted(missing)}")
    d2t, t2d = t["d2t"].to(torch.int64), t["t2d"].to(torch.bool)
    draft_ids = d2t + torch.arange(len(d2t))
    v = t["token_counts"].numel()
    problems = []
    if target_vocab_size is not None and v != target_vocab_size:
        problems.append(f"it is for a target vocab of {v}, the target has {target_vocab_size}")
    if t2d.numel() != v:
        problems.append(f"t2d has {t2d.numel()} entries, token_counts {v}")
    elif len(draft_ids) and (draft_ids.min() < 0 or draft_ids.max() >= v):
        problems.append("d2t points outside the target vocab")
    elif len(draft_ids) > 1 and not bool((draft_ids[1:] > draft_ids[:-1]).all()):
        problems.append("draft ids are not strictly ascending target ids")
    elif not torch.equal(t2d.nonzero().squeeze(1), draft_ids):
        problems.append("t2d does not mark exactly the ids d2t maps to")
    if problems:
        raise BadInputError(f"vocab map {path}: " + "; ".join(problems))
    return VocabMap(draft_ids, t["token_counts"].to(torch.int64)), hashlib.sha256(data).hexdigest()
