"""The dump's shard writer: samples are packed into host buffers and written on background
threads, so the target's next forward pass (or the next engine responses) overlap the disk."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import torch

from eagle3_train.core.errors import Eagle3Error
from eagle3_train.core.formats import write_shard
from eagle3_train.core.storage import DTYPE, encode, layout
from eagle3_train.core.threads import settle_torch_threads


class HostShard:
    """A reusable host buffer one shard is assembled in (pinned when CUDA is present, so the
    GPU copies into it asynchronously and the writer streams it to disk without another copy)."""

    def __init__(self, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]], capacity: int, pin: bool):
        self.states = {
            k: torch.empty((capacity, *shape), dtype=dtype, pin_memory=pin) for k, (dtype, shape) in shapes.items()
        }
        self.capacity = capacity
        self.reset()

    def reset(self) -> None:
        self.tokens = 0
        self.small: list[dict[str, torch.Tensor]] = []
        self.lengths: list[int] = []

    def tensors(self) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The shard's tensors without the samples whose states are not finite, and their ids.

        A dropped sample costs one compaction copy of this shard; the common case is a view."""
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        finite = torch.cat([p["finite"] for p in self.small]) if self.small else torch.ones(0, dtype=torch.bool)
        sample_ids = (
            torch.cat([p["sample_ids"] for p in self.small]) if self.small else torch.zeros(0, dtype=torch.int64)
        )
        out = {k: v[: self.tokens] for k, v in self.states.items()}
        for key, dtype in (("input_ids", torch.int32), ("loss_mask", torch.uint8)):
            out[key] = torch.cat([p[key] for p in self.small]) if self.small else torch.zeros(0, dtype=dtype)
        nonfinite = sample_ids[~finite].tolist()
        if nonfinite:
            keep = torch.repeat_interleave(finite, lengths)
            out = {k: v[keep] for k, v in out.items()}
            lengths, sample_ids = lengths[finite], sample_ids[finite]
        out["sample_ids"] = sample_ids
        out["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        return out, nonfinite


class ShardWriter:
    """Assembles shards in host buffers and writes them on background threads.

    The main thread only launches work: each batch's states are copied from the GPU into the
    current shard's pinned buffer on a side CUDA stream (overlapping the next forward pass). A full
    shard goes to one of ``threads`` writer threads, which wait for its copies, then checksum and
    stream it to disk straight from the buffer. There are ``threads + 1`` buffers: when all are in
    flight the main thread waits, so a slow disk slows the dump instead of filling memory.

    ``storage=fp8`` quantizes each batch where its states are (on the GPU, before the copy: half
    the bytes cross to the host) into the tensors :func:`eagle3_train.core.storage.layout` names.
    """

    def __init__(
        self,
        directory: Path,
        prefix: str,
        state_keys: list[str],
        hidden: int,
        dtype: torch.dtype,
        storage: str,
        shard_tokens: int,
        max_batch_tokens: int,
        threads: int,
        device: torch.device,
    ):
        self.directory, self.prefix, self.shard_tokens = directory, prefix, shard_tokens
        self.state_keys, self.storage = state_keys, storage
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # A shard is submitted when the next batch would overflow it, so one batch always fits.
        capacity = max(shard_tokens, max_batch_tokens)
        shapes = layout(state_keys, hidden, dtype, storage)
        self.make = lambda: HostShard(shapes, capacity, self.cuda)
        self.pool: queue.Queue = queue.Queue()
        self.pool.put(None)  # a ticket: the main thread allocates its first buffer itself
        self.write_queue: queue.Queue = queue.Queue()
        self.current: HostShard | None = None
        self.count = 0
        self.bytes_written = 0
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        settle_torch_threads()
        self.writers = [threading.Thread(target=self._write, daemon=True) for _ in range(threads)]
        for t in self.writers:
            t.start()

    def add(self, piece: dict[str, torch.Tensor], lengths: list[int], ready: Any = None) -> None:
        """Append one batch: per-token states and per-sample ``finite`` flags (on the model's
        device), ``input_ids``, ``loss_mask``, ``sample_ids`` (host); ``ready`` is a CUDA event
        after which the device tensors are final (None: they already are)."""
        n = sum(lengths)
        if self.current is not None and self.current.tokens + n > self.current.capacity:
            self._submit()
        if self.current is None:
            self.current = self._take()
        shard = self.current
        if shard.tokens + n > shard.capacity:
            raise Eagle3Error(f"a batch of {n} tokens exceeds the shard buffer ({shard.capacity}); raise shard_size_mb")
        small = {k: piece[k] for k in ("input_ids", "loss_mask", "sample_ids")}
        if self.storage != DTYPE:  # on the states' device, after what produced them
            piece = piece | encode({k: piece[k] for k in self.state_keys}, self.storage)
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record()
        if self.stream is not None:  # CUDA
            self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                for key, buf in shard.states.items():
                    buf[shard.tokens : shard.tokens + n].copy_(piece[key], non_blocking=True)
                    piece[key].record_stream(self.stream)  # keep it alive until copied
                small["finite"] = torch.empty(len(lengths), dtype=torch.bool, pin_memory=True)
                small["finite"].copy_(piece["finite"], non_blocking=True)
                piece["finite"].record_stream(self.stream)
        else:
            for key, buf in shard.states.items():
                buf[shard.tokens : shard.tokens + n].copy_(piece[key])
            small["finite"] = piece["finite"]
        shard.small.append(small)
        shard.lengths += lengths
        shard.tokens += n
        if shard.tokens >= self.shard_tokens:  # full enough: do not wait for the next batch
            self._submit()

    def close(self) -> None:
        """Write what is buffered and wait for every shard; re-raise a writer's error."""
        if self.current is not None and self.current.small:
            self._submit()
        for _ in self.writers:
            self.write_queue.put(None)
        for t in self.writers:
            t.join()
        self._raise_if_failed()

    def _take(self) -> HostShard:
        while True:  # notices a dead writer instead of blocking forever
            self._raise_if_failed()
            try:
                shard = self.pool.get(timeout=0.5)
                return shard if shard is not None else self.make()
            except queue.Empty:
                continue

    def _submit(self) -> None:
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self.write_queue.put((f"{self.prefix}-{self.count:05d}", self.current, ready))
        self.current, self.count = None, self.count + 1

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _write(self) -> None:
        try:  # each writer allocates one more buffer, off the main thread (pinning is slow)
            self.pool.put(self.make())
        except BaseException as e:
            self.error = e
        while (job := self.write_queue.get()) is not None:
            name, shard, ready = job
            try:
                if self.error is None:
                    if ready is not None:
                        ready.synchronize()
                    tensors, nonfinite = shard.tensors()
                    record = write_shard(self.directory, name, tensors, {"nonfinite_sample_ids": nonfinite})
                    with self.lock:
                        self.bytes_written += record.bytes
            except BaseException as e:  # handed to the main thread at its next call
                self.error = e
            shard.reset()
            self.pool.put(shard)
