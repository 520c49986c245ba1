"""What a training run reports: ``metrics.jsonl`` lines on rank 0, the optional wandb tracker,
the per-step figures gathered over ranks, and the console lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_train.core.dist import all_gather_objects
from eagle3_train.core.fileio import atomic_write_bytes
from eagle3_train.training.data import Batch
from eagle3_train.training.objective import acceptance_length, accuracies, decode_walk
from eagle3_train.training.tracking import Tracker


class MetricsLog:
    """``metrics.jsonl`` (one JSON line per record) and, with ``tracker``, the same figures there
    (lists flattened as ``name/j``); writes on the main rank only.

    Args:
        path: the metrics file.
        is_main: whether this rank writes.
        tracker: a :class:`~eagle3_train.training.tracking.Tracker` (a wandb run, TensorBoard), or None.
    """

    def __init__(self, path: Path, is_main: bool, tracker: Tracker | None = None):
        self.path, self.is_main, self.tracker = path, is_main, tracker

    def log(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tracker is not None:
            flat = {k: v for k, v in record.items() if not isinstance(v, list)}
            for k, v in record.items():
                if isinstance(v, list):
                    flat |= {f"{k}/{j}": x for j, x in enumerate(v)}
            self.tracker.log(flat, step=record["step"])

    def evals(self) -> list[dict[str, Any]]:
        """The evaluation records written so far."""
        return [json.loads(line) for line in self.path.read_text().splitlines() if "eval_acc" in line]

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.finish()


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of steps up to ``step``, the checkpoint a run resumes from: a killed run
    logged steps past it, which the resumed run logs again (and a line the kill cut short)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if line.endswith("\n") and json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a line the kill cut short
    atomic_write_bytes(path, "".join(kept).encode())


def device_memory(device: torch.device) -> dict[str, float]:
    """The accelerator's peak memory on this rank since the run began, in GiB: what tensors held at
    most (``gpu_peak_alloc_gib``) and what PyTorch's caching allocator took from the device
    (``gpu_peak_reserved_gib``; nvidia-smi shows that plus the CUDA context). Nothing on a CPU."""
    if device.type != "cuda":
        return {}
    return {
        "gpu_peak_alloc_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
        "gpu_peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2),
    }


def train_record(
    step: int, counts: np.ndarray, loss: float, tokens: int, seconds: float, lr: float, sp_size: int
) -> dict[str, Any]:
    """Metrics of the steps since the last record, over all ranks (the loss is the mean of the
    ranks' micro-batch means: what the averaged gradient descends); collective."""
    gathered = all_gather_objects((counts, tokens, loss))
    counts = sum(g[0] for g in gathered)
    tokens = sum(g[1] for g in gathered) // sp_size  # a sequence-parallel group reads one batch
    loss = sum(g[2] for g in gathered) / len(gathered) * sp_size  # and its shards' losses add up
    acc, acc_in_vocab = accuracies(counts)
    return {
        "step": step,
        "loss": loss,
        "acc": acc,
        "tau": acceptance_length(acc),
        "acc_in_vocab": acc_in_vocab,
        "tau_in_vocab": acceptance_length(acc_in_vocab),
        "lr": lr,
        "tokens_per_s": tokens / max(seconds, 1e-9),
    }


def walk_counts(batch: Batch, hits: torch.Tensor) -> np.ndarray:
    """[tokens, verify steps] of :func:`decode_walk` over the batch's rows; hits [k, B, T]."""
    h = hits.bool().cpu().numpy()
    answer = (
        (
            batch.loss_mask
            & (torch.arange(batch.input_ids.shape[1], device=batch.lengths.device)[None] < batch.lengths[:, None])
        )
        .cpu()
        .numpy()
    )  # [B, T]
    return np.asarray(np.sum([decode_walk(h[:, i], answer[i]) for i in range(len(answer))], axis=0, dtype=np.int64))


def eval_line(r: dict[str, Any]) -> str:
    """One evaluation as a console line."""
    return (
        f"eval at step {r['step']}: acc per step {[round(a, 3) for a in r['eval_acc']]}, simulated tau "
        f"{r['eval_tau']:.2f} (walked as decoding visits positions: {r['eval_tau_decoded']:.2f}; over in-vocab "
        f"positions: {r['eval_tau_in_vocab']:.2f}; the draft vocab covers {r['eval_vocab_coverage']:.1%} of the "
        f"target's argmaxes)"
    )


def train_line(r: dict[str, Any], total_steps: int) -> str:
    """One training record as a console line."""
    return (
        f"step {r['step']}/{total_steps} loss {r['loss']:.4f} acc {' '.join(f'{a:.3f}' for a in r['acc'])} "
        f"tau {r['tau']:.2f} (in-vocab {r['tau_in_vocab']:.2f}) lr {r['lr']:.2e} {r['tokens_per_s']:.0f} tok/s"
    )


def bar_postfix(r: dict[str, Any]) -> dict[str, str]:
    """A training record's figures beside the progress bar."""
    return {
        "loss": f"{r['loss']:.3f}",
        "acc0": f"{r['acc'][0]:.2f}",
        "tau": f"{r['tau']:.2f}",
        "lr": f"{r['lr']:.1e}",
        "tok_s": f"{r['tokens_per_s']:.0f}",
    }
