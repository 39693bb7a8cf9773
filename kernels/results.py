"""Kernel-check results: rows, JSON, the stored Parquet file, and comparison.

Knows the result schema, how to write and verify it, and when a new run is
worse than a stored one. Knows nothing about how the numbers were produced.

One row per case. ``builder`` says which metadata builder fed a graph replay
("-" for eager rows); rows of the broken builders aggregate a whole replay
sequence and carry a verdict of CAUGHT or MISSED instead of PASS or FAIL.

Stored results live at ``<dir>/<device>.parquet``. The file's key-value
metadata holds the schema version, the suite's environment, the kernels that
were skipped and why, and a blake3 digest of the canonical JSON of all of
that plus the rows; reading recomputes the digest and refuses a file that
does not match. That in-file digest is the integrity check here, not a folder
manifest (`diffcheck.storage.manifest`'s docstring says why); both files are
written with that module's atomic write. JSON and the dataclasses need only the
standard library, so ``python -m kernels --json`` works where pyarrow and blake3
are missing; pyarrow and blake3 are imported only by the Parquet functions.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1
META_SCHEMA = b"diffcheck.kernels.schema"
META_DIGEST = b"diffcheck.kernels.blake3"
META_HEADER = b"diffcheck.kernels.header"

PASS, FAIL, CAUGHT, MISSED = "PASS", "FAIL", "CAUGHT", "MISSED"
# The deliberately broken metadata builders every graph-capable kernel is checked with.
BROKEN_BUILDERS = ("skip-refresh", "stale-tails")
# More broken builders some kernels are checked with: the seq-lens-copy fault on vLLM's own builders.
KERNEL_BROKEN_BUILDERS = {"vllm-triton-unified": ("seq-lens-copy",), "vllm-fa3": ("seq-lens-copy",)}
# A later run regresses when a statistic exceeds FACTOR x stored + FLOOR x atol.
# The floor keeps a stored exact zero (a one-token context) from flagging a
# one-ulp change; it is a quarter of the tolerance's absolute part, so an error
# that quietly grows toward the tolerance (say fp32 math slipping to TF32) is
# flagged long before the tolerance itself would fail the case.
REGRESSION_FACTOR = 2.0
REGRESSION_FLOOR = 0.25


@dataclass(frozen=True)
class CaseResult:
    case_id: str
    kernel: str
    mode: str  # "eager" | "graph"
    builder: str  # "-" (eager) | "refresh" | "skip-refresh" | "stale-tails"
    dtype: str
    shape: str  # e.g. "h9kv3d64"
    block_size: int
    batch: str
    seq_lens: str  # comma-separated, of the batch (or of the replay sequence, for broken builders)
    max_err: float
    mean_err: float
    atol: float
    rtol: float
    within_tol: bool  # output within tolerance (every replay, for broken builders)
    invariant: str  # "n/a" (eager) | "ok" | "violated k/n"
    verdict: str  # PASS | FAIL | CAUGHT | MISSED
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict in (PASS, CAUGHT)


@dataclass(frozen=True)
class SkippedKernel:
    kernel: str
    reason: str


@dataclass(frozen=True)
class SuiteResult:
    device: str  # "cpu" | "cuda"
    suite: str  # "full" | "quick"
    env: dict = field(default_factory=dict)  # device name, torch/triton versions ...
    rows: tuple[CaseResult, ...] = ()
    skipped: tuple[SkippedKernel, ...] = ()
    notes: tuple[str, ...] = ()  # e.g. how a kernel ran ("interpreted")

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def header(self) -> dict:
        return {
            "schema": SCHEMA_VERSION,
            "device": self.device,
            "suite": self.suite,
            "env": self.env,
            "skipped": [dataclasses.asdict(s) for s in self.skipped],
            "notes": list(self.notes),
        }

    def to_json(self) -> dict:
        return {**self.header(), "rows": [dataclasses.asdict(r) for r in self.rows]}

    @staticmethod
    def from_json(data: dict) -> "SuiteResult":
        names = {f.name for f in dataclasses.fields(CaseResult)}
        return SuiteResult(
            device=data["device"],
            suite=data.get("suite", "full"),
            env=dict(data.get("env", {})),
            rows=tuple(CaseResult(**{k: v for k, v in row.items() if k in names}) for row in data["rows"]),
            skipped=tuple(SkippedKernel(**s) for s in data.get("skipped", [])),
            notes=tuple(data.get("notes", [])),
        )


def write_json(result: SuiteResult, path: str | Path) -> Path:
    from diffcheck.storage import manifest

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return manifest.write_json(path, result.to_json(), indent=1, sort_keys=True)


def read_json(path: str | Path) -> SuiteResult:
    from diffcheck.core.errors import DataError

    path = Path(path)
    try:
        data = json.loads(path.read_text())
        schema = data.get("schema")
        if schema != SCHEMA_VERSION:
            raise DataError(f"{path}: field 'schema' is {schema!r}; this diffcheck reads kernel results schema {SCHEMA_VERSION}")
        return SuiteResult.from_json(data)
    except FileNotFoundError:
        raise DataError(f"{path}: no such kernel results file") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: not a kernel results JSON ({type(exc).__name__}: {exc})") from None


def _canonical(header: dict, rows: list[dict]) -> bytes:
    # json float repr round-trips float64 exactly, so a file read back digests identically.
    return json.dumps({"header": header, "rows": rows}, sort_keys=True, separators=(",", ":")).encode()


def _digest(header: dict, rows: list[dict]) -> str:
    from diffcheck.storage import manifest

    return manifest.digest_bytes(_canonical(header, rows)).blake3


def write_parquet(result: SuiteResult, path: str | Path) -> Path:
    """Write ``result`` atomically with its digest in the file metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    rows = [dataclasses.asdict(r) for r in result.rows]
    header = result.header()
    columns = {f.name: [row[f.name] for row in rows] for f in dataclasses.fields(CaseResult)}
    table = pa.table(columns, schema=_arrow_schema(pa))
    table = table.replace_schema_metadata({
        META_SCHEMA: str(SCHEMA_VERSION).encode(),
        META_HEADER: json.dumps(header, sort_keys=True).encode(),
        META_DIGEST: _digest(header, rows).encode(),
    })  # fmt: skip
    from diffcheck.storage import manifest

    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    manifest.atomic_write(path, buffer.getvalue().to_pybytes())
    return path


def _arrow_schema(pa):
    kinds = {int: pa.int32(), float: pa.float64(), bool: pa.bool_(), str: pa.string()}
    hints = {"int": int, "float": float, "bool": bool, "str": str}
    return pa.schema([(f.name, kinds[hints[f.type]]) for f in dataclasses.fields(CaseResult)])


def read_parquet(path: str | Path) -> SuiteResult:
    """Read stored results; DataError if missing, foreign, of another schema or tampered with."""
    import pyarrow.parquet as pq

    from diffcheck.core.errors import DataError

    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no stored kernel results (record them with `diffcheck kernels --update`)")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    meta = table.schema.metadata or {}
    schema = meta.get(META_SCHEMA, b"").decode()
    if schema != str(SCHEMA_VERSION):
        raise DataError(
            f"{path}: metadata field 'diffcheck.kernels.schema' is {schema or 'missing'!r}; expected {SCHEMA_VERSION}"
            " (re-record with `diffcheck kernels --update`)"
        )
    header = json.loads(meta[META_HEADER].decode())
    rows = table.to_pylist()
    stored_digest = meta.get(META_DIGEST, b"").decode()
    if _digest(header, rows) != stored_digest:
        raise DataError(
            f"{path}: metadata field 'diffcheck.kernels.blake3' does not match the content"
            " (edited or damaged; re-record with `diffcheck kernels --update`)"
        )
    return SuiteResult.from_json({**header, "rows": rows})


@dataclass(frozen=True)
class Regression:
    case_id: str
    stat: str  # "max_err" | "mean_err"
    stored: float
    candidate: float
    limit: float

    def __str__(self) -> str:
        return f"{self.case_id}: {self.stat} {self.candidate:.3e} > limit {self.limit:.3e} (stored {self.stored:.3e})"


@dataclass(frozen=True)
class Comparison:
    regressions: tuple[Regression, ...]
    not_run: tuple[str, ...]  # stored cases this run did not produce
    new: tuple[str, ...]  # cases this run produced that are not stored

    @property
    def ok(self) -> bool:
        return not self.regressions


def compare(stored: SuiteResult, candidate: SuiteResult) -> Comparison:
    """Error statistics of ``candidate`` must not exceed 2x stored + atol/4, case by case.

    Only cases that passed when stored are compared: a broken builder's error
    is evidence, not a baseline. A candidate verdict that is itself a failure
    is reported by the suite, not here.
    """
    stored_rows = {r.case_id: r for r in stored.rows}
    candidate_rows = {r.case_id: r for r in candidate.rows}
    regressions = []
    for case_id, cand in candidate_rows.items():
        ref = stored_rows.get(case_id)
        if ref is None or ref.verdict != PASS:
            continue
        for stat in ("max_err", "mean_err"):
            was, now = getattr(ref, stat), getattr(cand, stat)
            limit = REGRESSION_FACTOR * was + REGRESSION_FLOOR * ref.atol
            if not (now <= limit) or math.isnan(now):
                regressions.append(Regression(case_id, stat, was, now, limit))
    return Comparison(
        regressions=tuple(regressions),
        not_run=tuple(sorted(set(stored_rows) - set(candidate_rows))),
        new=tuple(sorted(set(candidate_rows) - set(stored_rows))),
    )


def overall_ok(result: SuiteResult, comparison: Comparison | None = None) -> bool:
    """Exit-0 condition: something ran, every case passed, every broken builder of
    each kernel that ran (both of `BROKEN_BUILDERS`, plus its own in
    `KERNEL_BROKEN_BUILDERS`) was caught, and nothing regressed."""
    if not result.rows or not result.ok:
        return False
    for kernel in {r.kernel for r in result.rows}:
        caught = {r.builder for r in result.rows if r.kernel == kernel and r.verdict == CAUGHT}
        if not set(BROKEN_BUILDERS + KERNEL_BROKEN_BUILDERS.get(kernel, ())) <= caught:
            return False
    return comparison is None or comparison.ok
