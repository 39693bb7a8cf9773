"""Engine processes die with the process that started them.

vLLM's engine-core process does not watch its parent: a diffcheck ended by SIGKILL (the OOM
killer, a CI runner's timeout, ``kill -9``) left its engine core and worker running, reparented to
init and holding their memory (on a GPU, the device). So diffcheck names itself in the
environment of the engines it starts (`owner_env`), and diffcheck's vLLM plugin, which vLLM loads
in every process it starts, calls `bind_to_parent` there: Linux then SIGKILLs that process when
its parent ends (``PR_SET_PDEATHSIG``). A worker whose parent is the engine core goes with the
engine core the same way.

Linux sends that signal when the *thread* that started the process ends, so an engine must be
opened from a thread that outlives it (diffcheck opens them from its main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

OWNER_ENV = "DIFFCHECK_ENGINE_OWNER"
_PR_SET_PDEATHSIG = 1


def owner_env() -> dict[str, str]:
    """The environment entry that makes the engine processes started now die with this one."""
    return {OWNER_ENV: str(os.getpid())}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: alive, another user's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def bind_to_parent() -> bool:
    """In a process started for an owner (not the owner itself): die when the parent does. True if bound."""
    owner = os.environ.get(OWNER_ENV, "")
    if not owner.isdigit() or int(owner) == os.getpid() or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_PDEATHSIG) failed in pid {os.getpid()}")
    if os.getppid() == 1 or not _alive(int(owner)):  # the owner ended before the signal was set up
        os.kill(os.getpid(), signal.SIGKILL)
    return True
