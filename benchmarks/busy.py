"""CPU-bound processes beside a benchmark: a machine with other work on it."""

from __future__ import annotations

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def busy_processes(n: int):
    """``n`` processes spinning on a core each while the block runs, killed when it ends."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
