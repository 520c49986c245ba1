"""``eagle3-train``: fit the EAGLE-3 draft head with DeepSpeed, on standardized shards or with the
target in the loop (``source=online``, eagle3_train/training/online.py).

    eagle3-train data=runs/x/std target=embedded out=runs/x/train
    eagle3-train source=online data=runs/x/prepared target=embedded out=runs/x/train
    torchrun --nproc_per_node 8 -m eagle3_train.training.trainer data=... target=... out=... deepspeed=zero2

The run directory holds ``checkpoints/step<N>/`` (DeepSpeed's own files plus ``draft.safetensors``,
the consolidated head, and ``state.json``), ``metrics.jsonl`` (one line per logged step and per
evaluation), ``config.json``, and with ``checkpoint.keep_best`` ``best.json`` (the checkpoint with the
best eval simulated acceptance length, which keep_last never deletes and eagle3-export takes).
``resume=auto`` continues from the last checkpoint at its exact step and data position. An online
run also holds ``vocab_map.safetensors``, the map it counted at start (unless ``prepared.vocab_map``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from eagle3_train.core.cli import as_typed, config_dict, entry_point
from eagle3_train.core.contract import run_checkpoints
from eagle3_train.core.dist import DistInfo, all_gather_objects, close, init_distributed
from eagle3_train.core.errors import BadInputError, ConfigError, Eagle3Error, Interrupted
from eagle3_train.core.faults import fault_point
from eagle3_train.core.fingerprint import continued_options, request_options
from eagle3_train.core.log import progress_bar
from eagle3_train.core.stagedir import StageDir
from eagle3_train.targets import Target
from eagle3_train.training.budget import BUDGET_EVERY, WallClockBudget
from eagle3_train.training.checkpoint import (
    BestTracker,
    checkpoint_paths,
    consolidated_state_dict,
    continue_run,
    open_run,
    run_directory,
    save_checkpoint,
)
from eagle3_train.training.config import RENAMED, USUAL_CHAIN, TrainConfig, objective
from eagle3_train.training.data import (
    Batch,
    Prefetcher,
    batch_plan,
    epoch_of,
    micro_batches_for,
    plan_epoch,
)
from eagle3_train.training.draft_init import build_draft
from eagle3_train.training.ema import EMA_FILE, WeightAverage
from eagle3_train.training.evaluate import evaluate_split
from eagle3_train.training.metrics import (
    MetricsLog,
    bar_postfix,
    device_memory,
    eval_line,
    train_line,
    train_record,
    truncate_metrics,
)
from eagle3_train.training.parallel import build_engine, scheduled_lr, sequence_parallel
from eagle3_train.training.served import launch_text, serve
from eagle3_train.training.sources import open_source
from eagle3_train.training.tracking import open_tracker
from eagle3_train.training.ttt import TargetCache, ttt_losses

logger = logging.getLogger(__name__)

FEW_STEPS = 100  # fewer optimizer steps than this are warned about: the draft barely moves from its start


class Trainer:
    """One training run on this rank: build -> (resume) -> train_step... -> evaluate/save -> close."""

    def __init__(self, cfg: TrainConfig, target: Target | None = None):
        """``target``: with source=online, an already loaded target (a benchmark's random weights)."""
        self.cfg = cfg
        self.out = Path(cfg.out).expanduser()
        # which SDPA kernels torch may pick, for this run (close() puts torch's setting back)
        self._cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(cfg.runtime.cudnn_attention)
        try:
            self.dist: DistInfo = init_distributed(cfg.device, always=True)
            bf16 = cfg.deepspeed.bf16 == "true" or (cfg.deepspeed.bf16 == "auto" and self.dist.device.type == "cuda")
            self.dtype = torch.bfloat16 if bf16 else torch.float32
            self.source = open_source(cfg, self.out, self.dist, self.dtype, target)
            try:
                self._build()
            except BaseException:  # engines the source started stop with the run
                self.source.close()
                raise
        except BaseException:
            torch.backends.cuda.enable_cudnn_sdp(self._cudnn_sdp)
            raise

    def _build(self) -> None:
        """The draft, its DeepSpeed engine and the data plan, from the open source; then resume."""
        cfg = self.cfg
        self.spec, self.vocab, self.vocab_sha = self.source.spec, self.source.vocab, self.source.vocab_sha
        self.lm_head, self.model = build_draft(cfg.model, self.source, self.spec, self.vocab, cfg.loop.seed)
        self.lm_head = self.lm_head.to(self.dist.device, self.dtype)  # frozen target lm_head [V, H]
        self.t2d = self.vocab.t2d.to(self.dist.device)
        ttt = cfg.objective.ttt_length
        if ttt < USUAL_CHAIN:
            logger.warning(
                f"warning: {as_typed(f'objective.ttt_length={ttt}')} < {USUAL_CHAIN}, the chain length eagle3-eval and the "
                f"engines usually draft: draft positions past {ttt} were never trained and accept less; "
                f"train at least as many steps as the draft will propose"
            )
        self.train_split, self.eval_split = self.source.train_split, self.source.eval_split
        if len(self.train_split) == 0:
            raise BadInputError(f"{self.source.where} has no training samples")
        sp = cfg.runtime.sequence_parallel
        if self.dist.world_size % sp:
            raise ConfigError(
                f"runtime.sequence_parallel={sp} must divide the number of ranks ({self.dist.world_size})"
            )
        self.sp = sequence_parallel(sp)
        self.world = self.dist.world_size // self.sp.size  # data-parallel ranks; each reads its own micro-batches
        self.data_rank = self.dist.rank // self.sp.size
        # Epochs shuffle differently, so their micro-batch counts can differ by a few.
        self.plan_batches()
        if note := self.batches.note(cfg.loop):
            logger.info(note)
        if self.dist.is_main and (few := self.few_steps()):
            logger.warning(few)
        self._bar: Any = None  # the loop's progress bar
        self._last_save = time.time()  # checkpoint.every_minutes counts from the loop's start and each save
        self.spent_s = 0.0  # loop seconds of earlier runs of this output (loop.max_minutes counts them)
        self._loop_start: float | None = None  # time.time() when this run's loop began
        self._loop_end: float | None = None  # and when it ended (the final evaluation and save are not loop time)
        self.minutes_spent: float | None = None  # the loop.max_minutes whose budget ended the run
        self.target_cache = TargetCache.build(
            cfg.runtime.cache_target_gb,
            self.train_split,
            self.eval_split,
            self.lm_head,
            self.t2d,
            self.vocab.draft_vocab_size,
        )
        self.model.to(self.dist.device)
        self.engine = build_engine(self.model, cfg, self.dtype, self.dist.device, lambda: self.total_steps, self.sp)
        self.step = 0
        self.ema = WeightAverage(self.model, cfg.optim.ema_decay) if cfg.optim.ema_decay else None
        self.objective = objective(cfg.objective)  # the step loss
        # each micro-batch's loss finiteness, still on the device: (0-based step, flag, sample ids)
        self._unchecked: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.best = BestTracker(cfg.checkpoint.keep_best, cfg.loop.early_stop_patience)
        self.metrics_path = self.out / "metrics.jsonl"
        self._resume()
        self.metrics = MetricsLog(
            self.metrics_path,
            self.dist.is_main,
            open_tracker(cfg.logging, self.out, config_dict(cfg), self.step, self.dist.is_main),
        )

    def plan_batches(self, tokens: int | None = None) -> None:
        """The micro-batches' token budget (``loop.min_steps`` may shrink it; ``tokens``: the one a
        resumed run began with), the steps of each epoch and the total they allow with ``loop.max_steps``."""
        o = self.cfg.loop
        self.batches = batch_plan(self.train_split.length, o, self.world, tokens)
        self.epoch_steps = self.batches.epoch_steps
        self.total_steps = sum(self.epoch_steps)
        if o.max_steps is not None:
            self.total_steps = min(self.total_steps, o.max_steps)
        self.planned_steps = self.total_steps  # what the epochs and max_steps allow; max_minutes may size it down

    def few_steps(self) -> str | None:
        """A warning when the epochs make too few optimizer steps for the draft to learn (a small
        dataset at a recipe's large batches), naming what helps; None when they make enough, or
        when loop.max_steps asks for fewer itself."""
        o = self.cfg.loop
        if self.planned_steps >= FEW_STEPS or (o.max_steps is not None and o.max_steps < FEW_STEPS):
            return None
        if o.min_steps < FEW_STEPS:
            helps = (
                f"{as_typed(f'loop.min_steps={2 * FEW_STEPS}')} makes the micro-batches smaller to give that many, "
                f"or more data or {as_typed('loop.epochs')}"
            )
        else:  # min_steps is set: one sample per micro-batch is as small as batches go
            helps = f"more data or {as_typed('loop.epochs')} (one sample per micro-batch already)"
        return (
            f"warning: this run makes only {self.planned_steps} optimizer steps ({len(self.train_split)} training "
            f"samples, {o.epochs} epochs): too few for the draft to learn (tau stays near 1); {helps}"
        )

    # -- checkpoints -----------------------------------------------------------------------------

    def _checkpoints(self) -> list[Path]:
        return run_checkpoints(self.out)

    @property
    def run_dir(self) -> StageDir:
        return run_directory(
            self.out,
            self.spec.to_dict(),
            self.vocab_sha,
            self.model.config.to_dict(),
            self.world * self.cfg.loop.grad_accum,
            request_options("train", config_dict(self.cfg)),
            self.source.data_fingerprint,
        )

    def _resume(self) -> None:
        """Claim ``out``; continue its last checkpoint if it has one: weights, optimizer, lr schedule,
        step (the data position) and the best evaluation."""
        last = open_run(
            self.out,
            self.run_dir,
            self.cfg.resume,
            self.cfg.overwrite,
            self.cfg.checkpoint.keep_best,
            self.metrics_path,
            config_dict(self.cfg),
            self.dist.is_main,
        )
        if last is None:
            return
        state = json.loads((last / "state.json").read_text())
        self.engine.load_checkpoint(
            str(last.parent), tag=last.name, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        with torch.no_grad():  # frozen weights are not in every ZeRO checkpoint: always the target's
            self.model.d2t.copy_(self.vocab.d2t)
            self.model.t2d.copy_(self.vocab.t2d)
        if self.ema:
            self.ema.load(last)
        self.step = state["step"]
        self.spent_s = float(state.get("loop_seconds", 0.0))
        began = state.get("batch_tokens", self.cfg.loop.max_tokens_per_batch)
        if began != self.batches.tokens:  # loop.min_steps with raised epochs: the run keeps its batches
            logger.info(
                f"eagle3-train: the run continues with the micro-batches it began with (at most {began} tokens; "
                f"loop.min_steps would size them at {self.batches.tokens} for the epochs now asked)"
            )
            self.plan_batches(began)
        if minutes := self.cfg.loop.max_minutes:
            self.total_steps = self.resumed_total(state, minutes)
        if self.dist.is_main:  # what a killed run logged after this checkpoint is logged again
            truncate_metrics(self.metrics_path, self.step)
        self.best.restore(state, self.out, self.dist.is_main)
        now = continued_options("train", config_dict(self.cfg))
        if note := continue_run(state, now, self.step, self.total_steps, self.best, self.out, self.dist.is_main):
            logger.info(f"eagle3-train: {note}")
        logger.info(
            f"eagle3-train: continuing from checkpoint {last.name} of {self.out} at step {self.step} of "
            f"{self.total_steps} ({as_typed('overwrite=true')} starts over)"
        )

    def save(self) -> Path:
        """A DeepSpeed checkpoint plus the consolidated head (:mod:`eagle3_train.training.checkpoint`)."""
        if not self.cfg.deepspeed.check_grad_overflow:
            self.check_weights()
        state = {
            "step": self.step,
            "epoch": self.epoch_of(self.step)[0],
            "world_size": self.world,
            "grad_accum": self.cfg.loop.grad_accum,
            "vocab_sha256": self.vocab_sha,
            "capture": self.spec.to_dict(),
            "draft_config": self.model.config.to_dict(),
            "ttt_length": self.cfg.objective.ttt_length,
            "model": config_dict(self.cfg.model),
            "total_steps": self.total_steps,
            "batch_tokens": self.batches.tokens,
            "loop_seconds": round(self.loop_seconds(), 3),
            "max_minutes_spent": self.minutes_spent,
            "continued": continued_options("train", config_dict(self.cfg)),
            "states_from": self.source.states_from,
        }
        state |= self.best.state()
        with self.averaged():  # the weights evaluation measured are the ones exported
            weights = consolidated_state_dict(self.model, self.cfg.deepspeed.zero_stage)
        extra = {EMA_FILE: self.ema.state()} if self.ema else None
        tag, kept = f"step{self.step}", self.best.kept()
        keep = self.cfg.checkpoint.keep_last
        path = save_checkpoint(self.engine, self.out, tag, state, weights, self.dist.is_main, keep, kept, extra)
        self._last_save = time.time()
        return path

    def resumed_total(self, state: dict[str, Any], minutes: float) -> int:
        """The total a resumed run with ``loop.max_minutes`` starts from, before its loop measures
        a rate: the step reached when this budget was spent (or is now); the total the killed run
        had sized; after a raised budget, the steps the earlier runs' rate fits in the minutes added."""
        if state.get("max_minutes_spent") == minutes or self.spent_s >= 60 * minutes:
            return min(self.total_steps, self.step)
        if state.get("total_steps", 0) > self.step:
            return min(self.total_steps, state["total_steps"])
        rate = self.step / max(self.spent_s, 1e-9)
        return min(self.total_steps, self.step + int(rate * (60 * minutes - self.spent_s)))

    def loop_seconds(self) -> float:
        """Seconds of training loop this output has had, earlier runs included."""
        if self._loop_start is None:
            return self.spent_s
        return self.spent_s + ((self._loop_end or time.time()) - self._loop_start)

    def fit_budget(self, budget: WallClockBudget, start: int) -> None:
        """Size the total steps to what fits in ``loop.max_minutes`` (the same total on every rank:
        the smallest any rank measured)."""
        assert self._loop_start is not None
        fits = start + budget.total(self.step - start, time.time() - self._loop_start, self.total_steps - start)
        total = min(all_gather_objects(fits))
        spent = total == self.step < self.planned_steps  # (less than a step's time left counts as spent)
        if spent:
            self.minutes_spent = self.cfg.loop.max_minutes
        if total != self.total_steps:
            logger.info(
                f"eagle3-train: loop.max_minutes={self.cfg.loop.max_minutes}: "
                + (
                    f"the budget is spent at step {self.step}"
                    if spent
                    else f"about {total} steps fit at the measured rate; the lr schedule now ends at step {total}"
                )
                + f" (the epochs and loop.max_steps allow {self.planned_steps})"
            )
        self.total_steps = total

    def averaged(self) -> AbstractContextManager[None]:
        """The model holds the weight average (``optim.ema_decay``) inside the block, if there is one."""
        return self.ema.applied() if self.ema else nullcontext()

    # -- the loop --------------------------------------------------------------------------------

    def losses(self, batch: Batch, hits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        o, r = self.cfg.objective, self.cfg.runtime
        return ttt_losses(
            self.engine.module,
            batch,
            self.lm_head,
            self.t2d,
            o.ttt_length,
            o.loss_decay,
            None if self.target_cache is None else self.target_cache(batch),
            r.head_chunk,
            self.sp,
            r.compile and r.head_chunk > 0,
            hits,
            self.objective,
        )

    def epoch_of(self, step: int) -> tuple[int, int]:
        """(epoch, step within it) of a global optimizer step."""
        return epoch_of(step, self.epoch_steps)

    def train_batches(self) -> Iterator[Batch]:
        """This rank's micro-batches from the current step to the end, in order (host memory,
        pinned on CUDA). Runs on the prefetch thread."""
        o = self.cfg.loop
        pin = self.dist.device.type == "cuda"
        epoch_no, plan = -1, []
        for step in range(self.step, self.total_steps):
            epoch, step_in_epoch = self.epoch_of(step)
            if epoch != epoch_no:
                epoch_no, plan = epoch, plan_epoch(self.train_split.length, self.batches.tokens, o.seed, epoch)
            for indices in micro_batches_for(plan, step_in_epoch, self.data_rank, self.world, o.grad_accum):
                batch = self.train_split.batch(indices)
                yield batch.pin() if pin else batch

    def train_step(self, batches: Iterator[Batch]) -> dict[str, Any]:
        """One optimizer step: this rank's next micro-batches (on the device: ``source.device_batches``),
        backward, DeepSpeed's step. Nothing here waits for the device, so the host queues the next
        micro-batch's kernels while the GPU runs this one's (a small head is otherwise bound by the
        launches): the loss, the counts and the tokens come back as device tensors, and each loss's
        finiteness is checked later by ``check_finite``, which the loop calls before it logs,
        evaluates or saves. A non-finite loss therefore stops training before any checkpoint or
        evaluation sees weights it touched, naming its step and samples."""
        o = self.cfg.loop
        self.engine.train()
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # counts [k, 3], loss, tokens
        for _ in range(o.grad_accum):
            batch = next(batches)
            loss, stats = self.losses(batch)
            finite = torch.isfinite(loss.detach()).float().reshape(1)
            if torch.distributed.is_initialized():  # every rank stops at the same step
                torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
            self._unchecked.append((self.step, finite, batch.sample_ids))
            # DeepSpeed averages gradients over all ranks; a sequence-parallel group's losses add up
            # to its micro-batch's, so each counts sp times (the mean over data-parallel ranks)
            self.engine.backward(loss * self.sp.size)
            self.engine.step()
            parts.append((stats[:, :3].to(torch.int64), loss.detach().float(), batch.lengths.sum()))
        if self.ema:
            self.ema.update()
        self.step += 1
        counts, loss_sum, tokens = parts[0]
        for c, ls, n in parts[1:]:
            counts, loss_sum, tokens = counts + c, loss_sum + ls, tokens + n
        return {"loss": loss_sum / o.grad_accum, "counts": counts, "tokens": tokens}

    def check_finite(self) -> None:
        """Raise on the first micro-batch since the last check whose loss was not finite (one wait
        for the device for all of them)."""
        if not self._unchecked:
            return
        unchecked, self._unchecked = self._unchecked, []
        bad = (torch.cat([f for _, f, _ in unchecked]).cpu() < 1).nonzero()
        if len(bad):
            step, _, samples = unchecked[int(bad[0])]
            last = [c for c in self._checkpoints() if int(c.name.removeprefix("step")) <= step]
            raise Eagle3Error(
                f"non-finite loss at step {step + 1} (epoch {self.epoch_of(step)[0]}, micro-batch of samples "
                f"{samples.tolist()[:8]} on some rank); last good checkpoint: {last[-1] if last else 'none'}"
            )

    def check_weights(self) -> None:
        """Raise if a trained weight is not finite (one wait for the device). With
        deepspeed.check_grad_overflow off, a step whose loss was finite may still have applied a
        non-finite gradient; no checkpoint keeps such weights."""
        ok = torch.stack([torch.isfinite(p).all() for p in self.model.parameters() if p.requires_grad])
        ok = ok.all().float().reshape(1)
        if torch.distributed.is_initialized():  # every rank stops at the same step
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
        if ok.item() < 1:
            last = self._checkpoints()
            raise Eagle3Error(
                f"non-finite weights after step {self.step} (deepspeed.check_grad_overflow=false, so a step "
                f"applied a non-finite gradient); last good checkpoint: {last[-1] if last else 'none'}"
            )

    def evaluate(self) -> dict[str, Any]:
        """The eval split's figures (:func:`eagle3_train.training.evaluate.evaluate_split`; all ranks)."""
        self.engine.eval()
        ttt, tokens = self.cfg.objective.ttt_length, self.cfg.loop.max_tokens_per_batch
        with self.averaged():
            return evaluate_split(
                self.eval_split, self.source, self.losses, self.step, ttt, tokens, self.data_rank, self.world, self.sp
            )

    def after_eval(self, result: dict[str, Any]) -> bool:
        """Log an evaluation and track the best eval simulated tau; True when early stopping is due
        (``loop.early_stop_patience`` evaluations in a row without a better one)."""
        self.metrics.log(result)
        return self.best.update(self.step, result["eval_tau"])

    def run(self) -> dict[str, Any]:
        """Train to the end (or resume's end); Ctrl-C or SIGTERM stop it as :class:`Interrupted`,
        saying which checkpoint a rerun continues from."""
        try:
            return self._run()
        except KeyboardInterrupt:
            if self._bar is not None:  # its last line before the one that says what was kept
                self._bar.close()
            done = self._checkpoints()
            lost = self.step - int(done[-1].name.removeprefix("step")) if done else 0
            kept = (
                f"its checkpoint {done[-1].name} is kept ({lost} step{'' if lost == 1 else 's'} past it will be "
                f"trained again)"
                if done
                else "no checkpoint was written yet: a rerun starts from step 0"
            )
            raise Interrupted(f"training stopped at step {self.step} of {self.total_steps}; {kept}") from None

    def checkpoint_due(self, at_sync: bool) -> bool:
        """Whether ``checkpoint.every_minutes`` have passed since the last checkpoint (or the loop's
        start): on several ranks decided together at ``at_sync`` steps only (one gather), so every
        rank saves at the same step."""
        minutes = self.cfg.checkpoint.every_minutes
        if not minutes:
            return False
        due = time.time() - self._last_save >= 60 * minutes
        if self.dist.world_size == 1:
            return due
        return at_sync and any(all_gather_objects(due))

    def _run(self) -> dict[str, Any]:
        o, keep = self.cfg.loop, self.cfg.checkpoint
        if (self.step >= self.total_steps or self.best.early_stopped) and self._checkpoints():
            how = "stopped early" if self.best.early_stopped else "already trained"
            logger.info(f"eagle3-train: {self.out} is {how} at step {self.step}; nothing to do")
            evals = self.metrics.evals()
            return (evals[-1] if evals else {}) | checkpoint_paths(self.out, self._checkpoints()[-1], self.best.kept())
        bar = self._bar = progress_bar(
            total=self.total_steps,
            initial=self.step,
            desc="train",
            unit="step",
            show=self.cfg.progress if self.dist.is_main else False,
        )
        window_start = self._loop_start = self._last_save = time.time()
        start = self.step
        budget = (
            WallClockBudget(60 * o.max_minutes, self.planned_steps - start, self.spent_s) if o.max_minutes else None
        )
        batches = self.source.device_batches(Prefetcher(self.train_batches(), depth=2 * o.grad_accum))
        final: dict[str, Any] | None = None
        pending: list[dict[str, torch.Tensor]] = []  # the steps' figures since the last record, on the device
        while self.step < self.total_steps:
            pending.append(self.train_step(batches))
            fault_point("train.step")  # tests: a kill between checkpoints
            bar.update(1)
            at_log = self.step % o.log_every == 0 or self.step == self.total_steps
            if budget is not None and (at_log or self.step % BUDGET_EVERY == 0):  # its cadence, whatever log_every is
                self.fit_budget(budget, start)
                bar.total = self.total_steps
            if at_log or self.step == self.total_steps:  # (a budget spent here ends the run: its last steps logged)
                self.check_finite()
                counts = torch.stack([r["counts"] for r in pending]).sum(0).cpu().numpy()
                loss = float(torch.stack([r["loss"] for r in pending]).double().mean())
                tokens = int(torch.stack([r["tokens"] for r in pending]).sum())
                pending.clear()
                record = train_record(
                    self.step, counts, loss, tokens, time.time() - window_start, scheduled_lr(self.engine), self.sp.size
                )
                record["loop_s"] = round(self.loop_seconds(), 1)
                record |= device_memory(self.dist.device)
                self.metrics.log(record)
                bar.set_postfix(bar_postfix(record), refresh=False)
                logger.info(train_line(record, self.total_steps))
                window_start = time.time()
            improved = False
            if o.eval_every and self.step % o.eval_every == 0 and self.step < self.total_steps:
                self.check_finite()
                final = self.evaluate()
                stop = self.after_eval(final)
                logger.info(eval_line(final))
                if stop:  # never on an improvement: the step's checkpoint is the final one below
                    self.best.early_stopped = True
                    logger.info(
                        f"early stop: eval simulated tau has not improved on {self.best.record['eval_tau']:.3f} "
                        f"(step {self.best.record['step']}) for {self.best.evals_since_best} evaluations"
                    )
                    break
                improved = keep.keep_best and self.best.record["step"] == self.step
            every = keep.save_every and self.step % keep.save_every == 0
            at_sync = at_log or self.step % BUDGET_EVERY == 0
            if (improved or every or self.checkpoint_due(at_sync)) and self.step < self.total_steps:
                self.check_finite()
                self.save()
        self._loop_end = time.time()
        bar.close()
        self.check_finite()
        if final is None or final["step"] != self.step:
            final = self.evaluate()
            self.after_eval(final)
        path = self.save()
        logger.info(f"eagle3-train: {self.step} steps; {eval_line(final)} -> {path}")
        paths = checkpoint_paths(self.out, path, self.best.kept())
        if "best_checkpoint" in paths:
            logger.info(
                f"best: eval simulated tau {self.best.record['eval_tau']:.3f} at step {self.best.record['step']} -> {paths['best_checkpoint']}"
            )
        if self.dist.is_main:
            done = {"step": self.step, "early_stopped": self.best.early_stopped, "eval": final}
            self.run_dir.write_manifest(done | {"best": self.best.record, "config": config_dict(self.cfg)} | paths)
        return final | paths

    def close(self) -> None:
        self.metrics.close()
        self.source.close()
        torch.backends.cuda.enable_cudnn_sdp(self._cudnn_sdp)


def _run(cfg: TrainConfig) -> int | None:
    if cfg.source == "served" and cfg.engine.print_launch:
        print(launch_text(cfg))  # the command's output, to copy or pipe: not a log message
        return None
    if cfg.source == "served" and cfg.engine.serve:
        return serve(cfg)  # an engine host: no training
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
        close()
    return None


main = entry_point("train", TrainConfig, _run, renamed=RENAMED)

if __name__ == "__main__":
    main()
