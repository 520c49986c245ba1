"""The peers harness and the staging scripts of benchmarks/ (the benchmark programs: test_programs.py;
the product's tests under tests/ import nothing from here)."""

import subprocess
import sys
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(LAB),
    str(LAB.parent),
]  # the lab's scripts import each other as top-level modules or as benchmarks.*


def test_a_staging_part_still_fits_in_one_device_call_beside_the_working_tree():
    """A device call carries at most 64 MiB: the tracked tree plus the carried part. The vLLM parts were
    60 MiB until the tree passed 4 MiB and three of four calls were refused; a part's size leaves room."""
    import re

    ls = subprocess.run(["git", "ls-files", "-z"], cwd=LAB.parent, capture_output=True)
    if ls.returncode != 0:
        pytest.skip("not a git checkout")
    tree = sum(
        (LAB.parent / f).stat().st_size for f in ls.stdout.decode().split("\0") if f and (LAB.parent / f).is_file()
    )
    for script in ("stage_vllm.sh", "stage_sglang.sh", "stage_sglang14.sh"):
        part_mib = int(re.search(r"^part_mib=\$\{PART_MIB:-(\d+)\}", (LAB / "staging" / script).read_text(), re.M)[1])
        assert tree + part_mib * 2**20 <= 62 * 2**20, (script, tree)  # (2 MiB for the tree's growth between packs)


def test_every_lab_script_finds_the_repository_root():
    """A script's ``Path(__file__).resolve().parents[N]`` names the repository (it holds pyproject.toml):
    the lab moved up a floor once, and scripts counting from the old place read files that are not there."""
    import re

    for script in sorted(LAB.glob("*.py")):
        for n in re.findall(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d+)\]", script.read_text()):
            root = script.resolve().parents[int(n)]
            assert (root / "pyproject.toml").is_file(), f"{script.name}: parents[{n}] is {root}, not the repository"


def test_target_forward_times_the_capture_eager_then_compiled_and_writes_its_table(tmp_path):
    """benchmarks/target_forward.py on the CPU with the tiny target: each micro-batch size eager, then
    the same with online.compile's layers compiled (every layer), in one results file."""
    import json

    import torch

    from benchmarks import target_forward
    from eagle3_train.core import capture

    # compile afresh: the decoder layers' forward is one code object for every model of its class, and
    # earlier tests in this process may have spent its recompile limit, past which dynamo runs it eager
    torch._dynamo.reset()
    compiled: list[int] = []
    real = capture.compile_layers

    def spy(model, option):
        real(model, option)
        compiled.append(sum(layer._compiled_call_impl is not None for layer in model.base_model.layers))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(target_forward, "compile_layers", spy)
        target_forward.main(["--out", str(tmp_path / "tf.json"), "--target", "tiny", "--device", "cpu",
                             "--tokens", "64,128", "--seq", "32", "--iters", "2", "--aux", "1,2,3"])  # fmt: skip
    (table,) = json.loads((tmp_path / "tf.json").read_text())["tables"]
    assert [(r[0], r[1]) for r in table["rows"]] == [("eager", 64), ("eager", 128), ("compiled", 64), ("compiled", 128)]
    assert compiled == [4]  # (the tiny target's four layers)
    for _, tokens, first, host, wall, rate, _, launches in table["rows"]:
        assert first > 0 and 0 < host <= wall and rate == pytest.approx(tokens / (wall / 1e3), rel=0.01)
        assert launches == 0  # (the CPU launches no kernels)
    ops = {(r[0], r[1]): r[6] for r in table["rows"]}
    # the compiled layers run as generated code: fewer aten ops than eager, and the count does not grow with the batch
    assert ops[("compiled", 64)] < ops[("eager", 64)] and ops[("eager", 64)] == ops[("eager", 128)]
