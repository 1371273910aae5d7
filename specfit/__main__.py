"""The ``specfit`` command's entry point (``python -m specfit`` and the installed script)."""

import sys


def main() -> None:
    """Run the command line. Importing it (torch, numba's kernels, every command) takes a few
    tenths of a second; a Ctrl-C then ends in one line with status 130, not a traceback (once it
    runs, the commands' own handling says what was kept)."""
    try:
        from .cli import app
    except KeyboardInterrupt:
        sys.stderr.write("specfit: interrupted while starting; nothing was run\n")
        sys.exit(130)
    app()


if __name__ == "__main__":
    main()
