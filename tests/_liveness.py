"""Waiting for child processes without a wall-clock limit that a busy machine trips.

A child is declared hung only when its process tree has used no CPU for ``stall`` seconds of
wall time: on a loaded 2-core machine a slow child still accrues CPU time, while a deadlock
(ranks waiting on each other, a kernel that never returns input) does not.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence

import psutil

#: seconds without any CPU time used by a child's process tree before it counts as hung
STALL_S = 120.0
POLL_S = 2.0


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time of these processes and all their descendants (gone ones count 0)."""
    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            tree = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in tree:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total


def wait_alive(done: Callable[[], bool], pids: Callable[[], Sequence[int]], what: str,
               stall: float = STALL_S) -> None:
    """Poll ``done()`` until it is true; raise ``TimeoutError`` once ``pids()`` used no CPU for
    ``stall`` seconds (the caller kills them)."""
    last_cpu, last_change = -1.0, time.monotonic()
    while not done():
        cpu = cpu_seconds(pids())
        now = time.monotonic()
        if cpu > last_cpu + 0.01:
            last_cpu, last_change = cpu, now
        elif now - last_change > stall:
            raise TimeoutError(f"{what} used no CPU for {stall:.0f} s (a hang)")


def run_alive(cmd: Sequence[str], *, input: str | None = None, stall: float = STALL_S,
              **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)``, killed only when hung."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if input is not None else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    pending = {"input": input}
    out: list[str] = []

    def done() -> bool:
        try:
            out[:] = proc.communicate(pending.pop("input", None), timeout=POLL_S)
            return True
        except subprocess.TimeoutExpired:
            return False

    try:
        wait_alive(done, lambda: [proc.pid], f"{cmd[0]} ...", stall)
    except TimeoutError:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out[0], out[1])
