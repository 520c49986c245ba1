"""The train/eval split rule, one for every stage that holds samples out: eagle3-standardize (over
a dump's sample ids) and online training (over a prepared dataset's), so the same samples are held
out for the same fraction and seed whichever way a run gets its states."""

from __future__ import annotations

import numpy as np

EVAL_FRACTION = 0.05  # the default share of samples held out for evaluation
SPLIT_SEED = 0  # the default seed of the split
# sample id bits below COPY_SHIFT name a conversation; bits 48-55, which copy of it (eagle3-prepare
# repeat=); bits 56-62, which of its assistant turns a sample holds (conversations rendered per turn)
COPY_SHIFT = 48
TURN_SHIFT = 56
MAX_COPIES = 1 << (TURN_SHIFT - COPY_SHIFT)  # copies a conversation may have
MAX_TURNS = 1 << (63 - TURN_SHIFT)  # turn samples a conversation may have (ids stay positive int64)


def copy_id(sample_id: np.ndarray | int, copy: np.ndarray | int, turn: np.ndarray | int = 0) -> np.ndarray | int:
    """The sample id of copy ``copy`` (0: the original) of the conversation ``sample_id``, and of
    its assistant turn ``turn`` where it is rendered per turn (0 otherwise)."""
    return sample_id + (copy << COPY_SHIFT) + (turn << TURN_SHIFT)


def split_eval(sample_ids: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """The held-out sample ids: the ``round(fraction * n)`` ids that rank first under a hash of
    (seed, id). Deterministic per seed, and a sample's fate depends on its id alone, not on the
    order or grouping of the data. Copies and turn samples of one conversation (ids that differ only
    above ``COPY_SHIFT``) hash alike and are held out or kept together: a copy held out beside one trained
    on would measure the training data. Where the cut falls inside such a group the whole group is
    held out (unless that would hold out everything)."""
    n = len(sample_ids)
    k = int(round(fraction * n))
    if fraction > 0 and n >= 2:
        k = min(max(k, 1), n - 1)
    base = sample_ids.astype(np.uint64) & np.uint64((1 << COPY_SHIFT) - 1)
    keys = _mix64(base ^ _mix64(np.array([seed], dtype=np.uint64))[0])
    order = np.argsort(keys, kind="stable")
    if 0 < k < n and keys[order[k]] == keys[order[k - 1]]:  # the cut splits a group of copies
        whole = int(np.searchsorted(keys[order], keys[order[k - 1]], side="right"))
        k = whole if whole < n else int(np.searchsorted(keys[order], keys[order[k - 1]], side="left"))
    return np.sort(sample_ids[order[:k]])


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixed 64-bit hash."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def check_fraction(value: float, option: str = "eval_fraction") -> None:
    """Refuse a held-out share outside [0, 1) (nan included) with a one-line ConfigError."""
    from eagle3_train.core.errors import ConfigError

    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{option} must be in [0, 1), got {value}")
