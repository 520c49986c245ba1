"""The eval report as a type: what eagle3-eval writes reads back as an EvalReport (its stage record
beside it); a report of a later schema, or not a report, is refused naming the file."""

import json

import pytest

from eagle3_train.core.errors import BadInputError
from eagle3_train.evaluation.eval import EvalConfig, Evaluator
from eagle3_train.evaluation.reports import EVAL_SCHEMA_VERSION, EvalReport, read_eval_report
from test_export_eval import pipeline  # noqa: F401  (the tiny target with a trained, exported draft)


@pytest.fixture(scope="module")
def written(pipeline, tmp_path_factory):  # noqa: F811
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
