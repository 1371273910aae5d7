"""Test-wide settings: nothing a test runs may write into the user's home."""

import os
import signal

import pytest


@pytest.fixture(scope="session", autouse=True)
def user_cache_in_tmp(tmp_path_factory):
    """``specfit decode`` keeps the quick calibrations it makes in the user's cache (and matplotlib
    its font list): one cache for the session, outside every test's own directory."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("user-cache"))
    yield
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance of 2 CPUs for one test module (skips without Ray). Ray's driver keeps
    its SIGTERM handler (exit 15) after its shutdown: the modules after this one get back the
    handler before it, as a command's own process has (a kill is its stop, status 143)."""
    ray = pytest.importorskip("ray")
    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
    signal.signal(signal.SIGTERM, sigterm)
