"""The old home of the report types, now :mod:`eagle3_train.core.reports` (the model card reads them
below the evaluation layer). Kept only until ``eagle3_train/run.py`` and ``benchmarks/`` import them
from there; nothing new imports this module."""

from eagle3_train.core.reports import (  # noqa: F401 (re-exported)
    BENCH_SCHEMA_VERSION,
    EVAL_SCHEMA_VERSION,
    SERVED_SCHEMA_VERSION,
    BenchReport,
    BenchRow,
    EvalReport,
    ServedReport,
    SpecFigures,
    read_bench_report,
    read_eval_report,
    read_served_report,
    write_report,
)
