"""Engine servers started by a command of this project (``eagle3-train source=served engine.launch=true``):
each command line in its own process group with its output in a log file, watched while the run
waits for it, and stopped when the run ends, however it ends.

The command lines are the ones an engine's :class:`~eagle3_train.engines.capture.StateCapture`
prints for a capture (``eagle3-dump print_launch=true`` shows the same), so the engine is started
with exactly the flags that make it return the trained layers.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from eagle3_train.engines.http import EngineError

logger = logging.getLogger(__name__)

STOP_WAIT_S = 30.0  # how long a stopped engine gets to exit before it is killed
LOG_TAIL = 2000  # characters of an engine's log quoted when it dies
PR_SET_PDEATHSIG = 1  # prctl(2)


def command_lines(text: str) -> list[str]:
    """The shell commands in a printed launch text: comment lines dropped, backslash
    continuations joined."""
    out, line = [], ""
    for raw in text.splitlines():
        if not line and raw.lstrip().startswith("#"):
            continue
        line += raw
        if line.endswith("\\"):
            line = line[:-1]
            continue
        if line.strip():
            out.append(line.strip())
        line = ""
    if line.strip():
        out.append(line.strip())
    return out


@dataclass
class EngineCommand:
    """One server to start: its shell command, the GPUs it sees (None: this process's), its log."""

    command: str
    devices: str | None
    log: Path


def _die_with_parent() -> None:
    """(in the child, before exec) Linux: SIGTERM when the process that started it dies, however it
    dies (SIGKILL included), so no engine outlives its run holding the GPU."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class EngineProcesses:
    """Servers started from this process; :meth:`close` (also run at exit) stops them all.

    Args:
        commands: what to start, in order.
    """

    def __init__(self, commands: list[EngineCommand]):
        self.commands = commands
        self.procs: list[subprocess.Popen] = []
        atexit.register(self.close)
        for c in commands:
            env = dict(os.environ)
            if c.devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = c.devices
            c.log.parent.mkdir(parents=True, exist_ok=True)
            with c.log.open("ab") as log:
                log.write(f"# {c.command}\n".encode())
                log.flush()
                # a session of its own: the engine's worker processes are stopped with it
                self.procs.append(
                    subprocess.Popen(
                        ["bash", "-c", f"exec {c.command}"],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        start_new_session=True,
                        preexec_fn=_die_with_parent,
                    )
                )
            logger.info(f"started engine (pid {self.procs[-1].pid}, log {c.log}): {c.command}")

    def check_alive(self) -> None:
        """Raise :class:`EngineError`, quoting its log, when a started server has exited."""
        for c, p in zip(self.commands, self.procs, strict=True):
            if p.poll() is not None:
                tail = c.log.read_text(errors="replace")[-LOG_TAIL:] if c.log.is_file() else ""
                raise EngineError(
                    f"the engine started by this run exited with status {p.returncode}: {c.command}\n"
                    f"  the end of its log ({c.log}):\n{tail}"
                )

    def close(self) -> None:
        """Stop every server (SIGTERM to its process group, SIGKILL after :data:`STOP_WAIT_S`)."""
        for p in self.procs:  # the group too when its leader is gone: workers may outlive it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []
        self.commands = []
