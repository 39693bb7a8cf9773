"""The engine's own output: captured into a log file, and read back for one root-cause line.

vLLM and the processes it spawns write to file descriptors 1 and 2; unless
``verbose``, diffcheck sends both to a per-engine log file and, when something
fails, reports the most specific error line from that log (exit 3 with one line
that points to the log).

The log files of one diffcheck process live in one private directory
(`private_log_dir`: ``tempfile.mkdtemp``, mode 0700, a name nobody can know
beforehand, so no other local user can read the logs or plant a file or link at a
log's path). The directory is kept after the run on purpose: every error line names
the log in it, and a run that passed may still be worth reading (``rm -r`` it when
done).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path

_ROOT_CAUSE = re.compile(r"(?:^|[\s.])(\w*(?:Error|Exception|Exit)): (.+)$")
# Wrappers that only point elsewhere ("see above"): never the root cause.
_NOISE = ("Engine core initialization failed", "See root cause above", "EngineCore failed to start",
          "EngineCore encountered", "See stack trace", "Worker failed with error", "Traceback")


_PRIVATE: dict[tuple[int, str], Path] = {}


def private_log_dir(base: Path | str | None = None) -> Path:
    """This process's private log directory under `base` (default: the temp directory, ``$TMPDIR``),
    made on first use by ``tempfile.mkdtemp`` (mode 0700) and kept after the run."""
    base = Path(base or tempfile.gettempdir())
    key = (os.getpid(), str(base))  # a forked child makes its own
    folder = _PRIVATE.get(key)
    if folder is None or not folder.is_dir():
        base.mkdir(parents=True, exist_ok=True)
        folder = _PRIVATE[key] = Path(tempfile.mkdtemp(prefix="diffcheck-logs-", dir=base))
    return folder


@contextlib.contextmanager
def captured_output(log_path: Path | None):
    """Send fd 1/2 (ours and the engine processes' we spawn) to a log file."""
    if log_path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def read_log(log_path: Path | None) -> str:
    """The engine log so far, or "" when there is none (verbose: output went to the terminal)."""
    return log_path.read_text(errors="replace") if log_path and log_path.exists() else ""


def root_cause(exc: BaseException, log_text: str = "") -> str:
    """The most specific error line: the engine log's first real error, else the exception chain."""
    # The first error line in the engine log is the innermost one: the worker's or
    # engine core's own exception, before the layers that re-raise it.
    for line in log_text.splitlines():
        m = _ROOT_CAUSE.search(line.strip())
        if m and not any(n in line for n in _NOISE):
            return f"{m.group(1)}: {m.group(2)}"
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic: the first line only names the config class
        with contextlib.suppress(TypeError, LookupError, AttributeError):  # not pydantic's shape after all
            msg = errors()[0]["msg"].removeprefix("Value error, ")
            return f"{type(exc).__name__}: {msg.splitlines()[0]}"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
