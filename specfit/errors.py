"""The one exception type for bad user input: the CLI prints its message as one line, no traceback."""


class SpecFitError(ValueError):
    """Bad input: a message naming the file, the field and what was expected."""
