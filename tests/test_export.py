"""`diffcheck golden export`: goldens as plain float logprobs, read back by pyarrow."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from diffcheck.cli import main
from diffcheck.storage import store
from factories import make_run, write_suite

K = 6


@pytest.fixture
def golden(tmp_path):
    """A golden with short top-k lists (padded) in places and one step without a logprob."""
    run = make_run(lengths=(7, 0, 5), k=K, seed=4, texts=["a", "", "b"], prompt_ids=["first", "empty", "third"],
                   case_id="J", suite="ex")
    ids, lps, lp = run.steps.topk_ids.copy(), run.steps.topk_logprobs.copy(), run.steps.logprob.copy()
    ids[2, 4:], lps[2, 4:] = -1, -np.inf  # a list of 4
    ids[9, 1:], lps[9, 1:] = -1, -np.inf  # a list of 1
    lp[3] = np.nan
    run = make_run(lengths=(7, 0, 5), topk_ids=[ids[:7], ids[7:7], ids[7:]], topk_logprobs=[lps[:7], lps[7:7], lps[7:]],
                   logprobs=[lp[:7], lp[7:7], lp[7:]], k=K, texts=["a", "", "b"],
                   prompt_ids=["first", "empty", "third"], case_id="J", suite="ex")
    path = tmp_path / "goldens" / "ex" / "J.parquet"
    store.write_run(path, run)
    return path


def _expected(path):
    """The stored values, as the store reads them: the oracle."""
    run = store.read_run(path)
    st = run.steps
    pids = [s.prompt_id for s in run.sequences for _ in range(s.n_tokens)]
    rows = []
    for i in range(len(st)):
        keep = st.topk_ids[i] >= 0
        rows.append({"seq": int(st.seq[i]), "prompt_id": pids[i], "step": int(st.step[i]),
                     "token_id": int(st.token_id[i]), "logprob": st.logprob[i],
                     "topk_ids": st.topk_ids[i][keep].tolist(), "topk_logprobs": st.topk_logprobs[i][keep]})
    return rows


def _same_float32(got, want) -> bool:
    if want is None or (isinstance(want, (float, np.floating)) and math.isnan(want)):
        return got is None
    return got is not None and np.float32(got) == np.float32(want)


def test_parquet_export_reads_back_as_the_stored_values(golden, tmp_path, capsys):
    out = tmp_path / "out" / "J.parquet"
    assert main(["golden", "export", str(golden), "--out", str(out)]) == 0
    assert f"wrote {out} (parquet: 12 rows, 3 sequences, top-{K})" in capsys.readouterr().out
    table = pq.read_table(out)
    assert table.column_names == ["seq", "prompt_id", "step", "token_id", "logprob", "topk_ids", "topk_logprobs"]
    import pyarrow as pa

    assert table.schema.field("logprob").type == pa.float32()
    assert table.schema.field("topk_ids").type.value_type == pa.int32()
    assert table.schema.field("topk_logprobs").type.value_type == pa.float32()
    rows, want = table.to_pylist(), _expected(golden)
    assert len(rows) == len(want) == 12
    assert [len(r["topk_ids"]) for r in rows].count(K) == 10 and sorted({len(r["topk_ids"]) for r in rows}) == [1, 4, K]
    for got, exp in zip(rows, want):
        assert {k: got[k] for k in ("seq", "prompt_id", "step", "token_id", "topk_ids")} == \
               {k: exp[k] for k in ("seq", "prompt_id", "step", "token_id", "topk_ids")}
        assert _same_float32(got["logprob"], exp["logprob"])
        assert np.array_equal(np.asarray(got["topk_logprobs"], np.float32), exp["topk_logprobs"])
    assert rows[3]["logprob"] is None
    meta = table.schema.metadata
    assert meta[b"diffcheck.case_id"] == b"J" and meta[b"diffcheck.content_blake3"] == \
        store.content_digest(store.read_run(golden)).encode()


def test_csv_export_by_suite_and_id_has_topk_columns(golden, tmp_path, monkeypatch, capsys):
    suite = write_suite(tmp_path / "cases", name="ex")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "J.csv"
    assert main(["golden", "export", "J", "--suite", str(suite), "--goldens", str(tmp_path / "goldens"),
                 "--out", str(out)]) == 0  # csv from the suffix
    assert f"from {golden}" in capsys.readouterr().out
    table = pacsv.read_csv(out)
    assert table.column_names == ["seq", "prompt_id", "step", "token_id", "logprob"] + [
        f"top{j}_{w}" for j in range(1, K + 1) for w in ("id", "logprob")]
    got = table.to_pylist()
    for row, exp in zip(got, _expected(golden), strict=True):
        assert (row["seq"], row["prompt_id"], row["step"], row["token_id"]) == (
            exp["seq"], exp["prompt_id"], exp["step"], exp["token_id"])
        assert _same_float32(row["logprob"], exp["logprob"])
        ids = [row[f"top{j}_id"] for j in range(1, K + 1)]
        lps = [row[f"top{j}_logprob"] for j in range(1, K + 1)]
        n = len(exp["topk_ids"])
        assert ids[:n] == exp["topk_ids"] and ids[n:] == [None] * (K - n)
        assert all(_same_float32(g, w) for g, w in zip(lps[:n], exp["topk_logprobs"])) and lps[n:] == [None] * (K - n)


def test_export_replaces_atomically_and_refuses_bad_input(golden, tmp_path, capsys):
    out = tmp_path / "J.csv"
    out.write_text("old")
    assert main(["golden", "export", str(golden), "--format", "parquet", "--out", str(out)]) == 0
    assert pq.read_table(out).num_rows == 12  # --format wins over the suffix; the old file is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["J.csv", "goldens"]  # no temp file left
    capsys.readouterr()
    assert main(["golden", "export", str(golden), "--out", str(golden)]) == 2
    assert "the export would overwrite the run it reads" in capsys.readouterr().err
    assert store.read_run(golden).n_tokens == 12
    assert main(["golden", "export", str(golden), "--format", "xlsx", "--out", str(out)]) == 2
    assert "'xlsx' is not one of 'parquet', 'csv'" in capsys.readouterr().err
    suite = write_suite(tmp_path / "cases", name="ex")
    assert main(["golden", "export", "Q", "--suite", str(suite), "--goldens", str(tmp_path / "goldens"),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no golden for 'Q'" in err[0]
