"""Errors caused by what the user gave us (a recipe, a path, a flag).

The CLI prints these as one line, `error: ...`, and exits with status 2 before anything
is written. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message names what is wrong and where."""
