"""Run a command on a pseudo-terminal, as a user's shell would, and read what it showed and when.

`run_in_pty` gives the command a pty for stdin, stdout and stderr (120 columns), reads
the master side until the command exits, and keeps every chunk with its arrival time.
`updates` turns the chunks into the moments the *visible* text changed: escape codes
and carriage returns are dropped, and a chunk counts only when what it shows differs
from the chunk before (a redraw of the same frame is no update). `gaps` are the
seconds between consecutive updates.

A command still running at `timeout` is sent SIGABRT first: with ``PYTHONFAULTHANDLER``
set (always, here), Python writes every thread's stack to the pty before it dies, so a
hang shows where it hung in the test's failure text; SIGKILL follows after 10 s.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]")


def run_in_pty(cmd: list[str], *, env: dict | None = None, cwd=None, timeout: float = 600,
               cols: int = 120) -> tuple[int, list[tuple[float, bytes]]]:
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, cols, 0, 0))
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, close_fds=True,
                            start_new_session=True)
    os.close(slave)
    chunks: list[tuple[float, bytes]] = []
    t0 = time.monotonic()
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the last writer closed the pty
                    break
                if not data:
                    break
                chunks.append((time.monotonic() - t0, data))
            elif proc.poll() is not None:
                break
            if time.monotonic() - t0 > timeout:
                chunks += _stacks_of_hung(proc, master)
                break
    finally:
        rc = proc.wait()
        os.close(master)
    return rc, chunks


def _stacks_of_hung(proc: subprocess.Popen, master: int) -> list[tuple[float, bytes]]:
    """SIGABRT (faulthandler's stack dump), what the pty shows for up to 10 s, then SIGKILL."""
    got: list[tuple[float, bytes]] = [(0.0, b"\n[run_in_pty: timed out; SIGABRT for the stacks]\n")]
    proc.send_signal(signal.SIGABRT)
    end = time.monotonic() + 10
    while time.monotonic() < end and proc.poll() is None:
        if select.select([master], [], [], 0.2)[0]:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            got.append((0.0, data))
    proc.kill()
    return got


def visible(data: bytes) -> str:
    return ANSI.sub(b"", data).replace(b"\r", b"").decode("utf-8", errors="replace")


def updates(chunks: list[tuple[float, bytes]]) -> list[tuple[float, str]]:
    out, previous = [], None
    for t, data in chunks:
        text = visible(data).strip()
        if text and text != previous:
            out.append((t, text))
            previous = text
    return out


def gaps(moments: list[tuple[float, str]]) -> list[float]:
    return [b[0] - a[0] for a, b in zip(moments, moments[1:])]


def text_of(chunks: list[tuple[float, bytes]]) -> str:
    return visible(b"".join(d for _, d in chunks))
