"""``backend=hf``: the target runs here, in transformers, on every rank of ``torchrun`` (any
number of nodes; ``tp_size`` > 1 shards each copy with transformers' own tensor-parallel plan).

How it stays exact: samples are batched by length with right padding and *no* attention mask.
Attention is causal, so a real token never sees the padding that follows it, and its states are
those of the sample run alone; padded positions are dropped before anything is stored. The forward
pass is :func:`eagle3_train.core.capture.capture`, the one capture of the project; ``compile=true`` runs
its decoder layers compiled (:func:`eagle3_train.core.capture.compile_layers`), the same states within the dtype's tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from data_prep.dump import backend
from eagle3_train.core.capture import capture, compile_layers
from eagle3_train.core.dist import DistInfo, close, init_distributed
from eagle3_train.core.errors import ConfigError, Eagle3Error
from eagle3_train.targets import load_target, tensor_parallel_kwargs

if TYPE_CHECKING:
    from data_prep.dump.stage import Dumper


@dataclass
class Batch:
    """Samples (rows of the prepared dataset) run in one forward pass, longest first."""

    rows: list[int]
    lengths: list[int]

    @property
    def padded_tokens(self) -> int:
        return len(self.lengths) * max(self.lengths)


def plan_batches(rows: np.ndarray, lengths: np.ndarray, max_tokens: int, max_batch: int) -> list[Batch]:
    """Length-sorted batches within the token budget (padding included); a sample longer than
    the budget runs alone. Longest first, so an out-of-memory shows at once."""
    order = np.lexsort((rows, -lengths))
    batches: list[Batch] = []
    current = Batch([], [])
    for i in order:
        row, n = int(rows[i]), int(lengths[i])
        # sorted descending: the first sample of a batch is its longest
        if current.rows and (
            (len(current.lengths) + 1) * current.lengths[0] > max_tokens or len(current.lengths) >= max_batch
        ):
            batches.append(current)
            current = Batch([], [])
        current.rows.append(row)
        current.lengths.append(n)
    if current.rows:
        batches.append(current)
    return batches


class Backend(backend.Backend):
    """Runs the target on this rank; one writer per tensor-parallel group."""

    def team(self) -> backend.Team:
        tp = self.cfg.tp_size
        dist = init_distributed(self.cfg.device, self.cfg.dist_timeout_minutes)
        if dist.world_size % tp:
            raise ConfigError(f"world size {dist.world_size} is not a multiple of tp_size={tp}")
        self.dist = dist
        self.dp_rank, self.dp_size = dist.rank // tp, dist.world_size // tp
        self.writes = dist.rank % tp == 0  # a tensor-parallel group stores each token once
        self.target: Any = None
        return backend.Team(dist, group=True)

    def device(self, dist: DistInfo | None) -> str:
        assert dist is not None, "backend=hf computes on this process's device"
        return str(dist.device)

    def check(self, stage: Dumper) -> None:
        self.stage = stage

    def model(self) -> Any:
        """The target with its weights, loaded on first use (a finished dump never loads them)."""
        if self.target is None:
            cfg = self.cfg
            self.target = load_target(
                cfg.target,
                cache_dir=cfg.cache_dir,
                dtype=cfg.dtype,
                device=str(self.dist.device),
                trust_remote_code=cfg.trust_remote_code,
                model_kwargs=self._model_kwargs(),
            )
            if cfg.compile:
                compile_layers(self.target.model, "compile=true")
        return self.target.model

    def _model_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.cfg.attn_implementation:
            kwargs["attn_implementation"] = self.cfg.attn_implementation
        if self.cfg.tp_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(
                self.dist.device.type, (self.dp_size, self.cfg.tp_size), mesh_dim_names=("dp", "tp")
            )
            kwargs |= tensor_parallel_kwargs(mesh["tp"])
        return kwargs

    @torch.no_grad()
    def dump(self, stage: Dumper, rows: np.ndarray) -> tuple[int, int]:
        cfg = self.cfg
        batches = plan_batches(rows, stage.dataset["num_tokens"][:][rows], cfg.max_tokens_per_batch, cfg.max_batch_size)
        mine = batches[self.dp_rank :: self.dp_size]  # round-robin: ranks get similar lengths
        writer = stage.writer() if self.writes else None
        bar = stage.progress([r for b in mine for r in b.rows], f"dump rank 0/{self.dp_size}")
        samples = 0
        try:
            for batch in mine:
                piece, lengths, ready = self.capture(batch)
                if writer is not None:
                    writer.add(piece, lengths, ready)
                samples += len(batch.rows)
                bar.update(sum(batch.lengths))
                bar.set_postfix(samples=f"{samples}/{len(rows) // self.dp_size}", refresh=False)
            if writer is not None:
                writer.close()
        except OSError as e:
            raise Eagle3Error(f"writing {stage.shard_dir} failed: {e}; run the same command again to resume") from None
        finally:
            bar.close()
        if writer is None:
            return 0, 0
        return writer.bytes_written, sum(sum(b.lengths) for b in mine)

    def capture(self, batch: Batch) -> tuple[dict[str, torch.Tensor], list[int], Any]:
        """One forward pass, launched without waiting for the GPU.

        Returns the real tokens' states (on the model's device), ``finite`` (one flag per sample),
        ``input_ids``, ``loss_mask``, ``sample_ids`` (host), the sample lengths, and a CUDA event
        after which the device tensors are final. Nothing here synchronises with the GPU: dropping
        samples with non-finite states happens in the writer, once the flags reach the host.
        """
        dev, stage = self.dist.device, self.stage
        rows = [stage.dataset[int(i)] for i in batch.rows]
        lengths = torch.tensor(batch.lengths)
        width = int(lengths.max())
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : len(row["input_ids"])] = torch.from_numpy(row["input_ids"].astype(np.int64))
        valid = (torch.arange(width)[None, :] < lengths[:, None]).reshape(-1)
        token_index = valid.nonzero().squeeze(1)  # [sum(lengths)] positions in [B*W]
        sample_of_token = torch.repeat_interleave(torch.arange(len(rows)), lengths)
        ids, token_index, sample_of_token = (_to_device(t, dev) for t in (ids, token_index, sample_of_token))
        # No attention mask: right padding under causal attention never reaches a real token.
        states = capture(self.model(), ids, None, stage.stored)
        keys = {f"hidden.{k}": s for k, s in states.layers.items()} | {"last_hidden": states.last_hidden}
        # [B, W, H] -> [B*W, H] -> [sum(lengths), H]
        piece = {name: s.reshape(-1, s.shape[-1]).index_select(0, token_index) for name, s in keys.items()}
        bad_tokens = torch.zeros(len(token_index), dtype=torch.bool, device=dev)
        for t in piece.values():
            bad_tokens |= ~torch.isfinite(t).all(dim=-1)
        bad = torch.zeros(len(rows), dtype=torch.int32, device=dev).index_add_(0, sample_of_token, bad_tokens.int())
        piece["finite"] = bad == 0
        ready = None
        if dev.type == "cuda":  # the writer's copy stream waits for this
            ready = torch.cuda.Event()
            ready.record()
        piece["input_ids"] = _cat([r["input_ids"] for r in rows], np.int32)
        piece["loss_mask"] = _cat([r["loss_mask"] for r in rows], np.uint8)
        piece["sample_ids"] = torch.from_numpy(stage.sample_ids[batch.rows])
        return piece, list(batch.lengths), ready

    def run_info(self, stage: Dumper) -> dict[str, Any]:
        return {"world_size": self.dist.world_size, "tp_size": self.cfg.tp_size}

    def close(self) -> None:
        close()


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """Host -> device without a stream sync (a copy from pageable memory would wait for the GPU)."""
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def _cat(arrays: list[np.ndarray], dtype: Any) -> torch.Tensor:
    return (
        torch.from_numpy(np.concatenate(arrays).astype(dtype))
        if arrays
        else torch.zeros(0, dtype=getattr(torch, np.dtype(dtype).name))
    )
