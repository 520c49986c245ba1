"""A training run's checkpoints: ``checkpoints/step<N>/`` (DeepSpeed's files, the consolidated
head ``draft.safetensors``, and ``state.json`` written last, which marks it complete), the
``best.json`` record under ``train.keep_best``, and the oldest beyond ``train.keep_last`` removed."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3_train.core.contract import BEST_FILE, run_checkpoints
from eagle3_train.core.dist import barrier
from eagle3_train.core.fileio import atomic_write_json
from eagle3_train.core.stagedir import StageDir


def consolidated_state_dict(model: nn.Module, zero_stage: int) -> dict[str, torch.Tensor]:
    """Every weight but the target's embeddings, gathered whole (ZeRO-3 included), fp32 CPU;
    collective under ZeRO-3."""
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return _cpu_weights(model)
    return _cpu_weights(model)


def _cpu_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() if v.is_floating_point() else v.detach().cpu().clone()
            for k, v in model.state_dict().items() if not k.startswith("embed_tokens")}


def save_checkpoint(engine: Any, out: Path, tag: str, state: dict[str, Any], weights: dict[str, torch.Tensor],
                    is_main: bool, keep_last: int, best: dict[str, Any] | None) -> Path:
    """Write checkpoint ``tag`` (collective: every rank calls it); ``best`` (step and eval_tau, or
    None) is the checkpoint keep_last never deletes, recorded in ``best.json`` when it is this one."""
    root = out / "checkpoints"
    engine.save_checkpoint(str(root), tag=tag, client_state={"eagle3": state})
    if is_main:
        from safetensors.torch import save_file

        save_file(weights, str(root / tag / "draft.safetensors"), metadata={"format": "pt"})
        atomic_write_json(root / tag / "state.json", state)  # last: marks the checkpoint complete
        best_tag = f"step{best['step']}" if best is not None else None
        if best_tag == tag:
            atomic_write_json(out / BEST_FILE, {"checkpoint": tag} | best)
        for old in [p for p in run_checkpoints(out) if p.name != best_tag][:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return root / tag


def checkpoint_paths(out: Path, last: Path, best: dict[str, Any] | None) -> dict[str, str]:
    """The last checkpoint, and under keep_best the best one (what eagle3-export takes)."""
    paths = {"checkpoint": str(last)}
    if best is not None:
        paths["best_checkpoint"] = str(out / "checkpoints" / f"step{best['step']}")
    return paths


def run_directory(out: Path, capture: dict[str, Any], vocab_sha: str, draft_config: dict[str, Any],
                  micro_batches_per_step: int, options: dict[str, Any], data_fingerprint: str) -> StageDir:
    """The run directory; what its checkpoints must agree with to be continued: the capture they
    learned from, the vocab map their lm_head rows mean, the draft's shape, how many micro-batches
    make one step (the data position), every option that changes the weights (``options``: the
    config less what :mod:`eagle3_train.core.fingerprint` lists) and the data's content."""
    request = {"capture": capture, "vocab_sha256": vocab_sha, "draft_config": draft_config,
               "micro_batches_per_step": micro_batches_per_step, "options": options,
               "data_fingerprint": data_fingerprint}

    def hint(diffs: list[str]) -> str:
        why = {"vocab_sha256": "the lm_head rows would mean other tokens: standardize with vocab_map=<the old map>",
               "micro_batches_per_step": "keep ranks x train.grad_accum the same to resume at the same data position",
               "options": "a run continues only with the options it was started with (train.epochs and "
                          "train.max_steps may be raised to extend it)",
               "data_fingerprint": "the run was trained on other data"}
        said = [text for key, text in why.items() if any(d.startswith(key) for d in diffs)]
        return "; ".join(said + ["or start a new run with another out="])

    return StageDir(out, "train", request, what="training run", hint=hint, exclusive=True)
