"""The golden store: round trip, digests, integrity refusals, atomicity, locking."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffcheck import store
from diffcheck.errors import ConfigError, DataError, LockedError
from diffcheck.types import Run, RunMeta, SequenceInfo, Steps

ROOT = Path(__file__).resolve().parent.parent


def make_run(lengths=(5, 0, 7), *, k=4, seed=0, case_id="J", suite="default", text=None, **meta_kw) -> Run:
    rng = np.random.default_rng(seed)
    n = int(sum(lengths))
    lp = -np.sort(rng.exponential(2.0, (n, k)), axis=1).astype(np.float32)
    ids = rng.integers(0, 49152, (n, k)).astype(np.int32)
    if n:
        lp[0, -1] = -np.inf  # fewer than K candidates: padding
        ids[0, -1] = -1
    token = ids[:, 0].copy()
    seqs = tuple(
        SequenceInfo(prompt_id=f"p{i}", prompt_token_ids=tuple(int(x) for x in rng.integers(0, 49152, 3)),
                     text=text if text is not None else f"sequence {i}: 测试 ２０２４", finish_reason="length" if m else "stop",
                     n_tokens=int(m))
        for i, m in enumerate(lengths)
    )
    meta = dict(suite=suite, case_id=case_id, role="reference", kind="generate",
                engine={"name": "vllm", "version": "0.32.0", "commit": "abc", "dirty": False,
                        "effective": {"dtype": "float32", "enforce_eager": True}},
                model={"id": "smollm2-135m", "path": "/m", "digest": "d" * 64},
                sampling={"temperature": 1.0, "top_p": 0.95, "seed": 1234}, hardware={"cpu": "x"},
                env={"A": "1"}, timings={"generate_s": 1.5}, source={}, created="2026-12-01T00:00:00+00:00",
                diffcheck_version="0.1.0")
    meta.update(meta_kw)
    return Run(meta=RunMeta(**meta), sequences=seqs, steps=Steps(
        seq=np.repeat(np.arange(len(lengths), dtype=np.int32), lengths),
        step=np.concatenate([np.arange(m, dtype=np.int32) for m in lengths]) if lengths else np.zeros(0, np.int32),
        token_id=token, logprob=lp[:, 0].copy(), topk_ids=ids, topk_logprobs=lp))


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
    assert table.column_names == ["seq", "step", "token_id", "logprob", "topk_ids", "topk_logprobs"]
    assert table.num_rows == run.n_tokens
    assert table["topk_ids"].to_pylist()[1] == run.steps.topk_ids[1].tolist()
    assert pa.types.is_float16(table.schema.field("logprob").type)
    kv = table.schema.metadata
    assert int(kv[b"diffcheck.schema_version"]) == store.SCHEMA_VERSION
    rows = json.loads(kv[b"diffcheck.sequences"])
    assert [r["n_tokens"] for r in rows] == [5, 0, 7] and rows[0]["text"] == run.sequences[0].text
    assert json.loads(kv[b"diffcheck.meta"])["engine"]["effective"]["dtype"] == "float32"


def test_quantization_bounds():
    x = np.array([0.0, -0.0, -1e-6, -0.01, -1.0, -1.2345, -8.3, -16.7, -30.1, -np.inf, np.inf, 70000.0], np.float32)
    q = store.quantize_logprobs(x).astype(np.float32)
    finite = np.isfinite(x) & (np.abs(x) < 60000)
    err = np.abs(q[finite] - x[finite])
    assert (err <= 2.0 ** -8 * np.abs(x[finite]) + 1e-7).all(), err
    assert np.isneginf(q[9]) and np.isposinf(q[10]) and np.isposinf(q[11])
    assert q[0] == 0.0
    np.testing.assert_array_equal(store.quantize_logprobs(q).view(np.uint16), store.quantize_logprobs(x).view(np.uint16))
    nans = store.quantize_logprobs(np.array([np.nan, -np.nan], np.float32)).view(np.uint16)
    assert (nans == 0x7E00).all()  # one canonical NaN, so digests do not depend on NaN payloads


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
    assert msg.startswith(f"{path}: blake3 mismatch (manifest ")
    assert "modified after recording" in msg and "diffcheck golden record J --update" in msg
    assert "\n" not in msg
    with pytest.raises(DataError, match="blake3 mismatch"):
        store.read_meta(path)
    [result] = store.verify_folder(path.parent)
    assert not result.ok and "blake3 mismatch" in result.message


def test_truncated_file(golden):
    _, path, _ = golden
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"blake3 mismatch .*manifest says"):
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
    monkeypatch.setattr(store, "SCHEMA_VERSION", 2)
    store.write_run(path, make_run())
    monkeypatch.setattr(store, "SCHEMA_VERSION", 1)
    with pytest.raises(DataError) as info:
        store.read_run(path)
    assert info.value.message == f"{path}: written by a newer diffcheck (schema 2 > 1); upgrade diffcheck"


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
    with pytest.raises(DataError, match="blake3 mismatch"):
        store.read_run(path)
    assert_same_run(store.read_run(path, verify=False), run)


# -- atomicity and locking ------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, time, os
    sys.path.insert(0, {tests!r})
    from test_store import make_run
    from diffcheck import store
    path, phase, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    run = make_run((n, 3), k=20, seed=7)
    real_update, real_write = store._update_manifest, store._atomic_write
    def block(where):
        print(where, flush=True)
        time.sleep(600)
    def update(folder, change):
        real_update(folder, change)
        if phase == "pending":
            block("pending")
    def atomic(p, data):
        real_write(p, data)
        if phase == "replaced" and p.name == os.path.basename(path):
            block("replaced")
    store._update_manifest, store._atomic_write = update, atomic
    print("writing", store.content_digest(run), flush=True)
    store.write_run(path, run)
    print("done", flush=True)
""")


def _start_child(tmp_path: Path, path: Path, phase: str, n: int = 50) -> tuple[subprocess.Popen, str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(ROOT / "tests")))
    proc = subprocess.Popen([sys.executable, str(script), str(path), phase, str(n)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    first = proc.stdout.readline().split()
    assert first and first[0] == "writing", first
    return proc, first[1]


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.parametrize("phase", ["pending", "replaced"])
def test_writer_killed_between_phases_leaves_a_consistent_folder(tmp_path, golden, phase):
    old, path, old_digest = golden
    proc, new_digest = _start_child(tmp_path, path, phase)
    try:
        assert proc.stdout.readline().strip() == phase
        # While the writer is stuck mid-write, the golden still reads and verifies, and a
        # second writer is locked out with the holder's pid.
        got = store.read_run(path)
        assert store.content_digest(got) == (old_digest if phase == "pending" else new_digest)
        with pytest.raises(LockedError, match=rf"pid {proc.pid}\b"):
            store.write_run(path, old)
    finally:
        _kill(proc)
    got = store.read_run(path)
    expect = old_digest if phase == "pending" else new_digest
    assert store.content_digest(got) == expect == store.manifest_entry(path)["content_blake3"]
    assert all(r.ok for r in store.verify_folder(path.parent)), store.verify_folder(path.parent)
    # The dead writer's lock is gone with it; the next write succeeds and cleans up.
    assert store.write_run(path, old) == old_digest
    assert "pending" not in json.loads((path.parent / "MANIFEST.json").read_text())["J.parquet"]
    assert not list(path.parent.glob(".*.tmp"))


def test_writer_killed_at_a_random_moment_of_a_big_write(tmp_path, golden):
    _, path, old_digest = golden
    proc, new_digest = _start_child(tmp_path, path, "none", n=200_000)
    time.sleep(0.3)
    alive = proc.poll() is None
    _kill(proc)
    got = store.read_run(path)
    # A big write takes seconds, so the kill normally lands mid-write and the old golden survives;
    # if the machine was fast enough to finish, the new golden must be complete instead.
    assert store.content_digest(got) in ({old_digest} if alive else {old_digest, new_digest})
    assert all(r.ok for r in store.verify_folder(path.parent))


def test_second_writer_in_process_is_locked_out(golden):
    run, path, _ = golden
    with store._flock(path.parent / f"{path.name}.lock", blocking=False, target=path):
        with pytest.raises(LockedError) as info:
            store.write_run(path, run)
    assert info.value.message == (f"{path}: another writer holds {path.name}.lock (pid {os.getpid()}); "
                                  "wait for it to finish")
    assert store.write_run(path, run)  # released


def test_text_with_lone_surrogate_round_trips(tmp_path):
    run = make_run((2,), text="broken \ud800 decode")
    path = tmp_path / "S.parquet"
    digest = store.write_run(path, run)
    got = store.read_run(path)
    assert got.sequences[0].text == "broken \ud800 decode"
    assert store.content_digest(got) == digest and store.output_digest(got) == store.output_digest(run)
