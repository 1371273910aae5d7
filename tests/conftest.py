"""Test-wide settings: nothing a test runs may write into the user's home."""

import os

import pytest


@pytest.fixture(autouse=True)
def user_cache_in_tmp(tmp_path, monkeypatch):
    """``specfit decode`` keeps the quick calibrations it makes in the user's cache: each test gets its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    yield
    assert "XDG_CACHE_HOME" in os.environ
