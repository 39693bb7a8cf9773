"""`diffcheck kernels`: the stored-results lifecycle and exit codes.

Runs the quick suite on torch SDPA alone (about a second a run) so the whole
file stays well inside CI's budget.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import torch

from diffcheck.cli import main
from diffcheck_kernels.results import read_json, read_parquet, write_json, write_parquet

BASE = ["kernels", "--suite", "quick", "--kernels", "torch-sdpa"]


def run_cli(capsys, *args):
    code = main([*BASE, *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_help_does_not_import_torch():
    probe = "import sys; from diffcheck.cli import main; main(['kernels', '--help']); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--update" in proc.stdout and proc.stdout.strip().endswith("False")


def test_lifecycle_record_compare_regress(capsys, tmp_path):
    run_json = tmp_path / "run.json"
    code, out = run_cli(capsys, "--out", str(tmp_path), "--json", str(run_json))
    assert code == 0, out
    assert "no stored results" in out and "--update" in out and "CAUGHT" in out
    assert not (tmp_path / "cpu.parquet").exists()  # recorded only on request

    # The same results again, from the JSON (saves re-running the suite).
    again = ["kernels", "--from-json", str(run_json), "--out", str(tmp_path)]
    code = main([*again, "--update"])
    assert code == 0 and "recorded" in capsys.readouterr().out
    stored = read_parquet(tmp_path / "cpu.parquet")
    assert stored.suite == "quick" and stored == read_json(run_json)

    code = main(again)
    assert code == 0 and "0 regressions" in capsys.readouterr().out

    # Pretend the stored run was far more accurate: this run is now a regression.
    better = dataclasses.replace(stored, rows=tuple(
        dataclasses.replace(r, max_err=0.0, mean_err=0.0, atol=1e-12) for r in stored.rows
    ))  # fmt: skip
    write_parquet(better, tmp_path / "cpu.parquet")
    code = main(again)
    out = capsys.readouterr().out
    assert code == 1
    assert "REGRESSION" in out and "diffcheck kernels --device cpu --update" in out
    assert (tmp_path / "cpu.obtained.parquet").exists()


def test_tampered_store_is_a_one_line_data_error(capsys, tmp_path):
    import pyarrow.parquet as pq

    from diffcheck_kernels.suite import QUICK, run_suite

    src = write_json(run_suite("cpu", QUICK, kernels=("torch-sdpa",)), tmp_path / "run.json")
    assert main(["kernels", "--from-json", str(src), "--out", str(tmp_path), "--update"]) == 0
    path = tmp_path / "cpu.parquet"
    table = pq.read_table(path)
    pq.write_table(table.slice(1), path)  # drop a row, keep the metadata
    code = main(["kernels", "--from-json", str(src), "--out", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 2
    errors = [line for line in (out.out + out.err).splitlines() if line.startswith("diffcheck: error:")]
    assert len(errors) == 1 and "cpu.parquet" in errors[0] and "blake3" in errors[0]


def test_from_json_stores_results_of_another_machine(capsys, tmp_path):
    from diffcheck_kernels.suite import QUICK, run_suite

    result = run_suite("cpu", QUICK, kernels=("torch-sdpa",))
    remote = dataclasses.replace(result, device="cuda", env={**result.env, "device_name": "pretend GPU"})
    src = write_json(remote, tmp_path / "cuda-remote.json")
    code = main(["kernels", "--from-json", str(src), "--out", str(tmp_path), "--update"])
    assert code == 0, capsys.readouterr().out
    assert read_parquet(tmp_path / "cuda.parquet") == remote

    code, out = run_cli(capsys, "--from-json", str(src), "--device", "cpu", "--out", str(tmp_path))
    assert code == 2 and "field 'device' is 'cuda'" in out


def test_json_output_and_failing_case_exit_1(capsys, tmp_path):
    code, out = run_cli(capsys, "--out", str(tmp_path), "--json", str(tmp_path / "run.json"))
    assert code == 0
    result = read_json(tmp_path / "run.json")
    failed = dataclasses.replace(result, rows=(dataclasses.replace(result.rows[0], verdict="FAIL"),) + result.rows[1:])
    (tmp_path / "failed.json").write_text(json.dumps(failed.to_json()))
    code, out = run_cli(capsys, "--from-json", str(tmp_path / "failed.json"), "--out", str(tmp_path))
    assert code == 1 and "FAILED" in out


def test_unknown_kernel_is_a_usage_error(capsys, tmp_path):
    code = main(["kernels", "--suite", "quick", "--kernels", "nope", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--kernels" in err and "valid: torch-sdpa" in err


def test_cuda_without_gpu_is_a_usage_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, whatever this one has
    code = main(["kernels", "--device", "cuda", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--device" in err and "no CUDA device" in err


def test_recorded_vllm_gpu_kernels_rejudge_offline(capsys, tmp_path):
    """The H200 run of vLLM's own decode attention (Triton unified, FA3) through vLLM's
    metadata builders under CUDA-graph replay, re-judged here without a GPU: every case
    within tolerance, and every broken builder, the seq-lens-copy fault included, caught."""
    from pathlib import Path

    recorded = Path(__file__).resolve().parent.parent / "goldens" / "kernels" / "vllm-0.26" / "cuda-h200.json"
    suite = read_json(recorded)
    kernels = {r.kernel for r in suite.rows}
    assert kernels == {"vllm-triton-unified", "vllm-fa3"}
    graph = [r for r in suite.rows if r.mode == "graph" and r.builder == "refresh"]
    assert graph and all(r.verdict == "PASS" for r in graph)
    faults = {(r.kernel, r.builder): r.verdict for r in suite.rows if r.builder not in ("-", "refresh")}
    for kernel in kernels:
        assert faults[(kernel, "seq-lens-copy")] == "CAUGHT", faults
        assert faults[(kernel, "seq-lens-copy:fixed")] == "PASS", faults
    assert main(["kernels", "--device", "cuda", "--from-json", str(recorded), "--out", str(tmp_path)]) == 0
    assert "broken builders caught" in capsys.readouterr().out
