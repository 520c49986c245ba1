"""Engine servers started by a command of this project (``eagle3-train source=served engine.launch=true``):
each command line in its own process group with its output in a log file, watched while the run
waits for it, and stopped when the run ends, however it ends. :func:`serve` is the same servers
with nothing else to do (``eagle3-train engine.serve=true``, ``eagle3-dump serve=true``): started on
this host and watched until one exits or the command is stopped.

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
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_train.core.errors import ConfigError
from eagle3_train.engines.http import EngineError

logger = logging.getLogger(__name__)

STOP_WAIT_S = 30.0  # how long a stopped engine gets to exit before it is killed
LOG_TAIL = 2000  # characters of an engine's log quoted when it dies
PR_SET_PDEATHSIG = 1  # prctl(2)
LOG_DIR = "engine"  # <out>/engine/: the logs of the servers a command started
POLL_S = 1.0  # how often :func:`serve` looks at its servers


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


def died(command: EngineCommand, status: int) -> str:
    """The message for a server that exited: its command, its status, the end of its log."""
    tail = command.log.read_text(errors="replace")[-LOG_TAIL:] if command.log.is_file() else ""
    return (
        f"the engine started by this run exited with status {status}: {command.command}\n"
        f"  the end of its log ({command.log}):\n{tail}"
    )


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

    def exited(self) -> tuple[EngineCommand, int] | None:
        """The first started server that has exited, with its status (None: all are running)."""
        for c, p in zip(self.commands, self.procs, strict=True):
            if p.poll() is not None:
                return c, p.returncode
        return None

    def check_alive(self) -> None:
        """Raise :class:`EngineError`, quoting its log, when a started server has exited."""
        if (gone := self.exited()) is not None:
            raise EngineError(died(*gone))

    def close(self) -> None:
        """Stop every server (SIGTERM to its process group, SIGKILL after :data:`STOP_WAIT_S`)."""
        for p in self.procs:  # every group signalled before any is waited for: they stop together
            signal_group(p, signal.SIGTERM)
        for p in self.procs:
            wait_or_kill(p, STOP_WAIT_S)
        self.procs = []
        self.commands = []


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the process group of ``proc`` (started with ``start_new_session``), its leader gone
    or not: workers may outlive it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def wait_or_kill(proc: subprocess.Popen, grace_s: float) -> None:
    """Wait ``grace_s`` seconds for a signalled process, then SIGKILL its group."""
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.wait()


def stop_group(proc: subprocess.Popen, grace_s: float = STOP_WAIT_S) -> None:
    """Stop a process started with ``start_new_session``: SIGTERM to its whole group (engines and
    launchers leave children), SIGKILL after ``grace_s`` seconds."""
    signal_group(proc, signal.SIGTERM)
    wait_or_kill(proc, grace_s)


def host_logs(out: Path) -> Path:
    """``<out>/engine/<host>``: where :func:`serve` logs, one directory per host, since the engine
    hosts of one run share its ``out``."""
    return out / LOG_DIR / socket.gethostname()


def serve(commands: list[EngineCommand], who: str) -> int:
    """Start ``commands`` and wait on them. A server that exits ends the wait, its log quoted: the
    others are stopped (this host's share of the work is lost either way) and the status is its
    own, or 1 for an exit nobody asked for with status 0. SIGTERM or Ctrl-C (KeyboardInterrupt:
    the console entry points turn SIGTERM into one) stops every server and returns 0, since that
    is how a server is meant to end."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"{who} starts this host's engine servers once: run it without torchrun")
    processes = None
    try:
        processes = EngineProcesses(commands)
        logger.info(f"{who}: {len(commands)} engine server(s) running; SIGTERM or Ctrl-C stops them")
        while (gone := processes.exited()) is None:
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        if processes is not None:
            processes.close()
        logger.info(f"{who}: stopped by a signal; the engine servers are stopped")
        return 0
    command, status = gone
    logger.error(f"{who}: {died(command, status)}")
    processes.close()
    if status < 0:  # killed by signal -status: the shell's 128 + n
        return 128 - status
    return status or 1
