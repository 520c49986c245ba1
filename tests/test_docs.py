"""The docs: the site builds with its generated pages, an undocumented config field fails the
reference generation, and every command the README and the docs show is one its Hydra app parses."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _gen_pages():
    spec = importlib.util.spec_from_file_location("gen_pages", DOCS / "gen_pages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_pages"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


gen_pages = _gen_pages()


# ---------------------------------------------------------------------------------------------
# the reference generator on hand-made dataclasses


@dataclass
class _Section:
    """A nested section."""

    depth: int = 2  # how deep it goes


@dataclass
class _Documented:
    """Options of a hand-made command."""

    name: str = "x"  # the name, with a | pipe and a <placeholder>
    count: int = 1
    """an attribute docstring"""
    ratio: float = field(default=0.5, metadata={"doc": "from the field's metadata"})
    section: _Section = field(default_factory=_Section)
    items: list[int] | None = None  # a list


@dataclass
class _Undocumented:
    """One field has no doc."""

    documented: int = 1  # has a doc
    bare: bool = False


@dataclass
class _Outer:
    """Its nested section has an undocumented field."""

    inner: _Undocumented = field(default_factory=_Undocumented)  # the inner section


def test_reference_rows_read_every_kind_of_field_doc():
    rows = gen_pages.reference_rows(_Documented)
    assert [r.name for r in rows] == ["name", "count", "ratio", "section", "section.depth", "items"]
    docs = {r.name: r.doc for r in rows}
    assert docs["name"].startswith("the name")
    assert docs["count"] == "an attribute docstring"
    assert docs["ratio"] == "from the field's metadata"
    assert docs["section"] == "A nested section."  # a section may take its class's docstring
    assert docs["section.depth"] == "how deep it goes"
    page = gen_pages.reference_page("eagle3-handmade", _Documented)
    assert "`section.depth`" in page and "&lt;placeholder&gt;" in page and "&#124; pipe" in page
    assert "| `items` | `list[int] | None` | `null` |" in page


def test_a_field_without_a_doc_fails_the_reference_generation():
    with pytest.raises(gen_pages.MissingFieldDoc, match=r"_Undocumented\.bare"):
        gen_pages.reference_rows(_Undocumented)
    with pytest.raises(gen_pages.MissingFieldDoc, match=r"_Undocumented\.bare"):
        gen_pages.reference_page("eagle3-outer", _Outer)


def test_the_results_pages_take_any_results_file_older_than_the_schema(tmp_path):
    section = gen_pages.result_section(
        "odd.json",
        {
            "what": "w",
            "machine": "m",
            "date": "2026-12-01",
            "commands": {"a": "eagle3-train x=1"},
            "tau": 2.5,
            "nested": {"x": 1, "deeper": {"y": 2}},
            "curve": [{"a": 1}],
        },
    )
    assert "| what | w |" in section and "| command.a | eagle3-train x=1 |" in section
    assert "| `tau` | 2.5 |" in section and "| `nested.x` | 1 |" in section
    assert "deeper" not in section
    with pytest.raises(ValueError, match="holds an object"):
        gen_pages.result_section("list.json", [1, 2, 3])


def test_a_results_files_ready_made_tables_are_shown_as_they_are():
    data = {
        "what": "w",
        "tables": [
            {"title": "Speed-up | served", "header": ["c", "×"], "rows": [["1", "0.96"], ["16", "0.85"], ["bad"]]},
            {"title": "no header", "rows": [["x"]]},
        ],
    }
    section = gen_pages.result_section("t.json", data)
    assert "**Speed-up &#124; served**" in section  # a pipe in the title cannot break the page
    lines = section.splitlines()
    start = lines.index("| c | × |")
    assert lines[start + 2 : start + 4] == ["| 1 | 0.96 |", "| 16 | 0.85 |"]  # a row of the wrong width is left out
    assert "bad" not in section and "no header" not in section


# ---------------------------------------------------------------------------------------------
# the site


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    site = tmp_path / "site"
    for page in ("concepts/engine-rules", "reference/eagle3-train", "results", "results/recipe", "changelog"):
        assert (site / page / "index.html").is_file(), page
    rules = (site / "concepts" / "engine-rules" / "index.html").read_text()
    assert "verified by a run" in rules and "read from source only" in rules


# ---------------------------------------------------------------------------------------------
# every shown command parses

FENCE = re.compile(r"^```(bash|sh|shell|console)\s*\n(.*?)^```", re.M | re.S)
SEPARATORS = {";", "&&", "||", "|", "&"}
LAUNCHERS = {"launch/train.sh": "eagle3-train", "launch/dump.sh": "eagle3-dump", "launch/dump_served.sh": "eagle3-dump"}
DUMMY = "/tmp/eagle3-docs-dummy"


def _scripts() -> dict[str, str]:
    return gen_pages._scripts()


def _commands(text: str) -> list[tuple[int, str]]:
    """(line, command text) of every command in the shell fences of a markdown text."""
    out = []
    for m in FENCE.finditer(text):
        first = text.count("\n", 0, m.start(2)) + 1
        lines = m.group(2).split("\n")
        i = 0
        while i < len(lines):
            start, buf = i, lines[i]
            while buf.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                buf = buf.rstrip()[:-1] + " " + lines[i]
            out.append((first + start, buf))
            i += 1
    return out


def _substitute(command: str) -> str:
    command = re.sub(r"<[^<>\n]+>", DUMMY, command)  # <hf_dir>, <node0>, ...
    command = re.sub(r"\$\{?[A-Za-z_]\w*\}?", DUMMY, command)  # $MODEL, ${RUN}
    return re.sub(r"(?<==)\.\.\.(?=\s|$)", DUMMY, command)  # data=...


def _invocations(command: str, scripts: dict[str, str]) -> list[tuple[str, list[str]]]:
    """The (console script, Hydra overrides) of each of this project's apps a shell line runs."""
    lexer = shlex.shlex(_substitute(command), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:
        return []
    modules = {target.split(":")[0]: script for script, target in scripts.items()}
    found, part = [], []
    for tok in tokens + [";"]:
        if tok not in SEPARATORS:
            part.append(tok)
            continue
        while part and re.match(r"^[A-Za-z_]\w*=", part[0]):  # VAR=value before the command
            part.pop(0)
        if part:
            head = part[0]
            if head.startswith("eagle3-"):
                found.append((head, part[1:]))  # an unknown eagle3-* name fails below
            elif head in LAUNCHERS:
                found.append((LAUNCHERS[head], part[1:]))
            elif "-m" in part and part.index("-m") + 1 < len(part) and head in ("torchrun", "python", "python3"):
                k = part.index("-m")
                if part[k + 1] in modules:
                    found.append((modules[part[k + 1]], part[k + 2 :]))
        part = []
    return found


def _all_shown_commands() -> list[tuple[str, str, list[str]]]:
    scripts = _scripts()
    out = []
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for line, command in _commands(path.read_text()):
            for script, args in _invocations(command, scripts):
                out.append((f"{path.relative_to(ROOT)}:{line}", script, args))
    return out


RUNNER = r"""
import contextlib, importlib, io, json, sys
jobs, scripts = json.load(sys.stdin)
results = []
for where, script, args in jobs:
    if script not in scripts:
        results.append([where, script, 2, f"no console script {script!r} in pyproject"]); continue
    module, _, func = scripts[script].partition(":")
    main = getattr(importlib.import_module(module), func)
    sys.argv = [script, *args, "--cfg", "job"]
    buf, code = io.StringIO(), 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception as e:  # a crash while parsing is a failure too, with its message
            code = 1
            print(repr(e))
    results.append([where, script, code, buf.getvalue()[-1500:]])
print(json.dumps(results))
"""


@pytest.mark.slow
def test_every_shown_command_is_parsed_by_its_hydra_app(tmp_path):
    jobs = _all_shown_commands()
    shown = {script for _, script, _ in jobs}
    assert set(_scripts()) <= shown, f"commands never shown in the README or docs: {sorted(set(_scripts()) - shown)}"
    assert len(jobs) >= 40
    env = dict(os.environ, WANDB_MODE="disabled", HYDRA_FULL_ERROR="0")
    done = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps([jobs, _scripts()]),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    bad = [
        f"{where}: {script} (exit {code}): {out.strip()[-600:]}" for where, script, code, out in results if code != 0
    ]
    assert not bad, "commands their Hydra app does not parse:\n" + "\n".join(bad)
    assert all(out.strip() for *_, out in results)  # --cfg job printed the composed config
