"""Training batches, and where a run's states come from (:class:`Source`): standardized shards
here (:class:`OfflineSource`), the target in the loop in eagle3_train/training/online.py.

Every sample of a split is indexed once, in sample-id order (shard, token offset, length), so the
epochs depend on the samples alone, not on how a dump grouped them into shards: online training
over the prepared data plans the very same micro-batches. An epoch is a deterministic
function of (seed, epoch): samples are shuffled across shards, grouped into length-sorted windows
(little padding), cut into micro-batches under a token budget, and the micro-batches shuffled.
Micro-batch ``m`` goes to data-parallel rank ``m % world`` as accumulation step
``(m // world) % grad_accum`` of optimizer step ``m // (world * grad_accum)``; one process with
``grad_accum * world`` accumulation steps therefore sees exactly the same micro-batches per
optimizer step as ``world`` processes do, and a run resumed at step s continues at micro-batch
``s * world * grad_accum`` of the same epoch: no sample is seen twice or skipped.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open

from eagle3_train.core.contract import CaptureSpec, read_manifest
from eagle3_train.core.errors import BadInputError, ConfigError, ContractError
from eagle3_train.core.fileio import sha256_json
from eagle3_train.core.formats import SHARD_SUFFIX, ShardRecord, check_shard
from eagle3_train.core.storage import DTYPE, FP8_STORAGE, dequantize, scale_key
from eagle3_train.core.threads import settle_torch_threads
from eagle3_train.core.vocab import VocabMap, load_vocab_map
from eagle3_train.targets import config_hash, load_target_tensors, text_config

if TYPE_CHECKING:
    from eagle3_train.training.config import LoopConfig

SORT_WINDOW = 64  # micro-batches' worth of samples sorted together by length


@dataclass
class Batch:
    """A padded micro-batch (right padding; ``lengths`` says where each row ends)."""

    aux_hidden: torch.Tensor  # [B, T, n_aux*H]
    last_hidden: torch.Tensor  # [B, T, H]
    input_ids: torch.Tensor  # int64 [B, T]
    loss_mask: torch.Tensor  # bool [B, T]
    lengths: torch.Tensor  # int64 [B]
    sample_ids: torch.Tensor  # int64 [B]
    aux_scale: torch.Tensor | None = None  # fp8 storage: float32 [B, T, n_aux] (aux_hidden is e4m3)
    last_scale: torch.Tensor | None = None  # fp8 storage: float32 [B, T, 1] (last_hidden is e4m3)

    def pin(self) -> Batch:
        """The same batch in page-locked memory (asynchronous copies to the GPU)."""
        scales = (None if s is None else s.pin_memory() for s in (self.aux_scale, self.last_scale))
        return Batch(
            self.aux_hidden.pin_memory(),
            self.last_hidden.pin_memory(),
            self.input_ids.pin_memory(),
            self.loss_mask.pin_memory(),
            self.lengths.pin_memory(),
            self.sample_ids,
            *scales,
        )

    def to(self, device: torch.device, dtype: torch.dtype) -> Batch:
        """On ``device``, states in ``dtype``; fp8-stored states cross as fp8 and are dequantized there."""
        f = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        aux, last = f(self.aux_hidden), f(self.last_hidden)
        if self.aux_scale is not None:
            aux, last = dequantize(aux, f(self.aux_scale), dtype), dequantize(last, f(self.last_scale), dtype)
        return Batch(
            aux.to(dtype), last.to(dtype), f(self.input_ids), f(self.loss_mask), f(self.lengths), self.sample_ids
        )


class ShardSplit:
    """The samples of one split directory, readable by index.

    Each shard is checked against the sha256 recorded beside it when this process first reads its
    tensors (once: the open handle is the verdict), so a corrupt shard stops the run by name.

    Args:
        directory: ``<standardized>/train`` or ``<standardized>/eval``.
        records: the shard records listed for it in the manifest.
        max_length: samples longer than this are cut (their tail is not trained on).
        storage: how the shards store the states (fp8: batches carry the scales, see :class:`Batch`).
    """

    def __init__(self, directory: Path, records: list[ShardRecord], max_length: int, storage: str = DTYPE):
        self.directory = directory
        self.states = ["aux_hidden", "last_hidden"]
        if storage == FP8_STORAGE:
            self.states += [scale_key(k) for k in self.states]
        self.paths = [directory / f"{r.name}{SHARD_SUFFIX}" for r in records]
        shard, start, length, sid = [], [], [], []
        for i, path in enumerate(self.paths):
            if not path.is_file():
                raise BadInputError(f"shard {path} listed in the manifest is missing")
            try:  # only the small index tensors here; a garbled index is blamed on the checksum if it differs
                with safe_open(str(path), framework="pt") as f:
                    cu = f.get_tensor("cu_seqlens").numpy()
                    ids = f.get_tensor("sample_ids").numpy()
                sane = len(cu) == len(ids) + 1 and cu[0] == 0 and bool((np.diff(cu) > 0).all())
            except Exception:
                sane = False
            if not sane:
                check_shard(path)
                raise BadInputError(f"shard {path} has no valid cu_seqlens / sample_ids")
            shard.append(np.full(len(ids), i))
            start.append(cu[:-1])
            length.append(np.minimum(np.diff(cu), max_length))
            sid.append(ids)
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
        order = np.argsort(cat(sid), kind="stable")  # sample-id order (see the module docstring)
        self.shard, self.start, self.length, self.sample_id = (
            cat(x).astype(np.int64)[order] for x in (shard, start, length, sid)
        )
        self._handles: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.length)

    def _open(self, i: int):
        if i not in self._handles:
            check_shard(self.paths[i])
            self._handles[i] = safe_open(str(self.paths[i]), framework="pt")
        return self._handles[i]

    def batch(self, indices: np.ndarray) -> Batch:
        """Read and right-pad the samples ``indices`` (positions in this split's index)."""
        lengths = self.length[indices]
        b, t = len(indices), int(lengths.max())
        rows = []
        for i in indices:
            f, s, n = self._open(int(self.shard[i])), int(self.start[i]), int(self.length[i])
            rows.append({k: f.get_slice(k)[s : s + n] for k in (*self.states, "input_ids", "loss_mask")})
        padded = {k: rows[0][k].new_zeros(b, t, rows[0][k].shape[-1]) for k in self.states}  # [B, T, width]
        for r, row in enumerate(rows):
            for k, v in padded.items():
                v[r, : int(lengths[r])] = row[k]
        ids, mask = pad_tokens([row["input_ids"] for row in rows], [row["loss_mask"] for row in rows], lengths)
        scales = [padded.get(scale_key(k)) for k in ("aux_hidden", "last_hidden")]
        return Batch(
            padded["aux_hidden"],
            padded["last_hidden"],
            ids,
            mask,
            torch.from_numpy(lengths.copy()),
            torch.from_numpy(self.sample_id[indices]),
            *scales,
        )


def pad_tokens(ids: Sequence[Any], masks: Sequence[Any], lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids and loss masks (arrays or tensors, each cut to its length) right-padded:
    int64 [B, T] and bool [B, T], T the longest length."""
    out_ids = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.int64)
    out_mask = torch.zeros(out_ids.shape, dtype=torch.bool)
    for r, n in enumerate(lengths.tolist()):
        out_ids[r, :n] = torch.as_tensor(ids[r][:n]).long()
        out_mask[r, :n] = torch.as_tensor(masks[r][:n]).bool()
    return out_ids, out_mask


def plan_epoch(lengths: np.ndarray, max_tokens: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Micro-batches of sample indices for one epoch, each within ``max_tokens`` padded tokens."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    window = max(1, SORT_WINDOW * max(1, max_tokens // max(1, int(np.median(lengths)) if len(lengths) else 1)))
    batches: list[np.ndarray] = []
    for w in range(0, len(order), window):
        chunk = order[w : w + window]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        current: list[int] = []
        for i in chunk:
            if current and (len(current) + 1) * lengths[current[0]] > max_tokens:
                batches.append(np.array(current))
                current = []
            current.append(int(i))
        if current:
            batches.append(np.array(current))
    return [batches[i] for i in rng.permutation(len(batches))]


def steps_in_epoch(n_batches: int, world: int, grad_accum: int) -> int:
    """Optimizer steps an epoch holds; the last incomplete step's micro-batches are dropped."""
    return n_batches // (world * grad_accum)


@dataclass(frozen=True)
class BatchPlan:
    """How a run's epochs are cut into micro-batches (:func:`batch_plan`).

    Attributes:
        tokens: each micro-batch's budget of padded tokens (``plan_epoch``'s ``max_tokens``).
        epoch_steps: the optimizer steps of each epoch at that budget.
        steps_at_max: the steps all epochs hold at ``loop.max_tokens_per_batch`` (``sum(epoch_steps)``
            unless ``loop.min_steps`` shrank the budget).
    """

    tokens: int
    epoch_steps: list[int]
    steps_at_max: int

    def note(self, o: LoopConfig) -> str | None:
        """The line a run logs when ``loop.min_steps`` shrank its micro-batches (None when it did not)."""
        if self.tokens == o.max_tokens_per_batch:
            return None
        held = sum(self.epoch_steps)
        head = (
            f"eagle3-train: loop.min_steps={o.min_steps}: the epochs hold {self.steps_at_max} steps at "
            f"loop.max_tokens_per_batch={o.max_tokens_per_batch}"
        )
        if held < min_steps(o):
            return f"{head}; one sample per micro-batch gives {held}, the most this split holds"
        return f"{head}, so micro-batches hold at most {self.tokens} tokens: {held} steps"


def min_steps(o: LoopConfig) -> int:
    """The steps ``loop.min_steps`` asks the epochs to hold: never more than ``loop.max_steps``."""
    return o.min_steps if o.max_steps is None else min(o.min_steps, o.max_steps)


def batch_plan(lengths: np.ndarray, o: LoopConfig, world: int, tokens: int | None = None) -> BatchPlan:
    """The micro-batch budget and the optimizer steps in each of ``o.epochs`` epochs over samples of
    ``lengths`` (``o``: the ``loop.*`` options; epochs shuffle differently, so their micro-batch
    counts can differ by a few). The budget is ``loop.max_tokens_per_batch``, or where the epochs
    hold fewer than ``loop.min_steps`` steps at it (counted up to ``loop.max_steps``), the largest
    budget whose epochs hold that many (at the least one sample per micro-batch); ``tokens``: the
    budget a resumed run began with, kept whatever its raised ``loop.epochs`` would now give.
    Refuses a split too small for one step."""

    def counts(budget: int) -> tuple[list[int], list[int]]:
        n_batches = [len(plan_epoch(lengths, budget, o.seed, e)) for e in range(o.epochs)]
        return n_batches, [steps_in_epoch(n, world, o.grad_accum) for n in n_batches]

    want = min_steps(o)
    n_batches, steps = counts(o.max_tokens_per_batch)
    at_max = sum(steps)
    if tokens is not None:
        if tokens != o.max_tokens_per_batch:
            n_batches, steps = counts(tokens)
    elif at_max >= want:
        tokens = o.max_tokens_per_batch
    else:
        enough, short = 1, o.max_tokens_per_batch  # a budget that gives the steps (or the least one), one short
        n_batches, steps = counts(1)
        if sum(steps) >= want:
            while short - enough > 1:  # fewer tokens per micro-batch, more micro-batches
                mid = (enough + short) // 2
                found = counts(mid)
                if sum(found[1]) >= want:
                    enough, (n_batches, steps) = mid, found
                else:
                    short = mid
        tokens = enough
    if min(steps) == 0:
        raise ConfigError(
            f"one optimizer step needs {world * o.grad_accum} micro-batches, the training split "
            f"gives {min(n_batches)}: lower loop.grad_accum or loop.max_tokens_per_batch"
        )
    return BatchPlan(tokens, steps, at_max)


def micro_batches_for(plan: list[np.ndarray], step: int, rank: int, world: int, grad_accum: int) -> list[np.ndarray]:
    """The micro-batches rank ``rank`` runs for optimizer ``step`` (within the epoch)."""
    base = step * world * grad_accum
    return [plan[base + g * world + rank] for g in range(grad_accum)]


class Source(ABC):
    """Where a run's samples and their states come from (``source=``): a dump's standardized
    shards (:class:`OfflineSource`) or the target run in the loop (``eagle3_train.training.online``). For the
    same data both give the same splits, vocab map, capture spec and micro-batches, so the trainer
    never asks which one it has.

    Attributes:
        spec: the capture the draft trains on (recorded in every checkpoint, read by export).
        vocab: the draft vocab map; ``vocab_sha`` its file's sha256.
        train_split, eval_split: the samples by index: ``length`` (int64 per sample, cut at the
            token budget), ``len()``, and ``batch(indices)``, a host micro-batch with ``pin()``.
        where: how messages name the data.
        data_fingerprint: the data's content (a run continues only on the same).
    """

    spec: CaptureSpec
    vocab: VocabMap
    vocab_sha: str
    train_split: Any
    eval_split: Any
    where: str
    data_fingerprint: str

    @abstractmethod
    def target_tensors(self, names: tuple[str, ...]) -> tuple[Any, dict[str, torch.Tensor]]:
        """The target's config and its tensors ``names`` (``embed``, ``head``, ``norm``: the final
        RMSNorm weight); refuses a target the states were not captured from."""

    @abstractmethod
    def device_batches(self, batches: Iterator[Any]) -> Iterator[Batch]:
        """Host micro-batches (of a split's ``batch``) as :class:`Batch` es on the device, in the
        training dtype, in the same order."""

    states_from: dict[str, Any] | None = None
    """what computed the states (engine, version, dtype, quantization, parallelism), as the
    checkpoint and the export record it; None where unknown"""

    def close(self) -> None:
        """Let go of what the source holds (connections, engines it started)."""


class OfflineSource(Source):
    """Standardized shards (``eagle3-standardize``'s out): the states a dump captured.

    Args:
        data: the standardized directory.
        target: the target whose embeddings and lm_head are read (safetensors only).
        cache_dir: where GGUF targets are converted once.
        max_length: samples are cut at this many tokens (the token budget of a micro-batch).
        device, dtype: where and in what dtype batches train.
    """

    def __init__(
        self, data: str, target: str, cache_dir: str | None, max_length: int, device: torch.device, dtype: torch.dtype
    ):
        self.data_dir = Path(data).expanduser()
        self.where, self.target, self.cache_dir = str(self.data_dir), target, cache_dir
        self.device, self.dtype = device, dtype
        self.manifest = read_manifest(self.data_dir, option="data")
        if self.manifest["stage"] != "standardize":
            hint = " (a prepared dataset trains with source=online)" if self.manifest["stage"] == "prepare" else ""
            raise ContractError(
                f"{self.data_dir} holds the output of stage '{self.manifest['stage']}', not of eagle3-standardize{hint}"
            )
        self.spec = CaptureSpec.from_dict(self.manifest["capture"])
        self.vocab, self.vocab_sha = self._load_vocab()
        self.data_fingerprint = sha256_json(
            {split: [r["sha256"] for r in rows] for split, rows in self.manifest["shards"].items()}
        )
        records = lambda split: [ShardRecord.from_dict(r) for r in self.manifest["shards"][split]]  # noqa: E731
        self.train_split = ShardSplit(self.data_dir / "train", records("train"), max_length, self.spec.storage)
        self.eval_split = ShardSplit(self.data_dir / "eval", records("eval"), max_length, self.spec.storage)

    def _load_vocab(self) -> tuple[VocabMap, str]:
        path = self.data_dir / self.manifest["vocab"]["file"]
        if not path.is_file():
            raise BadInputError(f"{self.data_dir} has no vocab map ({path.name}); run eagle3-standardize again")
        vocab, sha = load_vocab_map(path, self.spec.vocab_size)
        if sha != self.manifest["vocab"]["sha256"]:
            raise ContractError(
                f"{path} is not the vocab map recorded in {self.data_dir}/manifest.json (sha256 differs)"
            )
        return vocab, sha

    def target_tensors(self, names: tuple[str, ...]) -> tuple[Any, dict[str, torch.Tensor]]:
        """Read from the target's safetensors files; the data must come from this target: same
        sizes and config."""
        config, tensors = load_target_tensors(self.target, names, cache_dir=self.cache_dir)
        c = text_config(config)
        have = {
            "hidden_size": self.spec.hidden_size,
            "vocab_size": self.spec.vocab_size,
            "num_hidden_layers": self.spec.num_hidden_layers,
        }
        want = {k: getattr(c, k) for k in have}
        diffs = [f"{k}: data {have[k]} != target {want[k]}" for k in have if have[k] != want[k]]
        mine = config_hash(config)
        if mine != self.spec.target.config_hash:
            diffs.append(f"target.config_hash: data {self.spec.target.config_hash[:12]} != target {mine[:12]}")
        if diffs:
            raise ContractError(
                f"{self.data_dir} was captured from {self.spec.target.path}, not from target {self.target}:\n  "
                + "\n  ".join(diffs)
            )
        return config, tensors

    def device_batches(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        for batch in batches:
            yield batch.to(self.device, self.dtype)


class Prefetcher:
    """Runs an iterator on a background thread, ``depth`` items ahead (reading and padding the
    next micro-batches while the GPU trains on this one). Errors surface at ``next``."""

    def __init__(self, items: Iterator[Any], depth: int):
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        settle_torch_threads()
        self.thread = threading.Thread(target=self._fill, args=(items,), daemon=True)
        self.thread.start()

    def _fill(self, items: Iterator[Any]) -> None:
        try:
            for item in items:
                self.queue.put((item, None))
        except BaseException as e:
            self.queue.put((None, e))
        self.queue.put((None, StopIteration()))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        item, error = self.queue.get()
        if error is not None:
            raise error
        return item


def epoch_of(step: int, epoch_steps: list[int]) -> tuple[int, int]:
    """(epoch, step within it) of a global optimizer step, epochs having ``epoch_steps`` steps."""
    for epoch, n in enumerate(epoch_steps):
        if step < n:
            return epoch, step
        step -= n
    return len(epoch_steps), step
