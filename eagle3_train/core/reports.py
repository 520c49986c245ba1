"""The reports other code reads, as types, written and read in this one module, each with a schema
version: eagle3-eval's ``report.json`` (read by the model card and eagle3-run), eagle3-bench's
``results.json`` and eagle3-served-acceptance's ``report.json``.

eval's ``report.json`` holds its fields and the stage record's own (``stage``, ``format_version``,
``request``, ...). A report written before the version existed reads as version 0, its later
fields absent (None); a report of a newer version than this reader knows, or a file that is not
such a report, is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from eagle3_train.core.errors import BadInputError
from eagle3_train.core.fileio import atomic_write_json

EVAL_SCHEMA_VERSION = 1
BENCH_SCHEMA_VERSION = 1
SERVED_SCHEMA_VERSION = 1

EVAL = "eagle3-eval report"
BENCH = "eagle3-bench report"
SERVED = "eagle3-served-acceptance report"


def _schema_version(data: dict[str, Any], where: str, what: str, current: int) -> int:
    """The version ``data`` was written in (0: before reports had one); a newer one is refused."""
    version = data.get("schema_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise BadInputError(f"{where} is no {what} (its schema_version is {version!r})")
    if version > current:
        raise BadInputError(
            f"{where} is an {what} of schema version {version}; this eagle3_train reads up to {current}: upgrade it"
        )
    return version


def _own_fields(cls: type, data: Any, where: str, what: str, optional: set[str], part: str = "it") -> dict[str, Any]:
    """The values of ``cls``'s fields found in ``data``; one lacking a field that is not ``optional``
    (absent in an older version) is refused, ``part`` naming the piece of the report that lacks it."""
    if not isinstance(data, dict):
        raise BadInputError(f"{where} is no {what} ({part} is not an object)")
    names = {f.name for f in fields(cls)} - {"record"}
    missing = sorted(n for n in names - optional - {"schema_version"} if n not in data)
    if missing:
        raise BadInputError(f"{where} is no {what} ({part} lacks {', '.join(missing)})")
    return {n: data[n] for n in names if n in data}


def _read_object(path: str | Path, what: str) -> dict[str, Any]:
    """A JSON file's top object; a file that cannot be read, or holds no object, is refused naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BadInputError(f"{path} cannot be read as an {what}: {e}") from None
    if not isinstance(data, dict):
        raise BadInputError(f"{path} is no {what} (not an object)")
    return data


# ---- eagle3-eval ----------------------------------------------------------------------------


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
    # who exported the draft (producer, version) and what it records of its capture (absent in older reports)
    draft_format: dict[str, Any] | None = None
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
        version = _schema_version(data, where, EVAL, EVAL_SCHEMA_VERSION)
        own = _own_fields(
            cls, data, where, EVAL, {"by_region", "chat_template_kwargs", "draft_format"}
        )  # absent before version 1
        own["schema_version"] = version
        return cls(**own, record={k: v for k, v in data.items() if k not in own})


def read_eval_report(path: str | Path) -> EvalReport:
    """An eval ``report.json``; a file that is not one is refused naming it."""
    return EvalReport.from_dict(_read_object(path, EVAL), str(path))


def write_report(path: str | Path, report: BenchReport | ServedReport) -> None:
    """Write a bench or served-acceptance report as JSON (keys sorted), atomically."""
    atomic_write_json(path, asdict(report))


# ---- eagle3-bench -----------------------------------------------------------------------------


@dataclass
class BenchRow:
    """One temperature and concurrency of ``eagle3-bench`` (docs/guide/bench.md says what each figure means)."""

    temperature: float
    concurrency: int  # requests in flight
    # the target served alone: requests, completion_tokens, seconds, output_tokens_per_s,
    # time_per_output_token_s and latency_s (mean, p50, p90)
    baseline: dict[str, Any]
    spec: dict[str, Any]  # the same with the draft, and the engine's acceptance figures over the level
    speedup: float  # spec's output tokens/s over baseline's
    # baseline's median time per output token over spec's (absent before version 1)
    speedup_by_tpot: float | None = None


@dataclass
class BenchReport:
    """What one ``eagle3-bench`` run measured: its ``results.json``."""

    what: str
    machine: dict[str, Any]  # host, os, python, gpus (of the machine the command ran on)
    command: str
    date: str  # when the run started (ISO 8601, UTC)
    # name, metrics_read_from, and per side (baseline, spec): url, models, model, version, warmup, started_here
    engine: dict[str, Any]
    settings: dict[str, Any]  # prompts, conversations, max_turns, max_new_tokens, concurrency, temperatures, ...
    rows: list[BenchRow]  # one per temperature and concurrency
    warnings: list[str]
    config: dict[str, Any]
    chat_template_kwargs: dict[str, Any] | None = None  # the flags every request carried (absent before version 1)
    schema_version: int = BENCH_SCHEMA_VERSION

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "results") -> BenchReport:
        """Read a report as written; refuses a newer schema or a report missing a field its version has."""
        version = _schema_version(data, where, BENCH, BENCH_SCHEMA_VERSION)
        own = _own_fields(cls, data, where, BENCH, {"chat_template_kwargs"})  # absent before version 1
        if not isinstance(own["rows"], list):
            raise BadInputError(f"{where} is no {BENCH} (its rows are not a list)")
        own["rows"] = [
            BenchRow(**_own_fields(BenchRow, row, where, BENCH, {"speedup_by_tpot"}, f"rows[{i}]"))
            for i, row in enumerate(own["rows"])
        ]
        own["schema_version"] = version
        return cls(**own)


def read_bench_report(path: str | Path) -> BenchReport:
    """An eagle3-bench ``results.json``; a file that is not one is refused naming it."""
    return BenchReport.from_dict(_read_object(path, BENCH), str(path))


# ---- eagle3-served-acceptance -----------------------------------------------------------------


@dataclass
class SpecFigures:
    """An engine's speculative-decoding figures over some requests, from the difference of its counts
    (eagle3_train.evaluation.served_acceptance.DEFINITIONS says what each means)."""

    drafts: float  # verify steps that carried draft tokens (counts are ints when whole)
    draft_tokens: float
    accepted_tokens: float
    mean_acceptance_length: float  # 1 + accepted_tokens / drafts: eagle3-eval's tau
    mean_draft_length: float
    draft_acceptance_rate: float
    acceptance_per_position: list[float]  # drafts whose first i+1 tokens were all accepted / drafts
    conditional_acceptance_per_position: list[float]  # as eagle3-eval's acceptance_per_position


@dataclass
class ServedReport(SpecFigures):
    """What one ``eagle3-served-acceptance`` run read: its ``report.json``, the figures over the whole
    run at its top (docs/guide/served-acceptance.md)."""

    server: str
    engine: str
    metrics_read_from: str  # the engine version whose source named the counters
    models: list[str]  # what /v1/models listed
    model: str | None  # the one asked for
    prompts: str
    conversations: int
    requests: int
    prompt_tokens: int
    completion_tokens: int
    finish_reasons: dict[str, int]
    max_new_tokens: int
    num_speculative_tokens: int | None  # positions the engine counted (None: it counts none)
    categories: dict[
        str, dict[str, Any]
    ]  # category -> requests, completion_tokens and its SpecFigures ({drafts: 0}: none)
    server_counted: dict[str, float]  # requests, generation_tokens: the server's own count over the run
    counters_before: dict[str, float]  # drafts, draft_tokens, accepted_tokens: the server's count before the run
    definitions: dict[str, str]
    warnings: list[str]
    seconds: float
    completion_tokens_per_s: float
    config: dict[str, Any]
    chat_template_kwargs: dict[str, Any] | None = None  # the flags every request carried (absent before version 1)
    schema_version: int = SERVED_SCHEMA_VERSION

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "report") -> ServedReport:
        """Read a report as written; refuses a newer schema or a report missing a field its version has."""
        version = _schema_version(data, where, SERVED, SERVED_SCHEMA_VERSION)
        own = _own_fields(cls, data, where, SERVED, {"chat_template_kwargs"})  # absent before version 1
        own["schema_version"] = version
        return cls(**own)


def read_served_report(path: str | Path) -> ServedReport:
    """An eagle3-served-acceptance ``report.json``; a file that is not one is refused naming it."""
    return ServedReport.from_dict(_read_object(path, SERVED), str(path))
