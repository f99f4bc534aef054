"""Errors caused by what the user gave us (a recipe, a path, a flag).

The CLI prints these as one line, `error: ...`, and exits with status 2 before anything
is written. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message names what is wrong and where."""


class FrugalityWarning(UserWarning):
    """Something the user should know that does not stop the run (a cache entry skipped, a
    graph running eagerly, a recompilation). The CLI prints these as `warning: ...`."""


class RunDiverged(Exception):
    """Training produced non-finite values beyond what `train.on_nonfinite` allows. The CLI
    prints one `error: ...` line and exits with status 3 (`DIVERGED_EXIT`); the run's last
    checkpoint stays the one to resume from."""


DIVERGED_EXIT = 3
