"""The reports as types: what eagle3-eval writes reads back as an EvalReport (its stage record
beside it), eagle3-bench's and eagle3-served-acceptance's as a BenchReport and a ServedReport (their
commands' own tests read what they wrote); a report of a later schema, or not a report, is refused
naming the file."""

import json
from dataclasses import asdict

import pytest

from eagle3_train.core.errors import BadInputError
from eagle3_train.core.reports import (
    BENCH_SCHEMA_VERSION,
    EVAL_SCHEMA_VERSION,
    SERVED_SCHEMA_VERSION,
    BenchReport,
    BenchRow,
    EvalReport,
    ServedReport,
    read_bench_report,
    read_eval_report,
    read_served_report,
    write_report,
)
from eagle3_train.evaluation.eval import EvalConfig, Evaluator


@pytest.fixture(scope="module")
def written(pipeline, tmp_path_factory):
    out = tmp_path_factory.mktemp("reports") / "eval"
    returned = Evaluator(
        EvalConfig(
            draft=str(pipeline / "export"),
            target="tiny",
            prompts=str(pipeline / "prompts.jsonl"),
            limit=2,
            max_new_tokens=6,
            k=3,
            progress=False,
            plot=False,
            out=str(out),
        )  # fmt: skip
    ).run()
    return out / "report.json", returned


def test_what_eval_writes_reads_back_typed(written):
    path, returned = written
    r = read_eval_report(path)
    assert r.schema_version == EVAL_SCHEMA_VERSION and r.tau == returned["tau"] and r.prompts == 2
    assert r.record["stage"] == "eval" and "request" in r.record  # the stage record, kept apart
    assert r.to_dict() == {k: v for k, v in returned.items() if k not in r.record}


def test_older_newer_and_foreign_reports(written, tmp_path):
    path, _ = written
    data = json.loads(path.read_text())
    old = {k: v for k, v in data.items() if k not in ("schema_version", "by_region", "chat_template_kwargs")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    r = read_eval_report(tmp_path / "old.json")
    assert r.schema_version == 0 and r.by_region is None and r.tau == data["tau"]
    (tmp_path / "new.json").write_text(json.dumps(data | {"schema_version": EVAL_SCHEMA_VERSION + 1}))
    with pytest.raises(BadInputError, match=r"new.json is an eagle3-eval report of schema version 2; .* upgrade"):
        read_eval_report(tmp_path / "new.json")
    (tmp_path / "other.json").write_text(json.dumps({"tau": 2.0}))
    with pytest.raises(BadInputError, match=r"other.json is no eagle3-eval report \(it lacks acceptance_per_position"):
        read_eval_report(tmp_path / "other.json")
    with pytest.raises(BadInputError, match="cannot be read"):
        read_eval_report(tmp_path / "missing.json")
    assert isinstance(EvalReport.from_dict(data), EvalReport)


def bench_report() -> BenchReport:
    """A small eagle3-bench report, as Bench.run builds it (one level)."""
    level = {"requests": 4, "completion_tokens": 40, "seconds": 2.0, "output_tokens_per_s": 20.0}
    return BenchReport(
        what="eagle3-bench: output tokens/s of vllm serving the target alone and with the draft",
        machine={"host": "h", "os": "linux", "python": "3.10", "gpus": None},
        command="eagle3-bench out=o",
        date="2026-12-04T00:00:00+00:00",
        engine={"name": "vllm", "metrics_read_from": "vLLM 0.26.0", "baseline": {"url": "http://b"}, "spec": {}},
        settings={"concurrency": [1], "temperatures": [0.0]},
        rows=[
            BenchRow(
                temperature=0.0,
                concurrency=1,
                baseline=level,
                spec=level | {"output_tokens_per_s": 30.0, "mean_acceptance_length": 2.5},
                speedup=1.5,
                speedup_by_tpot=1.4,
            )
        ],
        warnings=[],
        config={"engine": "vllm"},
        chat_template_kwargs={"enable_thinking": False},
    )


def served_report() -> ServedReport:
    """A small eagle3-served-acceptance report, as ServedAcceptance.report builds it."""
    return ServedReport(
        drafts=11,
        draft_tokens=55,
        accepted_tokens=23,
        mean_acceptance_length=1 + 23 / 11,
        mean_draft_length=5.0,
        draft_acceptance_rate=23 / 55,
        acceptance_per_position=[8 / 11, 6 / 11],
        conditional_acceptance_per_position=[8 / 11, 6 / 8],
        server="http://127.0.0.1:8000",
        engine="vllm",
        metrics_read_from="vLLM 0.26.0",
        models=["m"],
        model="m",
        prompts="p.jsonl",
        conversations=3,
        requests=5,
        prompt_tokens=50,
        completion_tokens=30,
        finish_reasons={"length": 5},
        max_new_tokens=6,
        num_speculative_tokens=2,
        categories={"math": {"requests": 5, "completion_tokens": 30, "drafts": 11}},
        server_counted={"requests": 5, "generation_tokens": 30},
        counters_before={"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0},
        definitions={"drafts": "verify steps"},
        warnings=[],
        seconds=1.5,
        completion_tokens_per_s=20.0,
        config={"engine": "vllm"},
        chat_template_kwargs={},
    )


def test_bench_and_served_reports_round_trip(tmp_path):
    for name, report, read in (
        ("results.json", bench_report(), read_bench_report),
        ("report.json", served_report(), read_served_report),
    ):
        write_report(tmp_path / name, report)
        assert read(tmp_path / name) == report
    data = json.loads((tmp_path / "results.json").read_text())  # the keys results files have always had
    assert data["schema_version"] == BENCH_SCHEMA_VERSION and data["rows"][0]["speedup"] == 1.5
    served = json.loads((tmp_path / "report.json").read_text())
    assert served["schema_version"] == SERVED_SCHEMA_VERSION and served["mean_acceptance_length"] == 1 + 23 / 11


def test_older_bench_and_served_reports_read_as_version_0(tmp_path):
    bench = asdict(bench_report())
    del bench["schema_version"], bench["chat_template_kwargs"], bench["rows"][0]["speedup_by_tpot"]  # not yet written
    (tmp_path / "results.json").write_text(json.dumps(bench))
    r = read_bench_report(tmp_path / "results.json")
    assert r.schema_version == 0 and r.chat_template_kwargs is None and r.rows[0].speedup_by_tpot is None
    assert r.rows[0].speedup == 1.5 and r.rows[0].spec["mean_acceptance_length"] == 2.5
    served = asdict(served_report())
    del served["schema_version"], served["chat_template_kwargs"]
    (tmp_path / "report.json").write_text(json.dumps(served))
    s = read_served_report(tmp_path / "report.json")
    assert s.schema_version == 0 and s.chat_template_kwargs is None and s.drafts == 11


def test_newer_and_foreign_bench_and_served_reports_are_refused_by_name(written, tmp_path):
    eval_path, _ = written
    for read, report, what in (
        (read_bench_report, bench_report(), "eagle3-bench report"),
        (read_served_report, served_report(), "eagle3-served-acceptance report"),
    ):
        (tmp_path / "new.json").write_text(json.dumps(asdict(report) | {"schema_version": 2}))
        with pytest.raises(BadInputError, match=rf"new.json is an {what} of schema version 2; .* upgrade it"):
            read(tmp_path / "new.json")
        with pytest.raises(BadInputError, match=rf"{eval_path} is no {what} \(it lacks "):
            read(eval_path)  # eval's report.json
        (tmp_path / "list.json").write_text("[]")
        with pytest.raises(BadInputError, match=rf"list.json is no {what} \(not an object\)"):
            read(tmp_path / "list.json")
        with pytest.raises(BadInputError, match=rf"missing.json cannot be read as an {what}"):
            read(tmp_path / "missing.json")
    bench = asdict(bench_report())
    del bench["rows"][0]["speedup"]
    (tmp_path / "row.json").write_text(json.dumps(bench))
    with pytest.raises(BadInputError, match=r"row.json is no eagle3-bench report \(rows\[0\] lacks speedup\)"):
        read_bench_report(tmp_path / "row.json")
    write_report(tmp_path / "served.json", served_report())  # the other command's report
    with pytest.raises(BadInputError, match=r"served.json is no eagle3-bench report \(it lacks command, date, "):
        read_bench_report(tmp_path / "served.json")
    with pytest.raises(BadInputError, match=r"served.json is no eagle3-eval report \(it lacks "):
        read_eval_report(tmp_path / "served.json")
