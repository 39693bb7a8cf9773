"""One error root with an exit code.

`DiffcheckError` and its subclasses are *user* errors: the CLI prints them as one
line, ``diffcheck: error: ...``, and exits with ``exit_code``. Anything else that
escapes is an internal bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_PASS = 0
EXIT_REGRESSION = 1
EXIT_USAGE = 2
EXIT_ENGINE = 3
EXIT_INCONCLUSIVE = 4  # the evidence could not decide pass or fail (`diffcheck.core.types`)
EXIT_BISECT_SKIP = 125


class DiffcheckError(Exception):
    """A user-facing error: bad input, bad config, bad data."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigError(DiffcheckError, ValueError):
    """A case file, prompt file or option is wrong. Names file, field, valid values."""


class DataError(DiffcheckError):
    """A stored run or golden is missing, corrupt, foreign or from a newer schema."""


class LockedError(DataError):
    """Another writer holds the lock on this golden."""


class EngineError(DiffcheckError, RuntimeError):
    """The engine failed to start or crashed. Carries the root-cause line."""

    exit_code = EXIT_ENGINE
