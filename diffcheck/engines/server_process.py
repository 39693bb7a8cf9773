"""A ``vllm serve`` that diffcheck starts, from diffcheck's side: its flags, its port, its start and its stop.

- `serve_args`: the case's engine table as ``vllm serve`` flags (the offline engine's
  mapping, `vllm_args.llm_kwargs`, one flag per argument).
- `ServerProcess`: one server under its supervisor (`vllm_serve`), in its own process
  group and session. Stopping is SIGTERM to the group, SIGKILL after a grace period;
  a process still there after that is reported in one warning line that names it,
  never left silently. The supervisor holds the read end of a pipe whose write end
  only diffcheck holds: however diffcheck ends, the pipe closes and the supervisor
  stops the group itself.
- `stop_all`: every live server, from ``atexit`` and from SIGTERM/SIGHUP handlers,
  installed before the first server starts (a signal inherited as ignored stays
  ignored). A handler stops the servers, then ends the process as the signal would
  have; Ctrl-C unwinds through the engine's ``close()``.
- `wait_healthy`: poll ``/health`` until it answers, the server exits, or the deadline.
- The port: `free_port` binds port 0 and releases it, so another process can take the
  port before ``vllm serve`` binds it. `bind_failed` recognizes that ending (the
  server's log says "Address already in use"; without a log, the port is held by a
  listener now), and the engine starts the server again on a new port, at most
  `PORT_ATTEMPTS` times.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path
from typing import Any

from diffcheck.engines.base import warn

STOP_GRACE_S = 15.0  # SIGTERM -> SIGKILL
KILL_WAIT_S = 10.0  # how long SIGKILL is repeated while processes of the group are left
PORT_ATTEMPTS = 3  # starts of vllm serve, each on a new port, when another process took the port
_BIND_FAILED = re.compile(r"\[Errno 98\]|Address already in use|EADDRINUSE", re.IGNORECASE)


def serve_args(engine_cfg: dict[str, Any], model_path: str, *, on_cpu: bool) -> tuple[list[str], dict[str, str]]:
    """The case's engine table as ``vllm serve MODEL --flag value ...`` arguments and environment.

    The mapping is the offline engine's (`vllm_args.llm_kwargs`); each keyword becomes
    its flag: True -> ``--key``, False -> ``--no-key``, a table -> JSON, a list -> values.
    """
    from diffcheck.engines.vllm_args import llm_kwargs

    kw, env = llm_kwargs(engine_cfg, model_path, on_cpu=on_cpu)
    args = ["serve", str(kw.pop("model"))]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            args += [flag, *(str(v) for v in value)]
        else:
            args += [flag, str(value)]
    return args, env


def free_port() -> int:
    """A port free on 127.0.0.1 now (nothing holds it for the server: see `bind_failed`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_failed(port: int, log_text: str) -> bool:
    """Whether a server that exited before it was healthy lost `port` to another process: its log
    says so, or, where there is no log (``--verbose``), a listener holds the port now."""
    if log_text.strip():
        return bool(_BIND_FAILED.search(log_text))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT left by /health polls is no holder
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def status(code: int) -> str:
    """How a process ended, from its exit status (the supervisor reports a signal as 128 + N)."""
    sig = -code if code < 0 else code - 128 if code > 128 else None
    if sig is not None:
        try:
            return f"on {signal.Signals(sig).name}"
        except ValueError:
            pass
    return f"with code {code}"


class ServerProcess:
    """One ``vllm serve`` under its supervisor (`vllm_serve`), in its own process group."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path | None):
        _install_handlers()  # before the server exists: a SIGTERM from here on stops it
        read_end, self._write_end = os.pipe()
        try:
            out = open(log_path, "ab") if log_path is not None else None
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "diffcheck.engines.vllm_serve", "--parent-fd", str(read_end),
                     "--grace", str(STOP_GRACE_S), "--", *args],
                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if out else None,
                    start_new_session=True, pass_fds=(read_end,), close_fds=True)
            finally:
                if out is not None:
                    out.close()
            self.pgid = self.proc.pid  # a new session: the supervisor leads its group
            _LIVE.add(self)
        except BaseException:
            # Whatever started reads end-of-file on its pipe now and stops its group.
            os.close(self._write_end)
            self._write_end = None
            raise
        finally:
            os.close(read_end)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status once the supervisor has ended, waiting up to `timeout` seconds; None if it still runs."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after the grace period, until no process of it is left.

        A process of the group that is still there after `KILL_WAIT_S` of SIGKILLs is reported
        in one warning line naming it (a process diffcheck could not end is never silent).
        """
        from diffcheck.engines.vllm_serve import group_members

        try:
            if self.proc.poll() is None:
                _killpg(self.pgid, signal.SIGTERM)
                self.wait_exit(STOP_GRACE_S + 10)
            deadline = time.monotonic() + KILL_WAIT_S
            while group_members(self.pgid) and time.monotonic() < deadline:
                _killpg(self.pgid, signal.SIGKILL)
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            left = group_members(self.pgid)
            if left:
                warn(f"vllm serve (supervisor pid {self.proc.pid}) left processes running after SIGKILL: "
                     f"pid {', '.join(map(str, left))}")
        finally:
            if self._write_end is not None:
                os.close(self._write_end)
                self._write_end = None
            _LIVE.discard(self)


def wait_healthy(server: ServerProcess, url: str, opener, deadline: float) -> int | None:
    """Poll ``url/health`` until it answers 200 (None) or the server exits (its exit status);
    `TimeoutError` once ``time.monotonic()`` passes `deadline`."""
    while True:
        code = server.returncode
        if code is not None:
            return code
        try:
            with opener.open(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return None
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(url)
        time.sleep(0.5)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # gone, or not ours to signal: `stop` reports what is left
        pass


_LIVE: set[ServerProcess] = set()
_HANDLERS_LOCK = threading.Lock()
_HANDLED: dict[int, Any] = {}
_INSTALLED: set[str] = set()


def stop_all() -> None:
    """Stop every server this process started (atexit, signal handlers); one that cannot be stopped is
    reported in one line and the others are still stopped."""
    for server in list(_LIVE):
        try:
            server.stop()
        except OSError as exc:
            warn(f"could not stop vllm serve (supervisor pid {server.proc.pid}): {type(exc).__name__}: {exc}")


def _on_signal(signum, frame):
    stop_all()
    previous = _HANDLED.get(signum)
    if callable(previous):
        previous(signum, frame)
        # It returned; the servers are gone, so the run cannot go on: end as the signal asks.
        raise SystemExit(128 + signum)
    signal.signal(signum, signal.SIG_DFL)  # end the way the signal would have ended us
    os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    """atexit and SIGTERM/SIGHUP (main thread only) stop live servers; Ctrl-C unwinds through close().
    A signal inherited as ignored (``nohup``'s SIGHUP) stays ignored."""
    with _HANDLERS_LOCK:
        if "atexit" not in _INSTALLED:
            _INSTALLED.add("atexit")
            atexit.register(stop_all)
        if "signals" in _INSTALLED or threading.current_thread() is not threading.main_thread():
            return
        _INSTALLED.add("signals")
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) != signal.SIG_IGN:
                _HANDLED[sig] = signal.signal(sig, _on_signal)
