"""A group of one (``init_distributed(always=True)`` outside torchrun) on a port another process
takes between the pick and the listen: it picks again; a port the caller gave is not changed."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TAKEN = """
import os, socket, sys
import torch.distributed as dist
from eagle3_train.core import dist as d
taken = socket.socket(); taken.bind(("127.0.0.1", 0)); taken.listen(); port = taken.getsockname()[1]
picks = [port]
real = d._free_port
d._free_port = lambda: picks.pop(0) if picks else real()
info = d.init_distributed("cpu", always=True)
print(dist.is_initialized() and dist.get_world_size() == 1, int(os.environ["MASTER_PORT"]) != port)
"""

GIVEN = TAKEN.replace("info = d.init_distributed", "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', "
                      "MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))\ninfo = d.init_distributed")  # fmt: skip


def run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # (this process's own group)
        env.pop(name, None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_group_of_one_picks_its_port_again_when_another_process_took_it():
    done = run(TAKEN)
    assert done.returncode == 0 and done.stdout.split() == ["True", "True"], done.stderr[-2000:]


def test_a_port_the_caller_gave_is_not_changed_when_it_is_taken():
    done = run(GIVEN)
    assert done.returncode != 0 and "DistNetworkError" in done.stderr
