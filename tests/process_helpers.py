"""Helpers for tests that run the CLI in a child process and signal it."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """``preexec_fn`` of a child that must stop on SIGINT: a background job of a shell (CI,
    ``nohup ... &``) starts with SIGINT ignored, and so would the child; Python turns SIGINT into
    KeyboardInterrupt only when it starts with the default action."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
