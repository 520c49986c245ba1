"""eagle3-eval's report as a type: written by the evaluator, read by the model card, eagle3-run and
whatever else wants its figures, in one place, with a schema version.

``report.json`` holds these fields and the stage record's own (``stage``, ``format_version``,
``request``, ...). A report written before the version existed reads as version 0, its later
fields absent (None); a report of a newer version than this reader knows is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from eagle3_train.core.errors import BadInputError

EVAL_SCHEMA_VERSION = 1


@dataclass
class EvalReport:
    """The figures of one ``eagle3-eval`` run (docs/guide/eval.md says what each means)."""

    engine: str  # whose layer-id rule the draft was fed by
    rule: str  # the rule's engine versions
    ids_read_from: str  # the config key the ids came from
    ids: list[int] | None  # the ids the config holds (None: none, the engine's default)
    captured_hf_indices: list[int]
    fed: list[int]  # the HF indices fed to the draft
    pre_norm_final: bool
    warnings: list[str]
    looping: list[str]  # reply stretches where the target repeats itself
    trained_hf_indices: list[int] | None
    trained_ttt_length: int | None
    conversations: int
    prompts: int  # prompts decoded (every turn of every conversation)
    k: int  # draft tokens per verify step (a tree's depth)
    tokens: int
    tree: dict[str, Any] | None
    verify_steps: int
    tau: float  # tokens per verify step
    acceptance_per_position: list[float]
    by_reply_position: list[dict[str, Any]]
    categories: dict[str, dict[str, Any]]  # category -> prompts, tokens, tau, verify_steps, acceptance_per_position
    turns: dict[str, float]  # turn (from 1) -> tau
    lossless: str  # identical | numerical | diverged
    lossless_counts: dict[str, int]
    lossless_cases: list[dict[str, Any]]
    tie_threshold: float
    batch_size: int
    dtype: str
    device: str
    decoder: str
    timing: str
    speculative_seconds: float
    greedy_seconds: float
    speculative_tokens_per_s: float
    greedy_tokens_per_s: float
    speedup: float
    timed_greedy_equals_reference: int
    target_seconds: float | None
    draft_seconds: float | None
    draft_positions_per_verify_step: float | None
    config: dict[str, Any]
    by_region: dict[str, Any] | None = None  # tau inside reasoning and in the answer (version 1)
    chat_template_kwargs: dict[str, Any] | None = None  # the flags the prompts were rendered with (version 1)
    schema_version: int = EVAL_SCHEMA_VERSION
    record: dict[str, Any] = field(default_factory=dict)  # the stage record's fields (stage, request, ...)

    def to_dict(self) -> dict[str, Any]:
        """The report's own fields (the stage record adds its own when written)."""
        out = asdict(self)
        out.pop("record")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "report") -> EvalReport:
        """Read a report (as written, stage record included); refuses a newer schema or a report
        missing a field its version has."""
        version = int(data.get("schema_version", 0))
        if version > EVAL_SCHEMA_VERSION:
            raise BadInputError(
                f"{where} is an eagle3-eval report of schema version {version}; this eagle3_train reads up to "
                f"{EVAL_SCHEMA_VERSION}: upgrade it"
            )
        names = {f.name for f in fields(cls)} - {"record"}
        optional = {"by_region", "chat_template_kwargs", "schema_version"}  # absent before version 1
        missing = sorted(n for n in names - optional if n not in data)
        if missing:
            raise BadInputError(f"{where} is no eagle3-eval report (it lacks {', '.join(missing)})")
        own = {n: data[n] for n in names if n in data}
        own["schema_version"] = version
        return cls(**own, record={k: v for k, v in data.items() if k not in names})


def read_eval_report(path: str | Path) -> EvalReport:
    """An eval ``report.json``; a file that is not one is refused naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BadInputError(f"{path} cannot be read as an eagle3-eval report: {e}") from None
    if not isinstance(data, dict):
        raise BadInputError(f"{path} is no eagle3-eval report (not an object)")
    return EvalReport.from_dict(data, str(path))
