"""Which options a stage's request holds: every option, less the ones listed here, in one place.

A stage's request (:mod:`eagle3_train.core.stagedir`) is what decides its output. Built from the
whole config by :func:`request_options`, it holds every option by its dotted name except those
:data:`OUTSIDE_REQUEST` lists, each with the reason it cannot change the output, and those
:data:`CONTINUATIONS` lists: options a rerun may change to continue the same output (raising
``loop.epochs`` extends a run), each with what the change does. A new option is fingerprinted
unless it is listed here, so one forgotten is refused on a rerun rather than silently ignored.
"""

from __future__ import annotations

from typing import Any

# stage -> option -> why it cannot change what the stage writes
OUTSIDE_REQUEST: dict[str, dict[str, str]] = {
    "train": {
        "out": "where the run goes",
        "data": "a path: the data's content is fingerprinted instead (data_fingerprint)",
        "target": "a path or name: the capture records the target's identity and shapes",
        "cache_dir": "where GGUF conversions are cached",
        "resume": "whether a used run directory may be continued",
        "device": "where the run computes",
        "progress": "the progress bar",
        "logging": "the console and where metrics go besides metrics.jsonl",
        "loop.eval_every": "when the held-out split is measured (the weights do not depend on it)",
        "checkpoint.save_every": "when checkpoints are written",
        "checkpoint.every_minutes": "when checkpoints are written",
        "overwrite": "whether an earlier run in out is removed first",
        "checkpoint.keep_last": "how many checkpoints are kept",
        "checkpoint.keep_best": "which checkpoint is kept besides the last",
        "loop.log_every": "how often a metrics line is written",
        "runtime.cache_target_gb": "the target's distributions kept in memory instead of recomputed (same values)",
        "runtime.head_chunk": "how the head loss is chunked in memory (the same sums in another order)",
        "runtime.activation_checkpointing": "activations recomputed instead of kept (same values)",
        "runtime.compile": "torch.compile of the same math",
        "runtime.cudnn_attention": "which kernels compute the same attention",
        "online.overlap": "the target's forward on a side stream (same states)",
        "online.compile": "torch.compile of the target's same layers (same states within the dtype's tolerance)",
        "online.trust_remote_code": "whether the target's own code may run",
        **dict.fromkeys(
            [
                f"engine.{name}"
                for name in (
                    "urls",
                    "final_urls",
                    "launch",
                    "replicas",
                    "port",
                    "devices",
                    "memory_fraction",
                    "model",
                    "files_dir",
                    "server_files_dir",
                )
            ],
            "where the engine replicas run and how they are reached (the same engine, flags and dtype give the same states)",
        ),
        **dict.fromkeys(
            [
                f"engine.{name}"
                for name in (
                    "prefetch",
                    "concurrency",
                    "request_timeout_s",
                    "file_timeout_s",
                    "retries",
                    "backoff_s",
                    "health_every_s",
                    "health_failures",
                    "wait_for_server_s",
                    "launch_timeout_s",
                    "check_samples",
                    "keep_files",
                    "check_args",
                )
            ],
            "how the states are asked for and checked, not what they are",
        ),
    },
}

# stage -> option -> what changing it on a rerun does (the rerun continues the same output)
CONTINUATIONS: dict[str, dict[str, str]] = {
    "train": {
        "loop.epochs": "raised: the run continues to the new total; the lr schedule is recomputed over the new total, "
        "so from the current step the lr follows the longer curve (it rises where the old one had "
        "decayed); lowered to a total already reached: nothing is trained",
        "loop.max_steps": "as loop.epochs: the total becomes min(epochs' steps, max_steps)",
        "loop.max_minutes": "raised (or set to null): the run continues for the minutes added, its total sized "
        "again from the measured rate; a budget already spent trains nothing more",
        "loop.early_stop_patience": "raised after an early stop: training continues from the last checkpoint",
    },
}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out |= flatten(value, f"{name}.")
        else:
            out[name] = value
    return out


def _listed(name: str, listed: dict[str, str]) -> bool:
    return any(name == key or name.startswith(f"{key}.") for key in listed)


def request_options(stage: str, options: dict[str, Any]) -> dict[str, Any]:
    """A stage's config (plain data, as ``config_dict`` gives it) as the flat options its request
    holds: every one but the listed (:data:`OUTSIDE_REQUEST`, :data:`CONTINUATIONS`)."""
    outside, continued = OUTSIDE_REQUEST.get(stage, {}), CONTINUATIONS.get(stage, {})
    return {
        name: value
        for name, value in sorted(flatten(options).items())
        if not _listed(name, outside) and not _listed(name, continued)
    }


def continued_options(stage: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options a rerun may change to continue the output (:data:`CONTINUATIONS`)."""
    continued = CONTINUATIONS.get(stage, {})
    return {name: value for name, value in sorted(flatten(options).items()) if _listed(name, continued)}
