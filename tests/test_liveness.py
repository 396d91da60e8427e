"""The suite's wait for child processes (tests/_liveness.py) stops a real hang and lets a slow,
working child finish, however long the wall clock runs."""

from __future__ import annotations

import sys
import time

import pytest
from _liveness import run_alive

BUSY = (
    "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\nprint('done')"
)


def test_a_child_that_uses_no_cpu_is_stopped_as_a_hang():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="used no CPU for 1 s"):
        run_alive([sys.executable, "-c", "import time; time.sleep(60)"], stall=1.0)
    assert time.monotonic() - t0 < 30


def test_a_child_busy_longer_than_the_stall_window_is_not_stopped():
    done = run_alive([sys.executable, "-c", BUSY.format(s=3.0)], stall=1.5)
    assert done.returncode == 0 and done.stdout == "done\n"


def test_input_reaches_the_child_and_its_exit_status_comes_back():
    code = "import sys; print(sys.stdin.read()[::-1]); sys.exit(3)"
    done = run_alive([sys.executable, "-c", code], input="abc")
    assert (done.returncode, done.stdout) == (3, "cba\n")
