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
