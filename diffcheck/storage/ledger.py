"""The run ledger: every executed run, its identity and its verdict, in SQLite.

The ledger lives at ``<goldens root>/ledger.sqlite`` beside the goldens it
describes. One row per run that an engine actually executed (goldens and
candidate runs; forced and scored runs are derived from those and are not
rows). A row holds what produced the run and what came out of it:

- ``key``: the run's identity (`diffcheck.workspace.ledger_key` builds it): the case's resolved config digest,
  the code state (`code_state`: vLLM distribution version, and the git commit,
  dirty flag and diff digest of vLLM's source checkout and of every PYTHONPATH
  entry inside a git repository), the model digest and, for candidates, the
  content digests of the goldens they were replayed along. Two runs with one
  key are the same experiment: the workspace reuses the earlier one instead of
  running it again (the seed log's "do not repeat" list, kept by the machine).
- ``output_digest``: what was generated (`store.output_digest`: token ids and
  text). Equal digests across cases are the seed log's "same bad hash as E".
  ``content_digest`` (`store.content_digest`, which also covers logprobs and
  the case's identity) ties an entry to one stored file.
- ``verdict``: set after judging (`set_verdict`); cached verdicts are what make
  a repeated ``diffcheck bisect`` cost no engine runs.

Knows SQLite, git (through the ``git`` command) and importlib metadata. Knows
nothing about engines: it never imports vllm or torch, so looking a run up is
cheap enough to do before every engine start.
"""

from __future__ import annotations

import datetime
import json
import sqlite3
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffcheck.core.errors import DataError
from diffcheck.storage.identity import code_identity as _code_identity
from diffcheck.storage.identity import code_state, engine_distribution, git_state  # noqa: F401 (re-exported)
from diffcheck.core.types import Run, Verdict

FILENAME = "ledger.sqlite"
SCHEMA_VERSION = 1  # PRAGMA user_version; a newer file is refused, never rewritten

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL,
    case_id TEXT NOT NULL,
    suite TEXT NOT NULL,
    kind TEXT NOT NULL,
    role TEXT NOT NULL,
    config_digest TEXT NOT NULL,
    engine_version TEXT,
    engine_commit TEXT,
    engine_dirty INTEGER,
    code_state TEXT NOT NULL,
    model_digest TEXT,
    output_digest TEXT NOT NULL,
    content_digest TEXT NOT NULL,
    verdict TEXT,
    timings TEXT NOT NULL,
    created TEXT NOT NULL,
    path TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_key ON runs (key);
CREATE INDEX IF NOT EXISTS runs_output ON runs (output_digest);
CREATE INDEX IF NOT EXISTS runs_content ON runs (content_digest);
CREATE INDEX IF NOT EXISTS runs_case ON runs (case_id);
"""
_COLUMNS = ("id", "key", "case_id", "suite", "kind", "role", "config_digest", "engine_version", "engine_commit",
            "engine_dirty", "code_state", "model_digest", "output_digest", "content_digest", "verdict", "timings", "created", "path")


@dataclass(frozen=True)
class Entry:
    """One executed run as the ledger knows it."""

    key: str
    case_id: str
    suite: str
    output_digest: str
    verdict: Verdict | None
    created: str
    path: str
    content_digest: str = ""
    kind: str = "generate"
    role: str = "candidate"
    config_digest: str = ""
    engine_version: str | None = None
    engine_commit: str | None = None
    engine_dirty: bool | None = None
    model_digest: str | None = None
    code_state: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    id: int = 0

    @property
    def seconds(self) -> float:
        """Engine time of the run: start-up plus generation (what a reuse saves)."""
        return float(sum(v for k, v in self.timings.items() if k.endswith("_s") and "_per_" not in k))

    @property
    def code(self) -> str:
        """One-line code identity: engine version, then repo@commit for each git checkout."""
        parts = [str(self.code_state.get("engine", {}).get("version") or self.engine_version or "?")]
        for repo in self.code_state.get("repos", ()):
            name = Path(repo.get("path", "?")).name
            parts.append(f"{name}@{(repo.get('commit') or '?')[:10]}" + ("+dirty" if repo.get("dirty") else ""))
        return " ".join(parts)


# -- code identity -----------------------------------------------------------------------------
# git_state, engine_distribution, code_state and _code_identity come from
# diffcheck.storage.identity: one implementation, shared with the engine's run metadata.


def _digest(value: Any) -> str:
    import blake3

    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return blake3.blake3(text.encode()).hexdigest()


# -- the ledger --------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Ledger:
    """The SQLite ledger at ``<root>/ledger.sqlite``. Cheap to open; one connection per call."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def open(cls, root: str | Path) -> "Ledger":
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        ledger = cls(root / FILENAME)
        try:
            with closing(ledger._connect()) as con:
                version = con.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise DataError(f"{ledger.path}: ledger schema {version} is newer than this diffcheck's "
                                    f"({SCHEMA_VERSION}); upgrade diffcheck")
                with con:
                    con.executescript(_SCHEMA)
                    con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            raise DataError(f"{ledger.path}: not a usable ledger ({exc}); move it away to start a new one") from None
        return ledger

    def _connect(self) -> sqlite3.Connection:
        try:
            # A generous timeout: a bisect step and a compare may write at once.
            con = sqlite3.connect(self.path, timeout=60)
            con.execute("PRAGMA busy_timeout = 60000")
            return con
        except sqlite3.DatabaseError as exc:
            raise DataError(f"{self.path}: cannot open the ledger ({exc}); move it away to start a new one") from None

    def _query(self, sql: str, params: tuple = ()) -> list[Entry]:
        try:
            with closing(self._connect()) as con:
                rows = con.execute(f"SELECT {', '.join(_COLUMNS)} FROM runs {sql}", params).fetchall()
        except sqlite3.DatabaseError as exc:
            raise DataError(f"{self.path}: unreadable ledger ({exc}); move it away to start a new one") from None
        return [_entry(row) for row in rows]

    # -- writing --------------------------------------------------------------------------------
    def add(self, run: Run, *, path: str | Path, key: str, config_digest: str, state: dict[str, Any] | None = None,
            role: str | None = None) -> Entry:
        """Record a run that an engine actually executed; returns its entry.

        `key` is the run's identity (`diffcheck.workspace.ledger_key`), `state` the code state
        it was computed from (default: now)."""
        from diffcheck.storage import store

        state = state if state is not None else code_state()
        engine = run.meta.engine or {}
        version = engine.get("version") or state["engine"].get("version")
        commit = engine.get("commit") or next((r["commit"] for r in state["repos"] if r["source"] == "vllm"), None)
        dirty = engine.get("dirty")
        if dirty is None:
            dirty = any(r["dirty"] for r in state["repos"])
        values = {
            "key": key,
            "case_id": run.meta.case_id,
            "suite": run.meta.suite,
            "kind": run.meta.kind,
            "role": run.meta.role or role,
            "config_digest": config_digest,
            "engine_version": version,
            "engine_commit": commit,
            "engine_dirty": None if dirty is None else int(bool(dirty)),
            "code_state": json.dumps(state, sort_keys=True),
            "model_digest": (run.meta.model or {}).get("digest"),
            "output_digest": store.output_digest(run),
            "content_digest": store.content_digest(run),
            "verdict": None,
            "timings": json.dumps({k: float(v) for k, v in (run.meta.timings or {}).items()}, sort_keys=True),
            "created": run.meta.created or _now(),
            "path": str(path),
        }
        names = list(values)
        with closing(self._connect()) as con, con:
            cur = con.execute(f"INSERT INTO runs ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                              tuple(values[n] for n in names))
            row_id = cur.lastrowid
        return self._query("WHERE id = ?", (row_id,))[0]

    def set_verdict(self, run: Run | None, verdict: Verdict) -> Entry | None:
        """Set the verdict on the latest entry with `run`'s content digest and case id.

        Returns the updated entry, or None when the ledger has no such run (an
        engine failure leaves no run: ``run`` is None then).
        """
        from diffcheck.storage import store

        if run is None:
            return None
        digest = store.content_digest(run)
        hits = self._query("WHERE content_digest = ? AND case_id = ? ORDER BY id DESC LIMIT 1",
                           (digest, run.meta.case_id))
        if not hits:
            return None
        with closing(self._connect()) as con, con:
            con.execute("UPDATE runs SET verdict = ? WHERE id = ?", (verdict.name, hits[0].id))
        return self._query("WHERE id = ?", (hits[0].id,))[0]

    # -- reading --------------------------------------------------------------------------------
    def lookup(self, key: str) -> Entry | None:
        """The latest executed run with this key, or None."""
        hits = self._query("WHERE key = ? ORDER BY id DESC LIMIT 1", (key,))
        return hits[0] if hits else None

    def entries(self, *, case_id: str | None = None, suite: str | None = None) -> list[Entry]:
        """Every entry, oldest first, optionally for one case and/or suite."""
        where, params = [], []
        if case_id is not None:
            where.append("case_id = ?")
            params.append(case_id)
        if suite is not None:
            where.append("suite = ?")
            params.append(suite)
        clause = ("WHERE " + " AND ".join(where) + " ") if where else ""
        return self._query(clause + "ORDER BY id", tuple(params))

    def engine_runs(self, case_id: str | None = None) -> int:
        """How many runs an engine executed (every row is one), optionally for one case."""
        return len(self.entries(case_id=case_id))

    def same_output(self, output_digest: str, exclude_case: str | None = None) -> list[str]:
        """Case ids (sorted, once each) whose runs generated exactly this output (`store.output_digest`)."""
        hits = self._query("WHERE output_digest = ? ORDER BY id", (output_digest,))
        return sorted({e.case_id for e in hits if e.case_id != exclude_case})

    def groups(self, *, case_id: str | None = None, suite: str | None = None) -> list[list[Entry]]:
        """Entries grouped by identical output, largest group first, then by first appearance."""
        by_digest: dict[str, list[Entry]] = {}
        for entry in self.entries(case_id=case_id, suite=suite):
            by_digest.setdefault(entry.output_digest, []).append(entry)
        return sorted(by_digest.values(), key=lambda g: (-len(g), g[0].id))


def _entry(row: tuple) -> Entry:
    data = dict(zip(_COLUMNS, row))
    verdict = data["verdict"]
    return Entry(
        id=data["id"],
        key=data["key"],
        case_id=data["case_id"],
        suite=data["suite"],
        kind=data["kind"],
        role=data["role"],
        config_digest=data["config_digest"],
        engine_version=data["engine_version"],
        engine_commit=data["engine_commit"],
        engine_dirty=None if data["engine_dirty"] is None else bool(data["engine_dirty"]),
        code_state=json.loads(data["code_state"] or "{}"),
        model_digest=data["model_digest"],
        output_digest=data["output_digest"],
        content_digest=data["content_digest"],
        verdict=Verdict[verdict] if verdict in Verdict.__members__ else None,
        timings=json.loads(data["timings"] or "{}"),
        created=data["created"],
        path=data["path"],
    )
