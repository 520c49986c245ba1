"""A training run's directory and checkpoints: ``checkpoints/step<N>/`` (DeepSpeed's files, the
consolidated head ``draft.safetensors``, and ``state.json`` written last, which marks it complete),
the ``best.json`` record under ``checkpoint.keep_best``, the oldest beyond ``checkpoint.keep_last`` removed;
which checkpoint a run continues from, and the best evaluation that keep_best and early stopping
track across a resume."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3_train.core.cli import as_typed
from eagle3_train.core.contract import BEST_FILE, MANIFEST_NAME, run_checkpoints
from eagle3_train.core.dist import barrier
from eagle3_train.core.errors import ContractError, Eagle3Error
from eagle3_train.core.fileio import atomic_write_json, remove_temporaries, save_safetensors
from eagle3_train.core.stagedir import REQUEST_NAME, StageDir, hold_lock
from eagle3_train.training.tracking import TRACKER_FILE

logger = logging.getLogger(__name__)


def consolidated_state_dict(model: nn.Module, zero_stage: int) -> dict[str, torch.Tensor]:
    """Every weight but the target's embeddings, gathered whole (ZeRO-3 included), fp32 CPU;
    collective under ZeRO-3."""
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return _cpu_weights(model)
    return _cpu_weights(model)


def _cpu_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().float().cpu().clone() if v.is_floating_point() else v.detach().cpu().clone()
        for k, v in model.state_dict().items()
        if not k.startswith("embed_tokens")
    }


def save_checkpoint(
    engine: Any,
    out: Path,
    tag: str,
    state: dict[str, Any],
    weights: dict[str, torch.Tensor],
    is_main: bool,
    keep_last: int,
    best: dict[str, Any] | None,
    extra: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write checkpoint ``tag`` (collective: every rank calls it); ``best`` (step and eval_tau, or
    None) is the checkpoint keep_last never deletes, recorded in ``best.json`` when it is this one;
    ``extra``: more safetensors files of the checkpoint, by name (the weight average's)."""
    root = out / "checkpoints"
    try:
        engine.save_checkpoint(str(root), tag=tag, client_state={"eagle3": state})
        if is_main:
            save_safetensors(weights, root / tag / "draft.safetensors", metadata={"format": "pt"})
            for name, tensors in (extra or {}).items():
                save_safetensors(tensors, root / tag / name, metadata={"format": "pt"})
            atomic_write_json(root / tag / "state.json", state)  # last: marks the checkpoint complete
    except Exception as e:  # a full disk reaches us as OSError, torch.save's RuntimeError or a SafetensorError
        raise failed_save(out, tag, e) from e
    if is_main:
        best_tag = f"step{best['step']}" if best is not None else None
        if best is not None and best_tag == tag:
            atomic_write_json(out / BEST_FILE, {"checkpoint": tag} | best)
        for old in [p for p in run_checkpoints(out) if p.name != best_tag][:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return root / tag


def remove_unfinished_checkpoints(out: Path) -> list[str]:
    """Delete the checkpoints a killed save left without ``state.json`` (never continued from; a
    later save of the same step would write over some of their files only); returns their names."""
    partial = [p for p in (out / "checkpoints").glob("step*") if p.is_dir() and not (p / "state.json").is_file()]
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return sorted(p.name for p in partial)


def failed_save(out: Path, tag: str, error: Exception) -> Eagle3Error:
    """The error of a checkpoint save that failed part way (a full disk, say): its files are
    removed (they hold space, and no ``state.json`` marks them complete), and the message names
    the checkpoint that resume continues from instead."""
    shutil.rmtree(out / "checkpoints" / tag, ignore_errors=True)
    done = run_checkpoints(out)
    kept = (
        f"the last complete checkpoint, {done[-1]}, is intact and resume=auto continues from it"
        if done
        else "no earlier checkpoint exists: the run starts over"
    )
    return Eagle3Error(
        f"saving checkpoint {tag} of {out} failed ({type(error).__name__}: {error}); its partial files "
        f"are removed, and {kept}. Free disk space if it is full, then run the same command again"
    )


def checkpoint_paths(out: Path, last: Path, best: dict[str, Any] | None) -> dict[str, str]:
    """The last checkpoint, and under keep_best the best one (what eagle3-export takes)."""
    paths = {"checkpoint": str(last)}
    if best is not None:
        paths["best_checkpoint"] = str(out / "checkpoints" / f"step{best['step']}")
    return paths


def run_directory(
    out: Path,
    capture: dict[str, Any],
    vocab_sha: str,
    draft_config: dict[str, Any],
    micro_batches_per_step: int,
    options: dict[str, Any],
    data_fingerprint: str,
) -> StageDir:
    """The run directory; what its checkpoints must agree with to be continued: the capture they
    learned from, the vocab map their lm_head rows mean, the draft's shape, how many micro-batches
    make one step (the data position), every option that changes the weights (``options``: the
    config less what :mod:`eagle3_train.core.fingerprint` lists) and the data's content."""
    request = {
        "capture": capture,
        "vocab_sha256": vocab_sha,
        "draft_config": draft_config,
        "micro_batches_per_step": micro_batches_per_step,
        "options": options,
        "data_fingerprint": data_fingerprint,
    }

    def hint(diffs: list[str]) -> str:
        why = {
            "vocab_sha256": "the lm_head rows would mean other tokens: give the old map (offline: eagle3-standardize "
            "vocab_map=<the old map>; online: prepared.vocab_map=<the old map>)",
            "micro_batches_per_step": "keep ranks x loop.grad_accum the same to resume at the same data position",
            "options": "a run continues only with the options it was started with (loop.epochs and "
            "loop.max_steps may be raised to extend it)",
            "data_fingerprint": "the run was trained on other data",
        }
        said = [text for key, text in why.items() if any(d.startswith(key) for d in diffs)]
        return "; ".join(said + [f"{as_typed('overwrite=true')} starts the run over, or choose another out="])

    return StageDir(out, "train", request, what="training run", hint=hint, exclusive=True)


def open_run(
    out: Path,
    run_dir: StageDir,
    resume: str,
    overwrite: bool,
    keep_best: bool,
    metrics: Path,
    config: dict[str, Any],
    is_main: bool,
) -> Path | None:
    """Claim the run directory for this request (collective); the checkpoint to continue from, or
    None for a fresh start, which clears an earlier run's metrics (and its tracker's run id) and
    writes ``config.json``. ``overwrite``: an earlier run's checkpoints and records go first."""
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        hold_lock(out, run_dir.what)  # (the claim below takes it too) before a killed run's leftovers go:
        remove_temporaries(out)  # unrenamed writes, while the other ranks wait at the barrier
        if overwrite and (run_checkpoints(out) or (out / REQUEST_NAME).is_file()):
            start_over(out)
    barrier()
    ckpts = run_checkpoints(out)
    if ckpts and resume == "never":
        raise ContractError(f"{out} already holds checkpoints; resume=auto continues it, or use another out=")
    run_dir.claim(replace=not ckpts)  # checkpoints are continued only by the same request
    if is_main and (partial := remove_unfinished_checkpoints(out)):
        logger.info(f"eagle3-train: removed the unfinished checkpoints {partial} of an interrupted run")
    if is_main and (not ckpts or not keep_best):
        # a record left by an earlier run, or one keep_last may now delete, would mislead export
        (out / BEST_FILE).unlink(missing_ok=True)
    if ckpts:
        return ckpts[-1]
    if is_main:  # a new run: new metrics, a new wandb run
        metrics.unlink(missing_ok=True)
        (out / TRACKER_FILE).unlink(missing_ok=True)
        atomic_write_json(out / "config.json", config)
    return None


def start_over(out: Path) -> None:
    """Remove an earlier run from ``out`` (``overwrite=true``): its checkpoints first, then its
    records, so a crash in between leaves a directory a rerun starts over in as well."""
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    for name in (MANIFEST_NAME, BEST_FILE, REQUEST_NAME, "metrics.jsonl", "config.json", TRACKER_FILE):
        (out / name).unlink(missing_ok=True)
    logger.info(f"eagle3-train: overwrite: the earlier run in {out} is removed; training starts over")


@dataclass
class BestTracker:
    """The best evaluation so far by eval simulated tau: the checkpoint ``checkpoint.keep_best`` keeps
    and the evaluations without a better one that ``loop.early_stop_patience`` stops after. Each
    checkpoint's ``state.json`` holds it (:meth:`state`), so a resumed run goes on counting."""

    keep_best: bool
    patience: int  # 0: no early stop
    record: dict[str, Any] = field(default_factory=lambda: {"step": None, "eval_tau": None})
    evals_since_best: int = 0
    early_stopped: bool = False

    def update(self, step: int, eval_tau: float) -> bool:
        """Count an evaluation at ``step``; True when early stopping is due."""
        if self.record["eval_tau"] is None or eval_tau > self.record["eval_tau"]:
            self.record = {"step": step, "eval_tau": eval_tau}
            self.evals_since_best = 0
        else:
            self.evals_since_best += 1
        return bool(self.patience) and self.evals_since_best >= self.patience

    def kept(self) -> dict[str, Any] | None:
        """The best evaluation's step and tau when keep_best keeps its checkpoint."""
        return self.record if self.keep_best and self.record["step"] is not None else None

    def state(self) -> dict[str, Any]:
        return {"best": self.record, "evals_since_best": self.evals_since_best, "early_stopped": self.early_stopped}

    def restore(self, state: dict[str, Any], out: Path, is_main: bool) -> None:
        """Continue from a checkpoint's ``state.json``; under keep_best, (re)write ``best.json``."""
        self.record = state.get("best", self.record)
        self.evals_since_best = state.get("evals_since_best", 0)
        self.early_stopped = state.get("early_stopped", False)
        if self.keep_best and self.record["step"] is not None:
            best = out / "checkpoints" / f"step{self.record['step']}"
            if not (best / "state.json").is_file():  # tracked while keep_best was off: never saved
                self.record = {"step": None, "eval_tau": None}
            elif is_main:  # a crash may have come between the best checkpoint's save and its record
                atomic_write_json(out / BEST_FILE, {"checkpoint": best.name} | self.record)


def continue_run(
    state: dict[str, Any], now: dict[str, Any], step: int, total_steps: int, best: BestTracker, out: Path, is_main: bool
) -> str | None:
    """What a rerun that changed continuation options (core.fingerprint.CONTINUATIONS; ``now``,
    against the checkpoint's ``state``) does, in one line, or None when none changed. A run that
    trains again loses its final manifest; a raised patience lifts an early stop."""
    before = state.get("continued")
    if before is None:
        return None
    # (an option a checkpoint predates reads as its default, null)
    changed = ", ".join(f"{k}: {before.get(k)} -> {v}" for k, v in now.items() if before.get(k) != v)
    if not changed:
        return None
    if step >= total_steps:
        what = f"the run is already at step {step} of {total_steps}: nothing more is trained"
    elif now.get("loop.max_minutes"):
        what = (
            f"the run continues from step {step} for the minutes loop.max_minutes leaves (about {total_steps} "
            f"steps at the rate so far; sized again as it trains); the lr schedule follows the new total"
        )
    else:
        what = (
            f"the run continues from step {step} to {total_steps} (was {state.get('total_steps')}); the lr "
            f"schedule is recomputed over {total_steps} steps, so the lr now follows the longer curve"
        )
        if is_main:  # unfinished again until the new total is reached
            (out / MANIFEST_NAME).unlink(missing_ok=True)
    if best.early_stopped and best.patience > best.evals_since_best:
        best.early_stopped = False
        what += "; the early stop is lifted (patience raised)"
    return f"{changed}: {what}"
