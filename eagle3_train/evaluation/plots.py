"""The figures of the evaluation tools: eagle3-eval's ``acceptance.png`` and eagle3-bench's
``speedup.png`` (the ``plots`` extra, matplotlib; ``plot=false`` goes without)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_train.core.extras import optional_import
from eagle3_train.core.reports import BenchReport


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only (never a window)."""
    optional_import("matplotlib").use("Agg")
    return optional_import("matplotlib.pyplot")


def plot_acceptance(report: dict[str, Any], path: Path) -> None:
    """Acceptance rate per draft position: one group of bars per category (and all)."""
    plt = _pyplot()
    groups = {"all": report} | report["categories"] if len(report["categories"]) > 1 else {"all": report}
    k = len(report["acceptance_per_position"])
    width = 0.8 / k
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(groups) + 2), 3.6))
    colors = plt.get_cmap("viridis")
    for i in range(k):
        xs = [g + (i - (k - 1) / 2) * width for g in range(len(groups))]
        ax.bar(
            xs,
            [v["acceptance_per_position"][i] for v in groups.values()],
            width,
            color=colors(i / max(k - 1, 1)),
            label=f"position {i + 1}",
        )
    ax.set_xticks(range(len(groups)), [f"{name}\ntau {v['tau']:.2f}" for name, v in groups.items()], fontsize=8)
    ax.set(ylabel="acceptance rate", ylim=(0, 1), title=f"tau = {report['tau']:.2f}")
    ax.legend(fontsize=7, ncols=min(k, 8), loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_speedup(report: BenchReport, path: Path) -> None:
    """Speed-up against concurrency (one line per temperature), and both engines' tokens/s."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for temperature in report.settings["temperatures"]:
        rows = [r for r in report.rows if r.temperature == temperature]
        xs = [r.concurrency for r in rows]
        label = "greedy" if temperature == 0 else f"temperature {temperature}"
        left.plot(xs, [r.speedup for r in rows], marker="o", label=label)
        for side, style, figs in (
            ("baseline", "--", [r.baseline for r in rows]),
            ("spec", "-", [r.spec for r in rows]),
        ):
            right.plot(xs, [f["output_tokens_per_s"] for f in figs], style, marker="o", label=f"{side}, {label}")
    left.axhline(1.0, color="grey", linewidth=0.8)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.legend(fontsize=8)
    left.set_ylabel("speed-up (x)")
    right.set_ylabel("output tokens/s")
    left.set_title(f"{report.engine['name']}: with the draft / without")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
