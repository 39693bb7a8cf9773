"""Progress you can see: what diffcheck is doing, while it does it.

One `Reporter` is current at a time (a context variable). The pipeline asks it for what it
shows and for callbacks that it hands to engines (``engine.generate(progress=...)``);
library callers get the silent default, the CLI installs a `Display` (`display`). Three
levels, each optional:

- the **stage**: where a command is in its own plan ("case 2 of 5: J", "step 3 of about 4");
- the **activity**: what runs now ("J: engine start: loading weights"), with its elapsed time;
- a **task**: countable work (tokens generated, replayed, scored) with a bar, tokens/s and ETA.

How it is shown:

- on a terminal (stdout and the display stream both TTYs, ``TERM`` not ``dumb``, not
  ``--verbose``): a live rich display, redrawn four times a second, so the elapsed times
  move every second and there is never a silence;
- anywhere else (CI logs, pipes, files): plain lines, no carriage returns and no cursor
  codes, a progress line at most every `PLAIN_INTERVAL_S` seconds and only when something
  changed; `log` lines (the commands' own messages) as they come.

The display writes to a duplicate of the terminal's file descriptor taken when it starts:
the engine's output capture (fd 1 and 2 sent to the engine log while vLLM runs) cannot
swallow it, and it keeps moving while the engine works.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from typing import Callable, Iterator

PLAIN_INTERVAL_S = 10.0
LIVE_REFRESH_PER_S = 4

TaskCallback = Callable[[int, "int | None"], None]


def fmt_seconds(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Reporter:
    """The silent reporter (libraries, tests): accepts everything, shows nothing."""

    live = False

    def log(self, message: str) -> None:
        """A permanent line (what ``echo`` printed before); also becomes the current activity."""

    def stage(self, text: str | None) -> None:
        """Where the command is in its plan; None clears it."""

    def activity(self, text: str) -> None:
        """What runs now (its elapsed time starts); ends the current task."""

    def task(self, label: str, *, unit: str = "tok") -> TaskCallback:
        """Start countable work; returns the callback ``(done, total)`` for an engine's ``progress=``."""
        return lambda done, total=None: None


_NULL = Reporter()
_current: contextvars.ContextVar[Reporter] = contextvars.ContextVar("diffcheck_progress", default=_NULL)


def current() -> Reporter:
    return _current.get()


def log(message: str) -> None:
    current().log(message)


def stage(text: str | None) -> None:
    current().stage(text)


def activity(text: str) -> None:
    current().activity(text)


def task(label: str, *, unit: str = "tok") -> TaskCallback:
    return current().task(label, unit=unit)


@contextlib.contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """Make `reporter` current inside the block."""
    token = _current.set(reporter)
    try:
        yield reporter
    finally:
        _current.reset(token)


class _Task:
    def __init__(self, label: str, unit: str, now: float):
        self.label, self.unit, self.start = label, unit, now
        self.done, self.total = 0, None

    def rate(self, now: float) -> float:
        elapsed = now - self.start
        return self.done / elapsed if elapsed > 0 and self.done else 0.0

    def describe(self, now: float) -> str:
        return f"{self.label}: {self.numbers(now)}"

    def numbers(self, now: float) -> str:
        rate = self.rate(now)
        parts = [f"{self.done}" + (f"/{self.total}" if self.total else "") + f" {self.unit}"]
        if rate:
            parts.append(f"{rate:.1f} {self.unit}/s")
            if self.total and self.total > self.done:
                parts.append(f"ETA {fmt_seconds((self.total - self.done) / rate)}")
        parts.append(fmt_seconds(now - self.start))
        return ", ".join(parts)


class Display(Reporter):
    """Live on a terminal, plain throttled lines elsewhere (see the module docstring).

    ``stream``: a file object to write to (default: a duplicate of stderr's descriptor).
    ``live``: force the mode (default: decided from the streams); ``clock``: for tests.
    """

    def __init__(self, *, stream=None, live: bool | None = None, verbose: bool = False,
                 interval: float = PLAIN_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self._own_stream = False
        if stream is None:
            try:
                stream = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1, encoding="utf-8",
                                   errors="replace")
                self._own_stream = True
            except (AttributeError, OSError, ValueError):  # no descriptor (pytest's capsys): write to it as it is
                stream = sys.stderr
        self.stream = stream
        if live is None:
            live = (not verbose and _isatty(stream) and _isatty(sys.stdout)
                    and os.environ.get("TERM", "") != "dumb")
        self.live = live
        self.interval = interval
        self.clock = clock
        self.t0 = clock()
        self._lock = threading.RLock()
        self._stage: str | None = None
        self._activity: str | None = None
        self._activity_t0 = self.t0
        self._task: _Task | None = None
        self._changed = False
        self._last_line = float("-inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live = None
        self._spinner = None

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> "Display":
        if self.live:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream, force_terminal=True, log_path=False)
            self._live = Live(self, console=console, refresh_per_second=LIVE_REFRESH_PER_S, transient=True,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        else:
            self._thread = threading.Thread(target=self._plain_loop, name="diffcheck-progress", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with contextlib.suppress(OSError, ValueError):  # a closed stream (ValueError) or a broken pipe
            self.stream.flush()
        if self._own_stream:
            with contextlib.suppress(OSError, ValueError):
                self.stream.close()

    def __enter__(self) -> "Display":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what the pipeline reports ------------------------------------------------------------------
    def log(self, message: str) -> None:
        with self._lock:
            if self._live is not None:
                self._live.console.print(message, markup=False, highlight=False)
            else:
                self._write(message)
            self._activity, self._activity_t0, self._task = message, self.clock(), None

    def stage(self, text: str | None) -> None:
        with self._lock:
            if text != self._stage:
                self._stage, self._changed = text, True

    def activity(self, text: str) -> None:
        with self._lock:
            if text != self._activity or self._task is not None:
                self._activity, self._activity_t0, self._task, self._changed = text, self.clock(), None, True

    def task(self, label: str, *, unit: str = "tok") -> TaskCallback:
        t = _Task(label, unit, self.clock())
        with self._lock:
            self._task, self._changed = t, True

        def update(done: int, total: int | None = None) -> None:
            with self._lock:
                t.done, t.total = int(done), (int(total) if total is not None else t.total)
                self._changed = True

        return update

    # -- rendering -----------------------------------------------------------------------------
    def lines(self) -> list[str]:
        """What is shown now, one string per level (stage, activity with its elapsed time, task)."""
        now = self.clock()
        with self._lock:
            out = []
            if self._stage:
                out.append(self._stage)
            if self._activity:
                out.append(f"{self._activity} ({fmt_seconds(now - self._activity_t0)})")
            if self._task is not None:
                out.append(self._task.describe(now))
            return out

    def __rich__(self):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.spinner import Spinner
        from rich.table import Table
        from rich.text import Text

        now = self.clock()
        with self._lock:
            rows = []
            if self._stage:
                rows.append(Text(f"{self._stage}  {fmt_seconds(now - self.t0)}", style="bold"))
            if self._activity:
                text = Text(f"{self._activity}  {fmt_seconds(now - self._activity_t0)}")
                if self._spinner is None:  # one spinner for the display's life: its frames turn with time
                    self._spinner = Spinner("dots", text)
                self._spinner.update(text=text)
                rows.append(self._spinner)
            t = self._task
            if t is not None:
                grid = Table.grid(padding=(0, 1))
                grid.add_row(Text(f"  {t.label}"),
                             ProgressBar(total=t.total or None, completed=t.done, width=30),
                             Text(t.numbers(now)))
                rows.append(grid)
            return Group(*rows)

    # -- plain mode ------------------------------------------------------------------------------
    def _write(self, line: str) -> None:
        try:
            self.stream.write(line.replace("\r", " ") + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def _plain_loop(self) -> None:
        while not self._stop.wait(0.5):
            self.tick()

    def tick(self) -> None:
        """Plain mode: print the progress line if something changed and the interval has passed."""
        now = self.clock()
        with self._lock:
            if not self._changed or now - self._last_line < self.interval:
                return
            text = " | ".join(self.lines())
            self._changed, self._last_line = False, now
        if text:
            self._write(f"[{fmt_seconds(now - self.t0):>6}] {text}")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


@contextlib.contextmanager
def display(*, verbose: bool = False, stream=None, live: bool | None = None) -> Iterator[Display]:
    """Show progress for the block (the CLI's commands): a `Display`, made current."""
    d = Display(stream=stream, live=live, verbose=verbose)
    with d, reporting(d):
        yield d
