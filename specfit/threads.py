"""How many CPU threads torch and the BLAS libraries use, for the commands that run models (torch
is imported only when the threads are set, so the CLI starts without it)."""

from __future__ import annotations

from .errors import SpecFitError

__all__ = ["set_cpu_threads", "one_blas_thread", "DEFAULT_CPU_THREADS", "THREADS_HELP"]

# torch's default (one intra-op thread per core) collapses when another process shares the cores:
# its threads spin-wait on each other (benchmarks/RESULTS.md, "Threads"); one thread does not
DEFAULT_CPU_THREADS = 1
THREADS_HELP = (f"torch CPU threads (default {DEFAULT_CPU_THREADS}: torch's own default of one per core stalls "
                "when other processes share the cores; raise it on a machine of your own)")


def set_cpu_threads(threads: int | None, option: str = "--threads") -> int:
    """Set torch's intra-op threads and the thread pools of numpy's and scipy's BLAS (the compiled
    router predictor's GEMMs run in scipy's) to ``threads`` (``None``:
    :data:`DEFAULT_CPU_THREADS`); one clear error for a count below 1. A BLAS pool of one thread
    per core wakes its threads for every small product of the decoder's per-level bookkeeping,
    which costs more than the product itself (``benchmarks/RESULTS.md``)."""
    threads = DEFAULT_CPU_THREADS if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SpecFitError(f"{option}: expected a whole number of threads >= 1, got {threads!r}")
    import scipy.linalg.cython_blas  # noqa: F401  (loads scipy's BLAS, so that its pool is limited too)
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    threadpool_limits(limits=threads, user_api="blas")
    return threads


_CONTROLLER = None


def one_blas_thread():
    """A context in which numpy's and scipy's BLAS run on one thread. A fit whose result must not
    depend on the machine runs in it: a multi-threaded BLAS sums its products in another order
    for another thread count, and an iterative solver then stops at another point (the learned
    predictor's logistic weights differed between one and two threads, and so did a replay deciding
    with them). The controller that finds the pools is built once: building one costs far more than
    a limit set with it (``benchmarks/RESULTS.md``, "Stop 45: how precise an expert predictor must
    be")."""
    global _CONTROLLER
    if _CONTROLLER is None:
        import scipy.linalg.cython_blas  # noqa: F401  (loads scipy's BLAS, so that its pool is found too)
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=1, user_api="blas")
