"""The golden store: round trip, digests, integrity refusals, atomicity, locking."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffcheck.storage import store, codec as store_format
from diffcheck.core.errors import ConfigError, DataError, LockedError
from diffcheck.core.types import Run

import factories

ROOT = Path(__file__).resolve().parent.parent


STORE_META = dict(
    engine={"name": "vllm", "version": "0.32.0", "commit": "abc", "dirty": False,
            "effective": {"dtype": "float32", "enforce_eager": True}},
    model={"id": "smollm2-135m", "path": "/m", "digest": "d" * 64},
    sampling={"temperature": 1.0, "top_p": 0.95, "seed": 1234}, hardware={"cpu": "x"},
    env={"A": "1"}, timings={"generate_s": 1.5}, source={}, created="2026-12-01T00:00:00+00:00",
    diffcheck_version="0.1.0",
)


def make_run(lengths=(5, 0, 7), *, k=4, seed=0, case_id="J", suite="default", text=None, **meta_kw) -> Run:
    """`factories.make_run` with random top-k, every meta field set, and step 0's last top-k slot padded."""
    run = factories.make_run(
        lengths=lengths, k=k, seed=seed, case_id=case_id, suite=suite,
        texts=text if text is not None else [f"sequence {i}: 测试 ２０２４" for i in range(len(lengths))],
        prompt_token_ids=[(i, 49151 - i, 7 * i) for i in range(len(lengths))],
        finish_reasons=["length" if m else "stop" for m in lengths],
        **{**STORE_META, **meta_kw},
    )
    if run.n_tokens:  # fewer than K candidates: padding
        run.steps.topk_logprobs[0, -1] = -np.inf
        run.steps.topk_ids[0, -1] = -1
    return run


def assert_same_run(got: Run, want: Run) -> None:
    """`got` equals `want` exactly up to the store's documented quantization."""
    q = store.quantize(want)
    for name in ("seq", "step", "token_id", "topk_ids"):
        np.testing.assert_array_equal(getattr(got.steps, name), getattr(want.steps, name))
    for name in ("logprob", "topk_logprobs"):
        a, b = getattr(got.steps, name), getattr(q.steps, name)
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)  # bit-exact against the in-memory quantization
    assert got.sequences == want.sequences
    assert got.meta == want.meta


@pytest.fixture
def golden(tmp_path):
    run = make_run()
    path = store.run_path(tmp_path, "default", "J")
    digest = store.write_run(path, run)
    return run, path, digest


# -- layout and round trip -------------------------------------------------------------------------


def test_run_path_layout(tmp_path):
    assert store.run_path(tmp_path, "s", "J") == tmp_path / "s" / "J.parquet"
    assert store.run_path(tmp_path, "s", "O", role="candidate") == tmp_path / "s" / "O.run.parquet"
    assert store.run_path(tmp_path, "s", "O", kind="forced", reference="J") == tmp_path / "s" / "O.forced-J.parquet"
    assert store.run_path(tmp_path, "s", "O", kind="scored", reference="J") == tmp_path / "s" / "O.scored-J.parquet"
    with pytest.raises(ConfigError, match="reference"):
        store.run_path(tmp_path, "s", "O", kind="forced")
    with pytest.raises(ConfigError, match="kind 'bogus'"):
        store.run_path(tmp_path, "s", "O", kind="bogus")
    with pytest.raises(ConfigError, match="case id"):
        store.run_path(tmp_path, "s", "../etc")


def test_round_trip_exact_up_to_quantization(golden):
    run, path, digest = golden
    got = store.read_run(path)
    assert_same_run(got, run)
    assert store.content_digest(got) == digest == store.content_digest(run)
    assert store.output_digest(got) == store.output_digest(run)
    assert np.isneginf(got.steps.topk_logprobs[0, -1]) and got.steps.topk_ids[0, -1] == -1
    entry = store.manifest_entry(path)
    assert entry["content_blake3"] == digest and entry["n_tokens"] == run.n_tokens == 12
    assert entry["bytes"] == path.stat().st_size and entry["schema_version"] == store.SCHEMA_VERSION
    assert "pending" not in json.loads((path.parent / "MANIFEST.json").read_text())["J.parquet"]
    assert store.read_meta(path) == run.meta
    assert store.verify_folder(path.parent) == [store.VerifyResult(path, True, "")]


def test_empty_sequences_round_trip(tmp_path):
    for lengths in [(0,), (0, 0, 3, 0), ()]:
        run = make_run(lengths, k=5)
        path = tmp_path / f"E{len(lengths)}.parquet"
        digest = store.write_run(path, run)
        got = store.read_run(path)
        assert_same_run(got, run)
        assert got.steps.topk_ids.shape == (sum(lengths), 5)
        assert [s.n_tokens for s in got.sequences] == list(lengths)
        assert store.content_digest(got) == digest


def test_plain_pyarrow_reads_the_file(golden):
    run, path, _ = golden
    table = pq.read_table(path)  # no diffcheck, no pandas
    assert table.column_names == ["seq", "step", "token_id", "logprob_code", "topk_ids", "top1_logprob_code",
                                  "topk_logprob_gaps", "prompt_id", "prompt_token_ids", "text", "finish_reason",
                                  "n_tokens"]
    assert table.num_rows == run.n_tokens + 1  # sequence 1 generated nothing: one step -1 row
    rows = table.to_pylist()
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, -1, 0, 1, 2, 3, 4, 5, 6]
    steps = [r for r in rows if r["step"] >= 0]
    assert [r["topk_ids"] for r in steps] == run.steps.topk_ids.tolist()
    # The documented decoding, by hand: code[r] = code[r-1] + gap; -logprob = (1 + f) * 2^(e - 15).
    def decode(c):
        e, f = c >> 6, (c & 63) / 64
        return -np.inf if c == 1984 else -(1 + f) * 2.0 ** (e - 15) if e else -f * 2.0 ** -14

    q = store.quantize(run).steps
    for i, r in enumerate(steps):
        codes = np.concatenate([[r["top1_logprob_code"]], r["top1_logprob_code"] + np.cumsum(r["topk_logprob_gaps"])])
        assert (np.diff(codes) >= 0).all()  # sorted logprobs: non-negative gaps
        np.testing.assert_array_equal([decode(int(c)) for c in codes], q.topk_logprobs[i])
        assert decode(r["logprob_code"]) == q.logprob[i]
    firsts = [r for r in rows if r["prompt_id"] is not None]
    assert [(r["seq"], r["n_tokens"], r["text"], r["finish_reason"]) for r in firsts] == [
        (i, s.n_tokens, s.text, s.finish_reason) for i, s in enumerate(run.sequences)]
    assert firsts[2]["prompt_token_ids"] == list(run.sequences[2].prompt_token_ids)
    assert sum(r["text"] is not None for r in rows) == len(run.sequences)
    kv = table.schema.metadata
    assert int(kv[b"diffcheck.schema_version"]) == store.SCHEMA_VERSION == 2
    layout = json.loads(kv[b"diffcheck.layout"])
    assert layout["logprob_mantissa_bits"] == 6 and "code[r] = code[r-1] + topk_logprob_gaps[r-1]" in layout["decoding"]
    assert json.loads(kv[b"diffcheck.meta"])["engine"]["effective"]["dtype"] == "float32"


def test_quantization_bounds():
    x = np.array([0.0, -0.0, -1e-3, -0.01, -1.0, -1.2345, -8.3, -16.7, -30.1, -1000.3, -np.inf, np.inf, -7e4, 0.7],
                 np.float32)
    q = store.quantize_logprobs(x)
    assert q.dtype == np.float32
    finite = np.isfinite(x) & (np.abs(x) < 65000)
    err = np.abs(q[finite].astype(np.float64) - x[finite].astype(np.float64))
    assert (err <= (2.0 ** -7 + 2.0 ** -11) * np.abs(x[finite]) + 2.0 ** -21).all(), err  # 6 mantissa bits
    dense = -np.linspace(0, 60, 20001).astype(np.float32)
    assert (np.abs(store.quantize_logprobs(dense) - dense) <= (2.0 ** -7 + 2.0 ** -11) * -dense + 2.0 ** -21).all()
    assert np.isneginf(q[10]) and np.isposinf(q[11]) and np.isneginf(q[12])
    assert q[0] == 0.0 and q[1] == 0.0 and abs(q[13] - 0.7) <= 0.7 * 2 ** -7
    np.testing.assert_array_equal(store.quantize_logprobs(q), q)  # idempotent
    nans = store.quantize_logprobs(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(nans).all()
    codes = store_format.logprob_codes(np.array([np.nan, -np.nan, -np.inf], np.float32))
    assert codes.tolist() == [2016, 2016, 1984]  # one NaN, so digests do not depend on NaN payloads


def test_every_code_round_trips_exactly(tmp_path):
    """Every finite code of -65024..0 and of small positive values, -inf padding and NaN come back
    bit-exactly; rows need not be sorted."""
    codes = np.concatenate([np.arange(0, 1984), np.arange(-2, -40, -1), [1984, 2016]]).astype(np.int32)
    values = store_format.logprob_values(codes)
    np.testing.assert_array_equal(store_format.logprob_codes(values), codes)
    k = 5
    n = -(-len(values) // k)
    lp = np.full(n * k, -np.inf, np.float32)
    lp[: len(values)] = values
    lp = lp.reshape(n, k)
    run = make_run((n,), k=k)
    run = dataclasses.replace(run, steps=dataclasses.replace(run.steps, topk_logprobs=lp, logprob=lp[:, 1].copy()))
    path = tmp_path / "G.parquet"
    digest = store.write_run(path, run)
    got = store.read_run(path)
    np.testing.assert_array_equal(got.steps.topk_logprobs, lp)  # NaN == NaN here
    np.testing.assert_array_equal(got.steps.logprob, lp[:, 1])
    assert store.content_digest(got) == digest


def test_codes_a_writer_cannot_produce_are_refused(tmp_path):
    run = make_run((3,), k=4)
    path = tmp_path / "B.parquet"
    store.write_run(path, run)
    table = pq.read_table(path)
    bad = table.set_column(table.column_names.index("top1_logprob_code"), "top1_logprob_code",
                           pa.array([2000, 0, 0], pa.int32()))  # a NaN payload no writer emits
    pq.write_table(bad, path)
    with pytest.raises(DataError, match="codes outside what diffcheck writes"):
        store.read_run(path, verify=False)


def test_padding_rows_round_trip_as_minus_inf(tmp_path):
    run = make_run((6,), k=6, seed=3)
    lp = run.steps.topk_logprobs.copy()
    ids = run.steps.topk_ids.copy()
    for i in range(6):  # row i has i candidates; row 0 has none at all
        lp[i, i:] = -np.inf
        ids[i, i:] = -1
    run = dataclasses.replace(run, steps=dataclasses.replace(run.steps, topk_logprobs=lp, topk_ids=ids))
    path = tmp_path / "P.parquet"
    store.write_run(path, run)
    got = store.read_run(path)
    assert_same_run(got, run)
    assert (np.isneginf(got.steps.topk_logprobs) == np.isneginf(lp)).all()
    assert (got.steps.topk_ids == -1).sum() == 21


def test_zero_token_sequences_have_a_placeholder_row(tmp_path):
    run = make_run((0, 2, 0), k=3)
    path = tmp_path / "Z.parquet"
    store.write_run(path, run)
    rows = pq.read_table(path).to_pylist()
    assert [(r["seq"], r["step"], r["token_id"], r["n_tokens"]) for r in rows] == [
        (0, -1, None, 0), (1, 0, int(run.steps.token_id[0]), 2), (1, 1, int(run.steps.token_id[1]), None),
        (2, -1, None, 0)]
    got = store.read_run(path)
    assert [s.n_tokens for s in got.sequences] == [0, 2, 0] and got.sequences == run.sequences


def test_older_schema_is_refused_with_the_rerecord_command(tmp_path, monkeypatch):
    from diffcheck.storage import codec as store_format

    path = tmp_path / "default" / "J.parquet"
    monkeypatch.setattr(store_format, "SCHEMA_VERSION", 1)
    store.write_run(path, make_run())
    monkeypatch.undo()
    with pytest.raises(DataError) as info:
        store.read_run(path)
    assert info.value.message == (f"{path}: written by an older diffcheck (schema 1 < 2, another logprob precision); "
                                  "re-record with `diffcheck golden record J --update`")
    with pytest.raises(DataError, match="older diffcheck"):
        store.read_meta(path)


def test_content_digest_covers_content_not_circumstances():
    run = make_run()
    d = store.content_digest(run)
    later = dataclasses.replace(run, meta=dataclasses.replace(
        run.meta, created="2030-01-01", timings={"generate_s": 99.0}, hardware={"cpu": "other"},
        diffcheck_version="9", env={"B": "2"}))
    assert store.content_digest(later) == d
    for change in ({"sampling": {"temperature": 0.5}}, {"case_id": "K"}, {"source": {"config_digest": "x"}},
                   {"model": {"digest": "e" * 64}},
                   {"engine": {**run.meta.engine, "effective": {"dtype": "bfloat16"}}}):
        other = dataclasses.replace(run, meta=dataclasses.replace(run.meta, **change))
        assert store.content_digest(other) != d, change
    bumped = run.steps.topk_logprobs.copy()
    bumped[3, 1] -= 0.5
    assert store.content_digest(dataclasses.replace(run, steps=dataclasses.replace(run.steps, topk_logprobs=bumped))) != d
    # A change below the stored precision is the same content.
    tiny = run.steps.topk_logprobs * np.float32(1 + 1e-6)
    same = dataclasses.replace(run, steps=dataclasses.replace(run.steps, topk_logprobs=tiny))
    assert store.content_digest(same) == store.content_digest(store.quantize(same))


def test_output_digest_groups_equal_outputs_across_cases():
    a = make_run(case_id="E")
    b = make_run(case_id="G", sampling={"temperature": 0.1})
    b = dataclasses.replace(b, steps=dataclasses.replace(b.steps, logprob=b.steps.logprob - 1))
    assert store.output_digest(a) == store.output_digest(b)
    assert store.content_digest(a) != store.content_digest(b)
    c = make_run(case_id="G", text="different text")
    assert store.output_digest(c) != store.output_digest(a)


def test_inconsistent_run_is_refused(tmp_path):
    run = make_run()
    bad = dataclasses.replace(run, sequences=run.sequences[:2])
    with pytest.raises(DataError, match="sequences declare 5 tokens, the step columns hold 12"):
        store.write_run(tmp_path / "X.parquet", bad)
    assert not (tmp_path / "X.parquet").exists()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(0, 6), min_size=0, max_size=4),
    k=st.integers(0, 5),
    seed=st.integers(0, 2**16),
    text=st.text(max_size=20),
    scale=st.floats(0.01, 40.0),
)
def test_round_trip_property(tmp_path_factory, lengths, k, seed, text, scale):
    run = make_run(tuple(lengths), k=max(k, 1), seed=seed, text=text)
    lp = run.steps.topk_logprobs * np.float32(scale)
    run = dataclasses.replace(run, steps=dataclasses.replace(run.steps, topk_logprobs=lp, logprob=lp[:, 0].copy()))
    path = tmp_path_factory.mktemp("prop") / "P.parquet"
    digest = store.write_run(path, run)
    got = store.read_run(path)
    assert_same_run(got, run)
    assert store.content_digest(got) == digest


# -- integrity refusals ---------------------------------------------------------------------------


def test_tampered_file_is_refused_naming_it(golden):
    _, path, _ = golden
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DataError) as info:
        store.read_run(path)
    msg = info.value.message
    assert msg.startswith(f"{path}: digest differs from the manifest (blake3 ")
    assert "modified after recording" in msg and "diffcheck golden record J --update" in msg
    assert "\n" not in msg
    with pytest.raises(DataError, match="digest differs from the manifest"):
        store.read_meta(path)
    [result] = store.verify_folder(path.parent)
    assert not result.ok and "digest differs from the manifest" in result.message


def test_truncated_file(golden):
    _, path, _ = golden
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=rf"J.parquet: {len(data) // 2} bytes, manifest says {len(data)}; "):
        store.read_run(path)
    (path.parent / "MANIFEST.json").unlink()  # without a manifest the format check still catches it
    with pytest.raises(DataError) as info:
        store.read_run(path)
    assert info.value.message.startswith(f"{path}: not a readable Parquet file")
    path.write_bytes(b"")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        store.read_meta(path)


def test_non_parquet_and_foreign_parquet(tmp_path):
    text = tmp_path / "T.parquet"
    text.write_text("hello, not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        store.read_run(text)
    foreign = tmp_path / "F.parquet"
    pq.write_table(pa.table({"x": [1, 2, 3]}), foreign)
    with pytest.raises(DataError) as info:
        store.read_run(foreign)
    assert info.value.message == f"{foreign}: not a diffcheck run (Parquet without diffcheck metadata)"


def test_file_missing_from_existing_manifest_is_refused(golden):
    _, path, _ = golden
    stranger = path.parent / "K.parquet"
    stranger.write_bytes(path.read_bytes())
    with pytest.raises(DataError, match=r"K.parquet: not in manifest"):
        store.read_run(stranger)
    results = {r.path.name: r for r in store.verify_folder(path.parent)}
    assert results["J.parquet"].ok and not results["K.parquet"].ok


def test_listed_but_missing_file_fails_verification(golden):
    _, path, _ = golden
    path.unlink()
    [result] = store.verify_folder(path.parent)
    assert not result.ok and "listed in MANIFEST.json but missing" in result.message
    with pytest.raises(DataError, match="not found"):
        store.read_run(path)


def test_newer_schema_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "N.parquet"
    from diffcheck.storage import codec as store_format

    monkeypatch.setattr(store_format, "SCHEMA_VERSION", 3)
    store.write_run(path, make_run())
    monkeypatch.undo()
    with pytest.raises(DataError) as info:
        store.read_run(path)
    assert info.value.message == f"{path}: written by a newer diffcheck (schema 3 > 2); upgrade diffcheck"


def test_corrupt_manifest_is_refused(golden):
    _, path, _ = golden
    (path.parent / "MANIFEST.json").write_text("{not json")
    with pytest.raises(DataError, match=r"MANIFEST.json: not valid JSON"):
        store.read_run(path)


def test_verify_false_skips_only_the_manifest_check(golden):
    run, path, _ = golden
    entry = json.loads((path.parent / "MANIFEST.json").read_text())
    entry["J.parquet"]["file_blake3"] = "0" * 64
    (path.parent / "MANIFEST.json").write_text(json.dumps(entry))
    with pytest.raises(DataError, match=r"digest differs from the manifest \(blake3 \w+\.\., manifest 000000000000\.\.\)"):
        store.read_run(path)
    assert_same_run(store.read_run(path, verify=False), run)


# -- atomicity and locking ------------------------------------------------------------------------

# A writer that stops at a chosen point of `store.write_run` and waits there on its stdin, which
# the test holds open and never writes to: it is certainly alive, and mid-write, when killed.
#   pending:  after the manifest's "pending" entry, before the data file is written
#   partial:  half of the data written to the temp file (not flushed to disk, not renamed)
#   replaced: the data file replaced, the manifest not yet committed
CHILD = textwrap.dedent("""
    import builtins, os, sys
    sys.path.insert(0, {tests!r})
    from factories import make_run
    from diffcheck.storage import store
    path, phase = sys.argv[1], sys.argv[2]
    run = make_run(lengths=(50, 3), k=20, seed=7)
    real_update, real_write = store._update_manifest, store._atomic_write
    def block(where):
        print(where, flush=True)
        sys.stdin.readline()  # returns only if the test goes away first
        os._exit(3)
    def update(folder, change):
        real_update(folder, change)
        if phase == "pending":
            block("pending")
    def atomic(p, data):
        real_write(p, data)
        if phase == "replaced" and p.name == os.path.basename(path):
            block("replaced")
    class HalfWriter:
        def __init__(self, f):
            self.f = f
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self.f.__exit__(*exc)
        def __getattr__(self, name):
            return getattr(self.f, name)
        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            block("partial")
    def opener(file, mode="r", *args, **kwargs):
        f = builtins.open(file, mode, *args, **kwargs)
        if phase == "partial" and os.path.basename(file).startswith("." + os.path.basename(path) + "."):
            return HalfWriter(f)
        return f
    store._update_manifest, store._atomic_write, store.open = update, atomic, opener
    print("writing", store.content_digest(run), flush=True)
    store.write_run(path, run)
    print("done", flush=True)
""")


def _start_child(tmp_path: Path, path: Path, phase: str) -> tuple[subprocess.Popen, str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(ROOT / "tests")))
    proc = subprocess.Popen([sys.executable, str(script), str(path), phase], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    first = proc.stdout.readline().split()
    assert first and first[0] == "writing", first
    return proc, first[1]


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL  # killed while blocked, not finished
    proc.stdin.close()
    proc.stdout.close()


@pytest.mark.parametrize("phase", ["pending", "partial", "replaced"])
def test_writer_killed_mid_write_leaves_a_consistent_folder(tmp_path, golden, phase):
    old, path, old_digest = golden
    proc, new_digest = _start_child(tmp_path, path, phase)
    expect = new_digest if phase == "replaced" else old_digest
    try:
        assert proc.stdout.readline().strip() == phase
        if phase == "partial":
            (temp,) = path.parent.glob(f".{path.name}.{proc.pid}.tmp")
            assert temp.stat().st_size > 0
        # While the writer is stuck mid-write, the golden still reads and verifies, and a
        # second writer is locked out with the holder's pid.
        got = store.read_run(path)
        assert store.content_digest(got) == expect
        with pytest.raises(LockedError, match=rf"pid {proc.pid}\b"):
            store.write_run(path, old)
    finally:
        _kill(proc)
    got = store.read_run(path)
    assert store.content_digest(got) == expect == store.manifest_entry(path)["content_blake3"]
    assert all(r.ok for r in store.verify_folder(path.parent)), store.verify_folder(path.parent)
    # The dead writer's lock is gone with it; the next write succeeds and cleans up.
    assert store.write_run(path, old) == old_digest
    assert "pending" not in json.loads((path.parent / "MANIFEST.json").read_text())["J.parquet"]
    assert not list(path.parent.glob(".*.tmp"))


def test_second_writer_in_process_is_locked_out(golden):
    run, path, _ = golden
    with store._flock(path.parent / f"{path.name}.lock", blocking=False, target=path):
        with pytest.raises(LockedError) as info:
            store.write_run(path, run)
    assert info.value.message == (f"{path}: another writer holds {path.name}.lock (pid {os.getpid()}); "
                                  "wait for it to finish")
    assert store.write_run(path, run)  # released


def test_a_lock_left_before_the_manifest_named_its_file_goes_with_the_next_write(golden):
    # A writer killed between taking k.parquet's lock and its first manifest update leaves
    # k.parquet.lock for a file the manifest never heard of (test_kill_anywhere saw it under load).
    run, path, _ = golden
    folder = path.parent
    (folder / "k.parquet.lock").write_text("999999\n")
    with store._flock(folder / "live.parquet.lock", blocking=False, target=folder / "live.parquet"):
        store.write_run(folder / "other.parquet", run)  # meanwhile a live first write holds its own lock
        assert (folder / "live.parquet.lock").exists()
    assert sorted(p.name for p in folder.glob("*.lock")) == []
    assert "k.parquet" not in json.loads((folder / "MANIFEST.json").read_text())


def test_text_with_lone_surrogate_round_trips(tmp_path):
    run = make_run((2,), text="broken \ud800 decode")
    path = tmp_path / "S.parquet"
    digest = store.write_run(path, run)
    got = store.read_run(path)
    assert got.sequences[0].text == "broken \ud800 decode"
    assert store.content_digest(got) == digest and store.output_digest(got) == store.output_digest(run)
