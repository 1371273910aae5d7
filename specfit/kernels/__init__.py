"""The compiled kernels: numba ``@njit(cache=True)`` loops over flat typed arrays.

One module per concept: :mod:`.bitsets` (expert sets as ``uint64`` words), :mod:`.tree` (a draft
tree's checks, clipping, depths and accepted path), :mod:`.evaluate` (the cost formula on a node
set), :mod:`.closure` (maximum-weight closure by max-flow), :mod:`.inner` (the inner closure
problem with its reductions), :mod:`.search` (Dinkelbach, the root bound, the greedy baseline),
:mod:`.cache` (the expert cache's admit and eviction), :mod:`.replay` (the trace replay loop),
:mod:`.levels` (the expected next draft level), :mod:`.decide` (SpecFit's per-level decisions), :mod:`.lookahead` (the draft's look-ahead for the cache), :mod:`.levers` (the cache and prefetch levers in the replay), :mod:`.router` (the router predictor's top-k selection), :mod:`.kv` (the KV cache's compaction), :mod:`.sampling` (tree speculative sampling's walk), :mod:`.acceptance` (the acceptance calibration's maps), :mod:`.identify` (the cycle-time fit's forward selection). The Python modules that own each concept (:mod:`specfit.tree`,
:mod:`specfit.search`, :mod:`specfit.experts.cache`, :mod:`specfit.simulate.replay`) are thin
wrappers: they validate, prepare arrays once and call these.

Importing this package does not import numba: a kernel module is imported on first use
(``kernels.search``), so commands that never run a kernel (``specfit --help``) start without
numba's import time. Compiled code is cached on disk next to the sources (numba's ``__pycache__``
``*.nbi`` / ``*.nbc`` files); the first call after an install or an edit compiles.

Numba keys a cached kernel on its own source file only, while a kernel that calls one from another
file (the replay calls the cache and the search) has that code compiled in. So before the first
kernel module is imported, a digest of every kernel source (the cost formula's, :mod:`.formula`,
among them) is compared with the one stored beside the cache; when it differs, this package's
cached kernels are dropped and recompiled. An install whose ``__pycache__`` cannot be written (a
read-only site-packages: a container image run as another user) caches in a folder named after
that digest under the user's cache directory (``~/.cache/specfit/numba/<digest>``), or the
system's temporary directory when that cannot be written either, so a changed kernel never meets
another's cache; where nothing can be written, the first kernel says so in one line. With
``NUMBA_CACHE_DIR`` set the caches live there and these checks are skipped.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

__all__ = ["bitsets", "tree", "evaluate", "closure", "inner", "search", "cache", "replay", "levels",
           "decide", "lookahead", "levers", "router", "kv", "sampling", "acceptance", "identify",
           "drop_stale_caches", "sources_digest", "cache_folder", "writable"]

_MODULES = frozenset(("bitsets", "tree", "evaluate", "closure", "inner", "search", "cache", "replay", "levels",
                      "decide", "lookahead", "levers", "router", "kv", "sampling", "acceptance", "identify"))
_checked = False


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _drop_stale_caches()
    return importlib.import_module(f"{__name__}.{name}")


def _drop_stale_caches() -> None:
    global _checked
    if _checked:
        return
    if not os.environ.get("NUMBA_CACHE_DIR"):
        here = Path(__file__).resolve().parent
        sources, cache = sorted(here.glob("*.py")), here / "__pycache__"
        if writable(cache):
            drop_stale_caches(sources, cache / "kernels.sha256", [(cache, "*.nb[ic]")])
        else:
            import numba

            numba.config.CACHE_DIR = str(cache_folder(sources_digest(sources)))
    _checked = True


def writable(folder: Path) -> bool:
    """Whether files can be created in ``folder`` (made if missing), as numba checks a cache's."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


def cache_folder(digest: str) -> Path:
    """Where a read-only install's kernels are cached: a folder of these sources' ``digest`` in the
    user's cache directory, else in the system's temporary directory (per user); an error naming
    ``NUMBA_CACHE_DIR`` when neither can be written (numba would stop at the first kernel with a
    traceback). Numba's cache files are pickles: a folder is used only when it is this user's and
    no one else can write to it (on a shared temporary directory another user could make it first)."""
    import tempfile

    from ..errors import SpecFitError
    from ..io import user_cache_dir

    tried = [user_cache_dir() / "specfit" / "numba", Path(tempfile.gettempdir()) / f"specfit-numba-{_user()}"]
    for root in tried:
        if _private(root) and writable(root / digest[:16]):
            return root / digest[:16]
    raise SpecFitError(f"SpecFit's compiled kernels need a writable cache: {Path(__file__).parent / '__pycache__'} "
                       f"(the install's), {tried[0]} and {tried[1]} cannot be written or are another user's; set "
                       "NUMBA_CACHE_DIR to a writable directory")


def _user() -> str:
    return str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")


def _private(root: Path) -> bool:
    """Whether ``root`` (made, only its owner's, if missing) is this user's and writable by no one
    else; one of the user's that others may write to (made under a umask of 002 by an earlier
    version) is made the user's alone first."""
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        held = root.stat()
        if not hasattr(os, "getuid"):
            return True
        if held.st_uid != os.getuid():
            return False
        if held.st_mode & 0o022:
            root.chmod(0o700)
    except OSError:
        return False
    return True


def sources_digest(sources: list[Path]) -> str:
    """The digest of the kernel ``sources``, names and contents: what a cache was compiled from."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def drop_stale_caches(sources: list[Path], stamp: Path, caches: list[tuple[Path, str]]) -> bool:
    """Delete the cache files matching ``caches`` (folder, glob pattern) unless ``stamp`` holds the
    digest of ``sources``; then store it. True when files were dropped (or there was no stamp)."""
    want = sources_digest(sources)
    try:
        if stamp.read_text() == want:
            return False
    except OSError:
        pass
    # before the try: a failed unlink reaches its except clause, which names SpecFitError
    from ..errors import SpecFitError
    from ..io import write_text_atomic

    try:
        for folder, pattern in caches:
            for path in folder.glob(pattern):
                path.unlink(missing_ok=True)
        write_text_atomic(stamp, want)
    except (OSError, SpecFitError):   # a read-only install (numba then caches in the user's cache
        pass                          # directory), or a stamp that is no regular file

    return True
