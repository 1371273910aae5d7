"""A module of another git revision, imported beside this checkout's (for the side-by-side
benchmarks: ``bench_draft_level.py``, ``bench_learning.py``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_at(revision: str, path: str, name: str, tool: str):
    """``path`` (a module one folder below the ``specfit`` package, e.g.
    ``specfit/runtime/drafting.py``) as it is in ``revision``, read with ``git show`` and imported
    as ``name``; its relative imports are made absolute, so it imports this checkout's helpers.
    A revision git does not know is one error naming ``tool``'s ``--baseline``."""
    shown = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{path}"], capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"{tool}: --baseline {revision}: {shown.stderr.strip()}")
    package = ".".join(Path(path).parent.parts)           # what "from ." names
    source = shown.stdout.replace("from ..", "from specfit.").replace("from specfit. import", "from specfit import")
    source = source.replace("from .", f"from {package}.")
    file = Path(tempfile.mkdtemp(prefix=f"{tool}.")) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module
