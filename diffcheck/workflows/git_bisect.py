"""Driving ``git bisect`` in a repository that must be left exactly as it was found.

`check_repo` refuses what cannot be bisected safely (not the top folder, a bisect
already in progress, uncommitted changes, unknown or reversed revisions); `restore`
ends any bisect and puts branch (or detached HEAD), HEAD and tracked files back;
`Interrupts` turns SIGINT, SIGTERM and SIGHUP into one KeyboardInterrupt and then
holds them off, so the restore in a ``finally`` cannot be cut short; `stop_group`
ends ``git bisect run`` and everything under it; `parse_bisect_log` reads the answer.

Ctrl-C works however the process was started: a shell without job control starts a
background command (``diffcheck bisect ... &`` in a script, a CI runner) with SIGINT
ignored, and Python then installs no KeyboardInterrupt handler, so `Interrupts`
installs its own. An inherited SIGHUP ignore (``nohup``) is kept.

Knows the ``git`` command; nothing about cases, engines or verdicts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from diffcheck.core.errors import DiffcheckError

_STOP_GRACE_S = 20


@dataclass(frozen=True)
class RepoState:
    branch: str | None  # None: detached HEAD
    head: str
    porcelain: tuple[str, ...]  # `git status --porcelain` lines

    def describe(self) -> str:
        return f"{self.branch or 'detached HEAD'} at {self.head[:10]}"



def git(repo: str | Path, *args: str, check: bool = True) -> str:
    res = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        last = (res.stderr.strip().splitlines() or [res.stdout.strip() or "no output"])[-1]
        raise DiffcheckError(f"{repo}: git {' '.join(args)} failed: {last}")
    return res.stdout.strip()


def repo_state(repo: str | Path) -> RepoState:
    branch = git(repo, "symbolic-ref", "-q", "--short", "HEAD", check=False) or None
    porcelain = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True,
                               text=True).stdout.splitlines()
    return RepoState(branch=branch, head=git(repo, "rev-parse", "HEAD"), porcelain=tuple(porcelain))


def bisect_in_progress(repo: str | Path) -> bool:
    path = Path(git(repo, "rev-parse", "--git-path", "BISECT_START"))
    return (path if path.is_absolute() else Path(repo) / path).exists()


def check_repo(repo: str | Path, good: str, bad: str) -> tuple[str, str, int]:
    """Refuse a repository that cannot be bisected safely; returns (good sha, bad sha, commits in range)."""
    top = subprocess.run(["git", "-C", str(repo), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0:
        raise DiffcheckError(f"--repo {repo}: not a git repository")
    if Path(top.stdout.strip()).resolve() != Path(repo).resolve():
        raise DiffcheckError(f"--repo {repo}: give the repository's top folder ({top.stdout.strip()})")
    if bisect_in_progress(repo):
        raise DiffcheckError(f"--repo {repo}: a git bisect is already in progress; end it with "
                             f"`git -C {repo} bisect reset` first")
    dirty = git(repo, "status", "--porcelain", "--untracked-files=no")
    if dirty:
        raise DiffcheckError(f"--repo {repo}: the work tree has uncommitted changes "
                             f"({dirty.splitlines()[0].strip()}, ...); commit or stash them first")
    shas = []
    for option, rev in (("--good", good), ("--bad", bad)):
        sha = git(repo, "rev-parse", "--verify", "-q", f"{rev}^{{commit}}", check=False)
        if not sha:
            raise DiffcheckError(f"{option} {rev}: no such commit in {repo}")
        shas.append(sha)
    good_sha, bad_sha = shas
    if good_sha == bad_sha:
        raise DiffcheckError(f"--good {good} and --bad {bad} are the same commit ({good_sha[:10]})")
    if subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", good_sha, bad_sha]).returncode != 0:
        raise DiffcheckError(f"--good {good} ({good_sha[:10]}) is not an ancestor of --bad {bad} ({bad_sha[:10]})")
    return good_sha, bad_sha, int(git(repo, "rev-list", "--count", f"{good_sha}..{bad_sha}"))


def restore(repo: str | Path, original: RepoState) -> tuple[RepoState, tuple[str, ...]]:
    """End any bisect and put branch, HEAD and tracked files back; returns (state, new porcelain lines).

    Tracked changes at this point are the bisect's own (a dirty tree was refused
    at the start), so they are reset. Untracked files a build left are reported,
    never deleted: they may be caches the user wants to keep.
    """
    if git(repo, "status", "--porcelain", "--untracked-files=no", check=False):
        git(repo, "reset", "--hard", "-q", check=False)
    if bisect_in_progress(repo):
        git(repo, "bisect", "reset", check=False)
    now = repo_state(repo)
    if (now.branch, now.head) != (original.branch, original.head):
        target = [original.branch] if original.branch else ["--detach", original.head]
        git(repo, "checkout", "-q", *target, check=False)
        now = repo_state(repo)
    if (now.branch, now.head) != (original.branch, original.head):
        where = original.branch or original.head
        raise DiffcheckError(f"{repo}: could not restore {original.describe()} (now {now.describe()}); "
                             f"run `git -C {repo} checkout {where}`")
    left = tuple(line for line in now.porcelain if line not in set(original.porcelain))
    return now, left


class Interrupts:
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt, once; then no signal may cut the cleanup short.

    - The handler is installed for SIGINT even where SIGINT was inherited
      ignored (see the module docstring); SIGHUP keeps an inherited ignore.
    - The first signal switches all three to SIG_IGN before it raises, and
      `hold` does the same on the normal path, so a second Ctrl-C landing in
      the ``finally`` cannot skip the restore. Commands the restore runs
      inherit the ignore: a Ctrl-C sent to the terminal's process group does
      not kill a ``git reset`` half-way either.
    - `deferred` covers starting ``git bisect run``: a signal then is kept and
      raised once the Popen object is known, so the child it started is
      always stopped (a KeyboardInterrupt inside Popen would leave it running).
    """

    def __init__(self) -> None:
        self.previous: dict[int, object] = {}
        self.deferring = False
        self.pending: int | None = None

    def __enter__(self) -> "Interrupts":
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            current = signal.getsignal(s)
            self.previous[s] = current
            if not (s == signal.SIGHUP and current == signal.SIG_IGN):
                signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def _handler(self, signum, frame) -> None:
        if self.deferring:
            self.pending = signum
            return
        self.hold()
        raise KeyboardInterrupt(f"signal {signum}")

    def hold(self) -> None:
        """From here on the three signals are ignored (until `__exit__`)."""
        for s in self.previous:
            signal.signal(s, signal.SIG_IGN)

    @contextmanager
    def deferred(self):
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.pending is not None:
            self._handler(self.pending, None)


def stop_group(proc: subprocess.Popen) -> None:
    """End git bisect run and everything under it (step, compare, engine processes): its own process group."""
    for sig, wait in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue



_FIRST_BAD = re.compile(r"^# first bad commit: \[([0-9a-f]{40})\]")
_POSSIBLE = re.compile(r"^# possible first bad commit: \[([0-9a-f]{40})\]")


def parse_bisect_log(text: str) -> tuple[str | None, tuple[str, ...]]:
    """(first bad commit, or None; the possible first bad commits when only skipped ones were left)."""
    first = next((m.group(1) for m in map(_FIRST_BAD.match, text.splitlines()) if m), None)
    possible = tuple(m.group(1) for m in map(_POSSIBLE.match, text.splitlines()) if m)
    return first, possible

