"""The bytes of one golden file: Parquet layout, logprob codes, content digests.

Longer than 400 lines because the golden format's precision contract is documented in full beside the encoder and decoder that implement it.

Knows how a `Run` becomes Parquet bytes and back, at which precision, and what a
content digest covers; knows nothing about folders, manifests or locks (store.py).

Layout (schema 2). One Parquet table, one row per generated token ordered by
(seq, step), plus one row with ``step = -1`` for each sequence that generated no
token (so that every sequence has a row to carry its facts):

===================== ============= ==================================================
column                type          meaning
===================== ============= ==================================================
seq                   int32         sequence index, 0..S-1
step                  int32         0..n_tokens-1; -1 on a zero-token sequence's row
token_id              int32         the sampled (forced, scored) token; null at step -1
logprob_code          int32         the token's logprob, coded; null at step -1
topk_ids              list<int32>   K ids in rank order, -1 pads; null at step -1
top1_logprob_code     int32         rank 0's logprob, coded; null at step -1
topk_logprob_gaps     list<int32>   K-1 code gaps between consecutive ranks
prompt_id             string        first row of each sequence only (null elsewhere)
prompt_token_ids      list<int32>   first row of each sequence only
text                  string        first row of each sequence only
finish_reason         string        first row of each sequence only
n_tokens              int32         first row of each sequence only
===================== ============= ==================================================

Logprob codes (the rule is also in each file's ``diffcheck.layout``). A code is
the float16 bit pattern of -logprob rounded to M = `LOGPROB_MANTISSA_BITS` = 6
mantissa bits, shifted right by 10 - M = 4, so codes grow as logprobs fall::

    code[0] = top1_logprob_code;  code[r] = code[r-1] + topk_logprob_gaps[r-1]
    c >= 0:  e = c >> 6, f = (c & 63) / 64
             logprob = -(1 + f) * 2^(e - 15)   (0 < e < 31)
             logprob = -f * 2^-14             (e = 0)
             c = 1984: -inf (padding), c = 2016: NaN
    c < 0:   a positive logprob (a broken engine), coded from its own bits as -1 - c

Top-k logprobs are sorted descending, so the gaps are small non-negative
integers; unsorted rows still round-trip, only larger. With numpy:
``-(codes.astype(np.uint16) << 4).view(np.float16)`` for c >= 0.

Precision. Relative, like float16 with 6 mantissa bits: each stored logprob
is within 2^-7 + 2^-11 = 0.83 % of |logprob| (float32 -> float16 -> 6 bits, each
rounding half to even), plus 2^-21 nats below float16's normal range (6e-5):
<= 0.0008 nats at -0.1, 0.008 at -1, 0.03 at -4, 0.07 at -8; exact for 0, -inf
and NaN (one NaN); |logprob| > 65024 becomes inf. For classify.py's finest
thresholds: two nearly equal values can land one step apart, so a shared token's |Δlogprob| moves by
at most 1.6 % of |logprob| (0.06 nats at -4: 12 % of ``dlogprob_step`` 0.5,
6 % of ``forced_dlogprob`` 1.0); a mean NLL moves by < 1 % (``benign_nll_margin``
is 1.0 nat). Mean top-k KL between the real J golden and a copy with Gaussian
noise on its logprobs (bench/bench_store.py): 1e-3 nats of noise: 1.09e-4
unquantized, 1.30e-4 stored with 6 bits, 1.30e-4 with 7 (schema 1), 2.2e-4
with 5, 6.4e-4 on an absolute 1/64-nat grid; 1e-2 nats: 2.96e-3, 2.94e-3,
2.95e-3, 3.09e-3, 4.81e-3 (``kl_mean`` is 0.01). An absolute grid is worse
where it matters: a confident step's top-1 logprob (~ -0.001) then rounds by up
to 0.008 nats, far more than the top-k tail mass that KL depends on, while in the
deep tail, where probabilities no longer matter, it spends bits on precision
nobody uses. Sizes on J (1536 tokens, K=20): 53.2 bytes/token with 7 bits, 50.7
with 6, 48.5 with 5. `quantize_logprobs` applies the codes in memory, so a run
compares with its read-back self exactly, and a generate run's logprob still
equals its top-k entry.

Encodings (chosen with bench/bench_store.py on the real goldens): zstd level
`ZSTD_LEVEL`; PLAIN for ids (a repeated id stays a 4-byte LZ match: 1-4 bytes per
token smaller than BYTE_STREAM_SPLIT or dictionary); BYTE_STREAM_SPLIT for the
gaps and codes (their high bytes are nearly always zero and compress to nothing;
DELTA_BINARY_PACKED and dictionary were 3-8 bytes per token larger); DELTA_BINARY_PACKED for ``step``; dictionary/RLE for ``seq`` and
``finish_reason``; no statistics; no embedded Arrow schema (it would repeat the
metadata in base64). Key-value metadata holds ``diffcheck.schema_version``,
``diffcheck.meta`` (every `RunMeta` field, JSON) and ``diffcheck.layout`` (K,
counts, mantissa bits, the decoding rule).

Digests (blake3 hex). ``content_digest(run)`` hashes the stored integer columns,
the sequence rows and the meta fields that define the content (suite, case_id,
role, kind, model digest, sampling, engine name + version + effective config,
source), not created/timings/hardware/env/diffcheck_version.
``output_digest(run)`` hashes only what was generated (token ids and text).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from diffcheck.core.errors import DataError
from diffcheck.core.types import Run, RunMeta, SequenceInfo, Steps

SCHEMA_VERSION = 2
LOGPROB_MANTISSA_BITS = 6  # of float16's 10; see "Precision" above
# zstd 3: every comparison writes its runs, so the level is on the path to a verdict. On a
# 1024-token top-20 run (the H200 lane's O), level 19 took 41 ms to encode against 2.5 ms at
# level 3, for a file 8 % smaller (54 vs 59 kB); on the GPU that was a fifth of a generate.
# Reads are unaffected, and files written at any level read the same.
ZSTD_LEVEL = 3

KEY_SCHEMA = b"diffcheck.schema_version"
KEY_META = b"diffcheck.meta"
KEY_LAYOUT = b"diffcheck.layout"
STEP_COLUMNS = ("seq", "step", "token_id", "logprob_code", "topk_ids", "top1_logprob_code", "topk_logprob_gaps")
SEQUENCE_COLUMNS = ("prompt_id", "prompt_token_ids", "text", "finish_reason", "n_tokens")
COLUMNS = STEP_COLUMNS + SEQUENCE_COLUMNS


def decoding() -> str:
    """The decoding rule, as written into each file's ``diffcheck.layout``."""
    m = LOGPROB_MANTISSA_BITS
    return (f"code[0] = top1_logprob_code; code[r] = code[r-1] + topk_logprob_gaps[r-1]; a code c (also "
            f"logprob_code) >= 0 is -logprob's float16 bit pattern shifted right by {10 - m}: with e = c >> {m}, "
            f"f = (c & {2 ** m - 1}) / {2 ** m}: logprob = -(1 + f) * 2^(e - 15) for 0 < e < 31, "
            f"-f * 2^-14 for e = 0, -inf for c = {31 << m}, NaN for c = {0x7E00 >> (10 - m)}; "
            "c < 0 codes a positive logprob, -1 - c its bits; rows with step = -1 are zero-token sequences "
            "(no step data); the sequence columns are set on each sequence's first row only")

_ENGINE_CONTENT_KEYS = ("name", "version", "effective")


@dataclass(frozen=True)
class StoredSteps:
    """The step columns as stored: int32 ids and logprob codes."""

    token_id: np.ndarray  # [N]
    logprob_code: np.ndarray  # [N]
    topk_ids: np.ndarray  # [N, K]
    topk_codes: np.ndarray  # [N, K], code per rank (the file stores rank 0 and the gaps)


# -- logprob codes ------------------------------------------------------------------------------


def logprob_codes(values: np.ndarray) -> np.ndarray:
    """int32 codes of logprobs: the float16 bits of -logprob, rounded to `LOGPROB_MANTISSA_BITS`
    mantissa bits (half to even) and shifted right by the dropped bits; see "Precision"."""
    drop = 10 - LOGPROB_MANTISSA_BITS
    with np.errstate(over="ignore", invalid="ignore"):  # |x| > 65504 becomes inf, as documented
        half = (-np.asarray(values, dtype=np.float32)).astype(np.float16)
    bits = half.view(np.uint16).astype(np.int64)
    mag = bits & 0x7FFF
    rounded = (mag + ((1 << (drop - 1)) - 1 if drop else 0) + ((mag >> drop) & 1 if drop else 0)) >> drop
    mag_code = np.where(mag < 0x7C00, np.minimum(rounded, 0x7C00 >> drop), mag >> drop)
    codes = np.where(bits & 0x8000, -1 - mag_code, mag_code)  # a positive logprob: negative codes
    codes = np.where(mag_code == 0, 0, codes)  # 0 and -0 are one code
    codes[np.isnan(half)] = 0x7E00 >> drop  # one NaN, so digests do not depend on NaN payloads
    return codes.astype(np.int32)


def logprob_values(codes: np.ndarray) -> np.ndarray:
    """float32 logprobs of codes (exact: each is a float16 value)."""
    c = np.asarray(codes, dtype=np.int64)
    drop = 10 - LOGPROB_MANTISSA_BITS
    negative = c >= 0  # code >= 0: logprob <= 0
    mag = (np.where(negative, c, -1 - c) << drop).astype(np.uint16)
    out = mag.view(np.float16).astype(np.float32)
    return np.where(c > 0, -out, out).astype(np.float32)  # code 0 is +0.0


def quantize_logprobs(values: np.ndarray) -> np.ndarray:
    """The stored form of logprobs, as float32 (6 mantissa bits). Deterministic and idempotent."""
    return logprob_values(logprob_codes(values))


def quantize(run: Run) -> Run:
    """The run as `read_run` would return it after `write_run` (float32 arrays of stored values)."""
    st = checked_steps(run, where="run")
    return dataclasses.replace(run, steps=dataclasses.replace(
        st, logprob=quantize_logprobs(st.logprob), topk_logprobs=quantize_logprobs(st.topk_logprobs)))


def checked_steps(run: Run, *, where: str) -> Steps:
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


def stored_steps(run: Run, *, where: str) -> StoredSteps:
    st = checked_steps(run, where=where)
    return StoredSteps(token_id=st.token_id.astype(np.int32, copy=False), logprob_code=logprob_codes(st.logprob),
                       topk_ids=st.topk_ids.astype(np.int32, copy=False), topk_codes=logprob_codes(st.topk_logprobs))


# -- digests -------------------------------------------------------------------------------------


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


def canonical(obj: Any) -> bytes:
    """Sorted, compact JSON; raw UTF-8, escaped only when the text holds lone surrogates."""
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


def sequence_rows(sequences) -> list[dict]:
    return [{"prompt_id": s.prompt_id, "prompt_token_ids": [int(t) for t in s.prompt_token_ids], "text": s.text,
             "finish_reason": s.finish_reason, "n_tokens": int(s.n_tokens)} for s in sequences]


def content_digest_of(run: Run, stored: StoredSteps) -> str:
    h = blake3.blake3(b"diffcheck.content.v2\n")
    h.update(canonical({"meta": _content_meta(run.meta), "sequences": sequence_rows(run.sequences)}))
    h.update(b"\n")
    for name in ("token_id", "logprob_code", "topk_ids", "topk_codes"):
        a = np.ascontiguousarray(getattr(stored, name), dtype="<i4")
        h.update(f"{name}:{a.shape}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def content_digest(run: Run) -> str:
    """blake3 of the run's canonical content at stored precision (see module docstring)."""
    return content_digest_of(run, stored_steps(run, where="run"))


def output_digest(run: Run) -> str:
    """blake3 of what was generated: each sequence's token ids and text; no logprobs, no meta."""
    st = checked_steps(run, where="run")
    off = run.offsets()
    h = blake3.blake3(b"diffcheck.output.v1\n")
    for i, s in enumerate(run.sequences):
        ids = np.ascontiguousarray(st.token_id[off[i]:off[i + 1]], dtype="<i4")
        text = s.text.encode("utf-8", "surrogatepass")
        h.update(f"{ids.size} {len(text)}\n".encode())
        h.update(ids.tobytes())
        h.update(text)
    return h.hexdigest()


# -- Parquet -------------------------------------------------------------------------------------


def _utf8_text(text: str) -> tuple[str, bool]:
    """The text as a Parquet string: itself, or its JSON escape when it holds lone surrogates
    (UTF-8 cannot carry them); the flag says which, and goes into ``diffcheck.layout``."""
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        return json.dumps(text, ensure_ascii=True), True


def encode(run: Run, stored: StoredSteps) -> bytes:
    """The Parquet bytes of a run whose stored columns are `stored`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, k = stored.topk_ids.shape
    counts = np.fromiter((s.n_tokens for s in run.sequences), np.int64, len(run.sequences))
    # Row layout: each sequence's steps, or one placeholder row (step -1) when it has none.
    rows_per_seq = np.maximum(counts, 1)
    n_rows = int(rows_per_seq.sum())
    first_row = np.cumsum(rows_per_seq) - rows_per_seq
    seq = np.repeat(np.arange(len(counts), dtype=np.int32), rows_per_seq)
    step = (np.arange(n_rows, dtype=np.int64) - np.repeat(first_row, rows_per_seq)).astype(np.int32)
    is_step = np.repeat(counts > 0, rows_per_seq)
    step[~is_step] = -1
    where = np.flatnonzero(is_step)  # row of each stored step, in (seq, step) order

    def per_row(values: np.ndarray) -> np.ndarray:
        out = np.zeros(n_rows, np.int32)
        out[where] = values
        return out

    def list_column(values: np.ndarray, width: int) -> pa.Array:
        # A plain list (not fixed-size: that cannot have width 0, as the gaps have at K=1);
        # placeholder rows are null and hold no values.
        offsets = np.concatenate([[0], np.cumsum(np.where(is_step, width, 0))]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.reshape(-1).astype(np.int32)),
                                        mask=pa.array(~is_step))

    codes = stored.topk_codes.astype(np.int64)
    gaps = (codes[:, 1:] - codes[:, :-1]) if k else np.zeros((n, 0), np.int64)  # >= 0 when sorted
    null = ~is_step
    texts, escaped = zip(*(_utf8_text(s.text) for s in run.sequences)) if run.sequences else ((), ())
    seq_cell = np.full(n_rows, -1, np.int64)
    seq_cell[first_row] = np.arange(len(counts))

    def at_first(values: list, typ) -> pa.Array:
        return pa.array([values[i] if i >= 0 else None for i in seq_cell], type=typ)

    table = pa.table({
        "seq": pa.array(seq), "step": pa.array(step),
        "token_id": pa.array(per_row(stored.token_id), mask=null),
        "logprob_code": pa.array(per_row(stored.logprob_code), mask=null),
        "topk_ids": list_column(stored.topk_ids, k),
        "top1_logprob_code": pa.array(per_row(stored.topk_codes[:, 0] if k else np.zeros(n, np.int32)), mask=null | (k == 0)),
        "topk_logprob_gaps": list_column(gaps.astype(np.int32), max(k - 1, 0)),
        "prompt_id": at_first([s.prompt_id for s in run.sequences], pa.string()),
        "prompt_token_ids": at_first([[int(t) for t in s.prompt_token_ids] for s in run.sequences], pa.list_(pa.int32())),
        "text": at_first(list(texts), pa.string()),
        "finish_reason": at_first([s.finish_reason for s in run.sequences], pa.string()),
        "n_tokens": at_first([int(c) for c in counts], pa.int32()),
    })
    layout = {"k": int(k), "n_tokens": int(n), "n_sequences": len(run.sequences),
              "logprob_mantissa_bits": LOGPROB_MANTISSA_BITS, "decoding": decoding(), "text_json_escaped": [i for i, e in enumerate(escaped) if e]}
    buf = io.BytesIO()
    # store_schema=False: the Arrow schema would embed the key-value metadata a second time, base64'd.
    writer = pq.ParquetWriter(
        buf, table.schema, compression="zstd", compression_level=ZSTD_LEVEL, store_schema=False,
        write_statistics=False, use_dictionary=["seq", "finish_reason"],
        column_encoding={
            "step": "DELTA_BINARY_PACKED", "token_id": "PLAIN", "logprob_code": "BYTE_STREAM_SPLIT",
            "topk_ids.list.element": "PLAIN", "top1_logprob_code": "BYTE_STREAM_SPLIT",
            "topk_logprob_gaps.list.element": "BYTE_STREAM_SPLIT",
        },
    )
    try:
        writer.write_table(table, row_group_size=max(1, table.num_rows))
        writer.add_key_value_metadata({
            KEY_SCHEMA: str(SCHEMA_VERSION).encode(),
            KEY_META: canonical(dataclasses.asdict(run.meta)),
            KEY_LAYOUT: canonical(layout),
        })
    finally:
        writer.close()
    return buf.getvalue()


def parse_kv(where: str, kv: dict[bytes, bytes] | None, *, rerecord: str) -> tuple[RunMeta, dict]:
    """Meta and layout from the key-value metadata; refuses foreign files and other schemas."""
    kv = kv or {}
    if KEY_SCHEMA not in kv:
        raise DataError(f"{where}: not a diffcheck run (Parquet without diffcheck metadata)")
    try:
        version = int(kv[KEY_SCHEMA])
    except ValueError:
        raise DataError(f"{where}: diffcheck.schema_version is not an integer ({kv[KEY_SCHEMA][:20]!r})") from None
    if version > SCHEMA_VERSION:
        raise DataError(f"{where}: written by a newer diffcheck (schema {version} > {SCHEMA_VERSION}); upgrade diffcheck")
    if version < SCHEMA_VERSION:
        # Schema 1 stored float16 logprobs at another precision; converting would round twice and
        # break exact comparison with fresh recordings, so the run is recorded again instead.
        raise DataError(f"{where}: written by an older diffcheck (schema {version} < {SCHEMA_VERSION}, "
                        f"another logprob precision); {rerecord}")
    try:
        meta_d = json.loads(kv[KEY_META])
        layout = json.loads(kv[KEY_LAYOUT])
        fields = {f.name for f in dataclasses.fields(RunMeta)}
        meta = RunMeta(**{k: v for k, v in meta_d.items() if k in fields})
        int(layout["k"]), int(layout["n_tokens"]), int(layout["n_sequences"])
        if int(layout["logprob_mantissa_bits"]) != LOGPROB_MANTISSA_BITS:
            raise ValueError(f"logprob_mantissa_bits {layout['logprob_mantissa_bits']} is not {LOGPROB_MANTISSA_BITS}")
    except KeyError as exc:
        raise DataError(f"{where}: diffcheck metadata lacks {exc}") from None
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: diffcheck metadata is malformed ({type(exc).__name__}: {exc})") from None
    return meta, layout


def _ints(where: str, arr, name: str, *, rows: np.ndarray) -> np.ndarray:
    """int32 values of a flat column at `rows`, which must not be null there."""
    if len(rows) and arr.take(rows).null_count:
        raise DataError(f"{where}: column {name} holds nulls on step rows")
    return np.asarray(arr.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)[rows].astype(np.int32)


def _int_lists(where: str, arr, name: str, *, rows: np.ndarray, width: int) -> np.ndarray:
    import pyarrow.compute as pc

    sub = arr.take(rows)
    if sub.null_count or (len(sub) and sub.flatten().null_count):
        raise DataError(f"{where}: column {name} holds nulls on step rows")
    lengths = pc.list_value_length(sub).to_numpy(zero_copy_only=False)
    if len(sub) and not (lengths == width).all():
        raise DataError(f"{where}: {name} lists are not all of length {width} (diffcheck.layout k)")
    return np.asarray(sub.flatten().to_numpy(zero_copy_only=False), dtype=np.int64).astype(np.int32).reshape(len(sub), width)


def decode(where: str, pf, *, rerecord: str) -> Run:
    """The run in an opened `pyarrow.parquet.ParquetFile`; every inconsistency is a one-line DataError."""
    import pyarrow as pa

    meta, layout = parse_kv(where, pf.metadata.metadata, rerecord=rerecord)
    missing = [c for c in COLUMNS if c not in pf.schema_arrow.names]
    if missing:
        raise DataError(f"{where}: missing columns {', '.join(missing)}")
    try:
        # One thread: Arrow's pool threads could still be joinable when the interpreter exits,
        # and that aborts the process ("terminate called without an active exception", seen once
        # at `golden verify`'s exit, apache/arrow#34314). A run is a few thousand rows.
        table = pf.read(columns=list(COLUMNS), use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{where}: column data is unreadable, truncated or corrupt ({str(exc).splitlines()[0]})") from None
    k, escaped = int(layout["k"]), set(layout.get("text_json_escaped", []))
    try:
        col = {name: table[name].combine_chunks() for name in COLUMNS}
        seq = _ints(where, col["seq"], "seq", rows=np.arange(table.num_rows))
        step = _ints(where, col["step"], "step", rows=np.arange(table.num_rows))
        rows = np.flatnonzero(step >= 0)
        codes = np.zeros((len(rows), k), np.int64)
        if k:
            codes[:, 0] = _ints(where, col["top1_logprob_code"], "top1_logprob_code", rows=rows)
            gaps = _int_lists(where, col["topk_logprob_gaps"], "topk_logprob_gaps", rows=rows, width=k - 1)
            codes[:, 1:] = codes[:, :1] + np.cumsum(gaps, axis=1, dtype=np.int64)
        token_codes = _ints(where, col["logprob_code"], "logprob_code", rows=rows)
        for name, c in (("topk logprob", codes), ("logprob_code", token_codes)):
            # Only codes that writing can produce: others (NaN payloads, out of range) would not
            # survive a read-write cycle unchanged.
            if c.size and not np.array_equal(logprob_codes(logprob_values(np.clip(c, -65536, 65535))), c):
                raise DataError(f"{where}: {name} codes outside what diffcheck writes (diffcheck.layout decoding)")
        steps = Steps(
            seq=seq[rows], step=step[rows], token_id=_ints(where, col["token_id"], "token_id", rows=rows),
            logprob=logprob_values(token_codes),
            topk_ids=_int_lists(where, col["topk_ids"], "topk_ids", rows=rows, width=k),
            topk_logprobs=logprob_values(codes).reshape(len(rows), k),
        )
        firsts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]]) if len(seq) else np.zeros(0, np.int64)
        if not np.array_equal(seq[firsts], np.arange(len(firsts))):
            raise DataError(f"{where}: seq column is not 0, 1, 2, ... in order")
        cells = {name: col[name].take(firsts).to_pylist() for name in SEQUENCE_COLUMNS}
        seqs = []
        for i in range(len(firsts)):
            row = {name: cells[name][i] for name in SEQUENCE_COLUMNS}
            if any(v is None for v in row.values()):
                raise DataError(f"{where}: sequence {i}'s first row lacks "
                                f"{', '.join(n for n, v in row.items() if v is None)}")
            text = json.loads(row["text"]) if i in escaped else row["text"]
            seqs.append(SequenceInfo(prompt_id=row["prompt_id"], prompt_token_ids=tuple(row["prompt_token_ids"]),
                                     text=text, finish_reason=row["finish_reason"], n_tokens=int(row["n_tokens"])))
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise DataError(f"{where}: column types are not diffcheck's ({str(exc).splitlines()[0]})") from None
    if len(seqs) != int(layout["n_sequences"]) or len(rows) != int(layout["n_tokens"]):
        raise DataError(f"{where}: {len(seqs)} sequences and {len(rows)} tokens, diffcheck.layout says "
                        f"{layout['n_sequences']} and {layout['n_tokens']}")
    run = Run(meta=meta, sequences=tuple(seqs), steps=steps)
    checked_steps(run, where=where)
    return run
