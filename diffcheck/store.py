"""The golden store: runs as Parquet files, checked by blake3 digests.

Knows file layout, encodings, integrity and concurrency; knows nothing about
engines, verdicts or rendering. One Parquet file per (suite, case, kind)::

    <root>/<suite>/<case>.parquet               golden (kind=generate, role=reference)
    <root>/<suite>/<case>.run.parquet           a candidate's recorded run (pytest-regressions' .obtained)
    <root>/<suite>/<case>.forced-<ref>.parquet  candidate teacher-forced along golden <ref>
    <root>/<suite>/<case>.scored-<ref>.parquet  candidate run scored by reference engine <ref>
    <root>/<suite>/MANIFEST.json                {filename: entry}, entry keys below

File content. The Parquet table holds one row per generated token, ordered by
(seq, step): ``seq`` int32, ``step`` int32, ``token_id`` int32, ``logprob``
float16 (the sampled token's), ``topk_ids`` list of K int32 (rank order, -1
pads), ``topk_logprobs`` list of K float16 (descending, -inf pads). Key-value
metadata (JSON values, UTF-8, readable with ``pyarrow.parquet.read_metadata``
or DuckDB's ``parquet_kv_metadata``):

- ``diffcheck.schema_version``: int, `SCHEMA_VERSION`. A newer one is refused.
- ``diffcheck.meta``: every `RunMeta` field.
- ``diffcheck.sequences``: the per-sequence rows as a JSON list of records
  (prompt_id, prompt_token_ids, text, finish_reason, n_tokens). They live in
  the metadata, not in the table, because a Parquet file has one row
  granularity and a sequence with 0 tokens has no step rows; this costs the
  uncompressed text (about 4 bytes per token for English, see bench_store.py).
- ``diffcheck.layout``: K, token and sequence counts, the logprob precision.

Precision. Logprobs are stored as float16 rounded to `LOGPROB_MANTISSA_BITS` = 7
significant mantissa bits (round half to even, after the float32 -> float16
rounding): a relative error of at most 2^-8 (0.39 %) of |x|, i.e. <= 0.004 nats
at |x|~1, <= 0.03 at |x|~8, <= 0.06 at |x|~16, and exact for 0, -inf and +inf.
NaN is canonicalised to one bit pattern; |x| > 65504 becomes inf. In probability
terms |Δp| <= p * |Δlogprob|, so no KL, Δp, margin or NLL rule that
classify.py applies can see the difference; full float16 (10 bits) would cost
about 7 bytes per token more at K=20 for precision below what any verdict uses.
Changing the precision changes stored values and content digests, so it needs
a `SCHEMA_VERSION` bump. Readers get float32 numpy arrays. `quantize(run)`
applies the same rounding in memory.

Encodings (chosen with bench/bench_store.py on a real SmolLM2 golden and on
synthetic runs fitted to it): zstd level `ZSTD_LEVEL`; BYTE_STREAM_SPLIT for
logprobs and ids (the sign/exponent bytes of sorted logprobs and the high
bytes of BPE ids, which are numbered roughly by frequency, compress apart from
the noisy low bytes: 17 bytes/token for 20 logprobs against 20 with plain
encoding; for ids, split, plain and dictionary encodings are within 1
byte/token of each other on the real golden, split wins by 2-7 on synthetic
runs and writes twice as fast);
DELTA_BINARY_PACKED for ``step``; dictionary/RLE for ``seq``; no statistics; no
embedded Arrow schema (it would repeat the metadata in base64), so plain
readers see ``list`` rather than ``fixed_size_list``. What a token costs at K=20
(real golden): ids ~33 bytes (about 10 bits of entropy each), logprobs ~17,
token + its logprob ~3, plus the sequence rows (text ~5 bytes per token, prompt
ids) and ~2 KB of meta per file.

Digests (blake3 hex). ``content_digest(run)`` hashes the quantized columns, the
sequence rows and the meta fields that define the content (suite, case_id,
role, kind, model digest, sampling, engine name + version + effective config,
source) but not created/timings/hardware/env/diffcheck_version, so
``content_digest(run) == content_digest(read_run(path))`` after
``write_run(path, run)`` and a re-recording of the same output reproduces it.
``output_digest(run)`` hashes only what was generated (token ids and text per
sequence): equal outputs of different cases or configs share it, like the
seed's output hashes ("same bad hash as E").

Integrity. Every read hashes the file and checks it against its entry in the
folder's MANIFEST.json when that exists; a file an existing manifest does not
list is refused. Truncated, non-Parquet and foreign (no diffcheck metadata)
files are refused, as are newer schema versions. Every refusal is a
`DataError` with one line, ``<path>: <what failed>``.

Manifest entry: file_blake3, content_blake3, output_blake3, schema_version,
bytes, case_id, kind, role, n_tokens, created; plus ``pending`` (an entry) while
a write is in flight. Writes are two-phase so that a writer killed at any point
leaves a consistent folder: (1) record the new entry as ``pending`` beside the
committed one, (2) write a temp file in the folder, fsync, ``os.replace``,
(3) commit the pending entry. A file matching either the committed or the
pending entry verifies. The manifest itself is rewritten by temp + replace under
``MANIFEST.json.lock``; a second writer of the same run file is refused with
`LockedError` (non-blocking ``fcntl.flock`` on ``<file>.lock``, naming the
holder's pid).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import blake3
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from diffcheck.errors import ConfigError, DataError, LockedError
from diffcheck.types import Run, RunMeta, SequenceInfo, Steps

SCHEMA_VERSION = 1
LOGPROB_MANTISSA_BITS = 7  # of float16's 10; see "Precision" above
MANIFEST = "MANIFEST.json"
# zstd 19 makes files ~7 % smaller than level 9 (ids and logprobs both gain) and writes 10-25k
# tokens/s on this 2-core machine, under a second for a seed-size golden (8 x 1024 tokens);
# reads are unaffected. Level 9 writes ~20x faster.
ZSTD_LEVEL = 19

_KEY_SCHEMA = b"diffcheck.schema_version"
_KEY_META = b"diffcheck.meta"
_KEY_SEQUENCES = b"diffcheck.sequences"
_KEY_LAYOUT = b"diffcheck.layout"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")  # cases.py's id rule
_COLUMNS = ("seq", "step", "token_id", "logprob", "topk_ids", "topk_logprobs")
# The meta fields a content digest covers: what defines the content, not when/where it ran.
_ENGINE_CONTENT_KEYS = ("name", "version", "effective")


@dataclass(frozen=True)
class VerifyResult:
    path: Path
    ok: bool
    message: str = ""


# -- paths ---------------------------------------------------------------------------------------


def run_path(root: str | Path, suite: str, case_id: str, *, kind: str = "generate",
             role: str = "reference", reference: str | None = None) -> Path:
    """Where a run lives. ``reference`` names the golden a forced/scored run derives from."""
    for what, value in (("suite", suite), ("case id", case_id)) + ((("reference", reference),) if reference else ()):
        if not isinstance(value, str) or not _NAME.match(value):
            raise ConfigError(f"{what} '{value}' cannot name a golden file (valid: letters, digits, '_', '.', '-'; "
                              "starting with a letter or digit)")
    folder = Path(root) / suite
    if kind == "generate":
        if role not in ("reference", "candidate"):
            raise ConfigError(f"role '{role}' is not valid (valid: reference, candidate)")
        return folder / (f"{case_id}.parquet" if role == "reference" else f"{case_id}.run.parquet")
    if kind in ("forced", "scored"):
        if not reference:
            raise ConfigError(f"a {kind} run needs the reference golden it derives from (reference=...)")
        return folder / f"{case_id}.{kind}-{reference}.parquet"
    raise ConfigError(f"kind '{kind}' is not valid (valid: generate, forced, scored)")


def _rerecord_hint(path: Path) -> str:
    """The command that re-creates a file, from its name (its content may be unreadable)."""
    suite = path.parent.name
    flag = "" if suite == "default" else f" --suite {suite}"
    name = path.name[: -len(".parquet")] if path.name.endswith(".parquet") else path.name
    m = re.match(r"(.+)\.(forced|scored)-[^/]+\Z", name)
    if m:
        return f"re-create it with `diffcheck compare {m.group(1)}{flag}`"
    if name.endswith(".run"):
        return f"re-record it with `diffcheck run {name[:-4]}{flag}`"
    return f"re-record with `diffcheck golden record {name}{flag} --update`"


# -- quantization and digests ----------------------------------------------------------------------


def quantize_logprobs(values: np.ndarray) -> np.ndarray:
    """The stored form of logprobs: float16 with `LOGPROB_MANTISSA_BITS` mantissa bits.

    Deterministic and idempotent; NaN becomes one canonical pattern.
    """
    with np.errstate(over="ignore"):  # |x| > 65504 becomes inf, as documented
        half = np.asarray(values, dtype=np.float32).astype(np.float16)
    bits = half.view(np.uint16).copy()
    drop = 10 - LOGPROB_MANTISSA_BITS
    if drop > 0:
        sign = bits & np.uint16(0x8000)
        mag = (bits & np.uint16(0x7FFF)).astype(np.uint32)
        finite = mag < 0x7C00
        lsb = (mag >> drop) & 1
        rounded = ((mag + ((1 << (drop - 1)) - 1) + lsb) >> drop) << drop  # round half to even
        mag = np.where(finite, np.minimum(rounded, 0x7C00), mag)
        bits = (sign | mag.astype(np.uint16)).astype(np.uint16)
    bits[np.isnan(half)] = 0x7E00
    return bits.view(np.float16)


def quantize(run: Run) -> Run:
    """The run as `read_run` would return it after `write_run` (float32 arrays of stored values)."""
    st = _checked_steps(run, where="run")
    return dataclasses.replace(run, steps=dataclasses.replace(
        st,
        logprob=quantize_logprobs(st.logprob).astype(np.float32),
        topk_logprobs=quantize_logprobs(st.topk_logprobs).astype(np.float32),
    ))


def _jsonable(obj: Any) -> Any:
    """JSON-native form: str keys, lists for tuples, python scalars for numpy ones."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def _canonical(obj: Any) -> bytes:
    """Sorted, compact JSON; raw UTF-8 (CJK text costs 3 bytes a character, not 6), escaped
    only when the text holds lone surrogates, which UTF-8 cannot carry."""
    native = _jsonable(obj)
    try:
        return json.dumps(native, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(native, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _content_meta(meta: RunMeta) -> dict:
    return {
        "suite": meta.suite, "case_id": meta.case_id, "role": meta.role, "kind": meta.kind,
        "model_digest": (meta.model or {}).get("digest"),
        "sampling": meta.sampling,
        "engine": {k: (meta.engine or {}).get(k) for k in _ENGINE_CONTENT_KEYS},
        "source": meta.source,
    }


def _sequence_rows(sequences) -> list[dict]:
    return [{"prompt_id": s.prompt_id, "prompt_token_ids": [int(t) for t in s.prompt_token_ids], "text": s.text,
             "finish_reason": s.finish_reason, "n_tokens": int(s.n_tokens)} for s in sequences]


def _stored_columns(run: Run, *, where: str) -> dict[str, np.ndarray]:
    """The columns exactly as stored: int32 ids, float16 logprobs."""
    st = _checked_steps(run, where=where)
    return {
        "seq": st.seq.astype(np.int32, copy=False), "step": st.step.astype(np.int32, copy=False),
        "token_id": st.token_id.astype(np.int32, copy=False), "logprob": quantize_logprobs(st.logprob),
        "topk_ids": st.topk_ids.astype(np.int32, copy=False), "topk_logprobs": quantize_logprobs(st.topk_logprobs),
    }


def _digest_columns(hasher, cols: dict[str, np.ndarray]) -> None:
    for name in _COLUMNS:
        a = np.ascontiguousarray(cols[name])
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        hasher.update(f"{name}:{a.dtype.str}:{a.shape}\n".encode())
        hasher.update(a.tobytes())


def _content_digest_of(run: Run, cols: dict[str, np.ndarray]) -> str:
    h = blake3.blake3(b"diffcheck.content.v1\n")
    h.update(_canonical({"meta": _content_meta(run.meta), "sequences": _sequence_rows(run.sequences)}))
    h.update(b"\n")
    _digest_columns(h, cols)
    return h.hexdigest()


def content_digest(run: Run) -> str:
    """blake3 of the run's canonical content at stored precision (see module docstring)."""
    return _content_digest_of(run, _stored_columns(run, where="run"))


def output_digest(run: Run) -> str:
    """blake3 of what was generated: each sequence's token ids and text; no logprobs, no meta."""
    st = _checked_steps(run, where="run")
    off = run.offsets()
    h = blake3.blake3(b"diffcheck.output.v1\n")
    for i, s in enumerate(run.sequences):
        ids = np.ascontiguousarray(st.token_id[off[i]:off[i + 1]], dtype="<i4")
        text = s.text.encode("utf-8", "surrogatepass")
        h.update(f"{ids.size} {len(text)}\n".encode())
        h.update(ids.tobytes())
        h.update(text)
    return h.hexdigest()


def _checked_steps(run: Run, *, where: str) -> Steps:
    """The run's steps, after checking that columns and sequences agree (a bug otherwise)."""
    st = run.steps
    n = len(st.token_id)
    if st.topk_ids.ndim != 2 or st.topk_logprobs.shape != st.topk_ids.shape:
        raise DataError(f"{where}: topk_ids {st.topk_ids.shape} and topk_logprobs {st.topk_logprobs.shape} "
                        "must both be [N, K]")
    for name in ("seq", "step", "logprob"):
        if getattr(st, name).shape != (n,):
            raise DataError(f"{where}: column {name} has shape {getattr(st, name).shape}, token_id has {n} rows")
    if st.topk_ids.shape[0] != n:
        raise DataError(f"{where}: topk columns have {st.topk_ids.shape[0]} rows, token_id has {n}")
    counts = np.fromiter((s.n_tokens for s in run.sequences), np.int64, len(run.sequences))
    if int(counts.sum()) != n:
        raise DataError(f"{where}: sequences declare {int(counts.sum())} tokens, the step columns hold {n}")
    expect_seq = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    expect_step = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    if n and not (np.array_equal(st.seq, expect_seq) and np.array_equal(st.step, expect_step)):
        raise DataError(f"{where}: seq/step columns are not (sequence index, 0..n_tokens-1) in order")
    return st


# -- serialization -----------------------------------------------------------------------------


def _serialize(run: Run, cols: dict[str, np.ndarray]) -> bytes:
    k = int(cols["topk_ids"].shape[1])
    table = pa.table({
        "seq": pa.array(cols["seq"]), "step": pa.array(cols["step"]), "token_id": pa.array(cols["token_id"]),
        "logprob": pa.array(cols["logprob"]),
        "topk_ids": pa.FixedSizeListArray.from_arrays(pa.array(cols["topk_ids"].reshape(-1)), k),
        "topk_logprobs": pa.FixedSizeListArray.from_arrays(pa.array(cols["topk_logprobs"].reshape(-1)), k),
    })
    layout = {"k": k, "n_tokens": int(len(cols["token_id"])), "n_sequences": len(run.sequences),
              "logprob_dtype": "float16", "logprob_mantissa_bits": LOGPROB_MANTISSA_BITS}
    buf = io.BytesIO()
    # store_schema=False: the Arrow schema would embed the key-value metadata a second time, base64'd.
    writer = pq.ParquetWriter(
        buf, table.schema, compression="zstd", compression_level=ZSTD_LEVEL, store_schema=False,
        write_statistics=False, use_dictionary=["seq"],
        column_encoding={
            "step": "DELTA_BINARY_PACKED", "token_id": "BYTE_STREAM_SPLIT", "logprob": "BYTE_STREAM_SPLIT",
            "topk_ids.list.element": "BYTE_STREAM_SPLIT", "topk_logprobs.list.element": "BYTE_STREAM_SPLIT",
        },
    )
    try:
        writer.write_table(table, row_group_size=max(1, table.num_rows))
        writer.add_key_value_metadata({
            _KEY_SCHEMA: str(SCHEMA_VERSION).encode(),
            _KEY_META: _canonical(dataclasses.asdict(run.meta)),
            _KEY_SEQUENCES: _canonical(_sequence_rows(run.sequences)),
            _KEY_LAYOUT: _canonical(layout),
        })
    finally:
        writer.close()
    return buf.getvalue()


def _parse_kv(path: Path, kv: dict[bytes, bytes] | None) -> tuple[RunMeta, tuple[SequenceInfo, ...], dict]:
    kv = kv or {}
    if _KEY_SCHEMA not in kv:
        raise DataError(f"{path}: not a diffcheck run (Parquet without diffcheck metadata)")
    try:
        version = int(kv[_KEY_SCHEMA])
    except ValueError:
        raise DataError(f"{path}: diffcheck.schema_version is not an integer ({kv[_KEY_SCHEMA][:20]!r})") from None
    if version > SCHEMA_VERSION:
        raise DataError(f"{path}: written by a newer diffcheck (schema {version} > {SCHEMA_VERSION}); upgrade diffcheck")
    if version < 1:
        raise DataError(f"{path}: unknown diffcheck schema {version} (this diffcheck reads 1..{SCHEMA_VERSION})")
    try:
        meta_d = json.loads(kv[_KEY_META])
        rows = json.loads(kv[_KEY_SEQUENCES])
        layout = json.loads(kv[_KEY_LAYOUT])
        fields = {f.name for f in dataclasses.fields(RunMeta)}
        meta = RunMeta(**{k: v for k, v in meta_d.items() if k in fields})
        seqs = tuple(SequenceInfo(prompt_id=r["prompt_id"], prompt_token_ids=tuple(r["prompt_token_ids"]),
                                  text=r["text"], finish_reason=r["finish_reason"], n_tokens=int(r["n_tokens"]))
                     for r in rows)
        int(layout["k"]), int(layout["n_tokens"])
    except KeyError as exc:
        raise DataError(f"{path}: diffcheck metadata lacks {exc}") from None
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: diffcheck metadata is malformed ({type(exc).__name__}: {exc})") from None
    return meta, seqs, layout


def _open_parquet(path: Path, data: bytes) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(io.BytesIO(data))
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{path}: not a readable Parquet file, truncated or corrupt ({first})") from None


def _flat(path: Path, column: pa.ChunkedArray, dtype, k: int | None = None) -> np.ndarray:
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if k is not None:
        if arr.null_count or (len(arr) and arr.flatten().null_count):
            raise DataError(f"{path}: top-k column holds nulls")
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
        if len(arr) and not (lengths == k).all():
            raise DataError(f"{path}: top-k lists are not all of length {k} (diffcheck.layout)")
        out = arr.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
        return out.reshape(len(arr), k)
    if arr.null_count:
        raise DataError(f"{path}: column holds nulls")
    return arr.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _decode(path: Path, data: bytes) -> Run:
    pf = _open_parquet(path, data)
    meta, seqs, layout = _parse_kv(path, pf.metadata.metadata)
    missing = [c for c in _COLUMNS if c not in pf.schema_arrow.names]
    if missing:
        raise DataError(f"{path}: missing columns {', '.join(missing)}")
    try:
        table = pf.read(columns=list(_COLUMNS))
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: column data is unreadable, truncated or corrupt ({str(exc).splitlines()[0]})") from None
    k = int(layout["k"])
    try:
        steps = Steps(
            seq=_flat(path, table["seq"], np.int32), step=_flat(path, table["step"], np.int32),
            token_id=_flat(path, table["token_id"], np.int32), logprob=_flat(path, table["logprob"], np.float32),
            topk_ids=_flat(path, table["topk_ids"], np.int32, k),
            topk_logprobs=_flat(path, table["topk_logprobs"], np.float32, k),
        )
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise DataError(f"{path}: column types are not diffcheck's ({exc})") from None
    run = Run(meta=meta, sequences=seqs, steps=steps)
    _checked_steps(run, where=str(path))
    return run


# -- manifest ------------------------------------------------------------------------------------


def _load_manifest(folder: Path) -> dict | None:
    mpath = folder / MANIFEST
    try:
        text = mpath.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DataError(f"{mpath}: cannot read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise DataError(f"{mpath}: not valid JSON ({exc}); restore it from version control or re-record") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise DataError(f"{mpath}: expected a JSON object mapping file names to entry objects")
    return data


def _effective_entry(raw: dict, file_hash: str | None) -> dict | None:
    """The committed entry, or the pending one when the file on disk is the pending write's."""
    committed = {k: v for k, v in raw.items() if k != "pending"} or None
    pending = raw.get("pending")
    if pending and file_hash is not None and file_hash == pending.get("file_blake3") and (
            not committed or committed.get("file_blake3") != file_hash):
        return dict(pending)
    return committed


def manifest_entry(path: str | Path) -> dict | None:
    """The manifest's entry for a file (the in-flight write's when the file is already that one)."""
    path = Path(path)
    manifest = _load_manifest(path.parent)
    if manifest is None or path.name not in manifest:
        return None
    raw = manifest[path.name]
    file_hash = None
    if raw.get("pending") and path.exists():
        file_hash = blake3.blake3(path.read_bytes()).hexdigest()
    return _effective_entry(raw, file_hash)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _remove_stale_temps(folder: Path, name: str) -> None:
    """Temp files of `name` left by killed writers; only called while holding that name's lock."""
    for p in folder.glob(f".{name}.*.tmp"):
        with contextlib.suppress(OSError):
            p.unlink()


@contextlib.contextmanager
def _flock(lock_path: Path, *, blocking: bool, target: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise LockedError(f"{target}: another writer holds {lock_path.name} (pid {holder}); "
                              "wait for it to finish") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _update_manifest(folder: Path, change) -> None:
    """Read-modify-write MANIFEST.json under its lock; `change(entries) -> None` edits in place."""
    with _flock(folder / f"{MANIFEST}.lock", blocking=True, target=folder / MANIFEST):
        _remove_stale_temps(folder, MANIFEST)
        manifest = _load_manifest(folder) or {}
        change(manifest)
        text = json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
        _atomic_write(folder / MANIFEST, text.encode())


# -- public read/write --------------------------------------------------------------------------


def write_run(path: str | Path, run: Run) -> str:
    """Write a run atomically, record it in the folder's manifest; return its content digest."""
    path = Path(path)
    cols = _stored_columns(run, where=str(path))
    digest = _content_digest_of(run, cols)
    data = _serialize(run, cols)
    entry = {
        "file_blake3": blake3.blake3(data).hexdigest(), "content_blake3": digest, "output_blake3": output_digest(run),
        "schema_version": SCHEMA_VERSION, "bytes": len(data), "case_id": run.meta.case_id, "kind": run.meta.kind,
        "role": run.meta.role, "n_tokens": run.n_tokens,
        "created": run.meta.created or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    with _flock(folder / f"{path.name}.lock", blocking=False, target=path):
        _remove_stale_temps(folder, path.name)

        def begin(m):  # keep the committed entry: the old file must still verify until the replace
            m[path.name] = {**{k: v for k, v in m.get(path.name, {}).items() if k != "pending"}, "pending": entry}

        def commit(m):
            m[path.name] = entry

        _update_manifest(folder, begin)
        _atomic_write(path, data)
        _update_manifest(folder, commit)
    return digest


def _read_verified(path: Path, *, verify: bool) -> bytes:
    """The file's bytes, checked against the manifest (retrying once across a concurrent write)."""
    for attempt in range(2):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"{path}: not found") from None
        except IsADirectoryError:
            raise DataError(f"{path}: is a directory, not a run file") from None
        except OSError as exc:
            raise DataError(f"{path}: cannot read ({exc.strerror})") from None
        if not verify:
            return data
        manifest = _load_manifest(path.parent)
        if manifest is None:
            return data
        if path.name not in manifest:
            raise DataError(f"{path}: not in manifest {path.parent / MANIFEST}; it was not recorded in this "
                            f"folder — {_rerecord_hint(path)}")
        file_hash = blake3.blake3(data).hexdigest()
        entry = _effective_entry(manifest[path.name], file_hash) or {}
        if entry.get("file_blake3") == file_hash:
            return data
        if attempt == 0:
            continue  # a writer may have replaced the file between our two reads
        expect = str(entry.get("file_blake3", "none"))
        size = "" if entry.get("bytes") in (None, len(data)) else f", {len(data)} bytes, manifest says {entry['bytes']}"
        raise DataError(f"{path}: blake3 mismatch (manifest {expect[:8]}.., file {file_hash[:8]}..{size}); "
                        f"the file was modified after recording — {_rerecord_hint(path)}")
    raise AssertionError("unreachable")


def read_run(path: str | Path, *, verify: bool = True) -> Run:
    """Read a run; float32/int32 numpy columns. ``verify=False`` skips only the manifest check."""
    path = Path(path)
    return _decode(path, _read_verified(path, verify=verify))


def read_meta(path: str | Path) -> RunMeta:
    """The run's meta without decoding step data; the file is still verified."""
    path = Path(path)
    pf = _open_parquet(path, _read_verified(path, verify=True))
    return _parse_kv(path, pf.metadata.metadata)[0]


def verify_folder(folder: str | Path) -> list[VerifyResult]:
    """Check every run file of a suite folder: manifest digest, format, schema, content digest."""
    folder = Path(folder)
    try:
        manifest = _load_manifest(folder)
    except DataError as exc:
        return [VerifyResult(folder / MANIFEST, False, exc.message)]
    files = sorted(p for p in folder.glob("*.parquet") if p.is_file())
    results = []
    if manifest is None:
        return [VerifyResult(p, False, f"{p}: no {MANIFEST} in {folder}; cannot check its blake3") for p in files]
    for p in files:
        try:
            run = _decode(p, _read_verified(p, verify=True))
            entry = manifest_entry(p) or {}
            got = content_digest(run)
            if entry.get("content_blake3") != got:
                raise DataError(f"{p}: content digest {got[:8]}.. differs from the manifest's "
                                f"{str(entry.get('content_blake3'))[:8]}..; {_rerecord_hint(p)}")
            results.append(VerifyResult(p, True, ""))
        except DataError as exc:
            results.append(VerifyResult(p, False, exc.message))
    present = {p.name for p in files}
    for name, raw in sorted(manifest.items()):
        committed = {k: v for k, v in raw.items() if k != "pending"}
        if name not in present and committed:  # a pending-only entry is a new file whose write was aborted
            results.append(VerifyResult(folder / name, False,
                                        f"{folder / name}: listed in {MANIFEST} but missing; {_rerecord_hint(folder / name)}"))
    return results
