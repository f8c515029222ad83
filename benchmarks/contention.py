"""Other processes on the machine, played on purpose: busy loops in a session of their own.

A session of its own is another scheduler autogroup (what a second program, a neighbour pod or
`stress-ng` started from another shell is), so the processes under test get their fair share of the
cores and no more. Used by snac_tier.py --busy and by the tests that must hold on a loaded machine.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator

from megapod.launcher import Child


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """n single-threaded busy loops for the block's length (none for n = 0)."""
    loops = [Child(f"busy-{i}", [sys.executable, "-c", "while True: pass"], None, own_session=True).start()
             for i in range(n)]
    try:
        yield
    finally:
        for loop in loops:
            loop.stop(signal.SIGKILL)
