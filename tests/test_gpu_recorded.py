"""The H200 run, re-judged offline: `diffcheck compare ID --suite gpu-h200 --run FILE`.

The goldens, candidate runs and forced/scored files under goldens/gpu-h200/ were
recorded on one NVIDIA H200 with vLLM 0.26 (docs/gpu.md has the commands); the noise
floor of J there is F, the same reference under FLASH_ATTN (`J.floor-flash-attn`).
CI has no GPU: these tests re-judge the recorded files with no engine, in a copy of
the folder (nothing is written into the checkout), and assert every sequence's
verdict and onset, not only the case's:

- O, L and OF (clean FULL decode graphs, Triton and FLASH_ATTN) and HE (the fault,
  hidden by eager mode) pass, OF against both F and J;
- H (seq-lens-copy under a FULL graph) is GIBBERISH from decode step 1-2 in every
  sequence, with its forced/scored files and from its generate run alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from diffcheck import cases
from diffcheck.cli import main
from diffcheck.core.errors import ConfigError
from diffcheck.core.types import exit_code
from diffcheck.storage import store
from diffcheck.core.types import Verdict

ROOT = Path(__file__).resolve().parent.parent
SUITE = cases.load_suite(ROOT / "cases" / "gpu-h200.toml")
GOLDENS = ROOT / "goldens" / SUITE.name
NOT_RECORDED: dict[str, str] = {}  # every candidate of the suite is recorded
CANDIDATES = sorted(cid for cid, case in SUITE.cases.items() if case.role == "candidate" and cid not in NOT_RECORDED)
PASSING = {"IDENTICAL", "BENIGN_DRIFT"}


@pytest.fixture(scope="module")
def goldens_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("goldens")
    shutil.copytree(GOLDENS, root / SUITE.name)
    return root


def judge(root: Path, cid: str, tmp_path: Path, *, generate_only: bool = False) -> tuple[int, dict]:
    """Exit code and JSON report of the documented offline command; generate-only: the run alone, as a
    run recorded elsewhere would come, judged with no engine (``score_missing=False``: the command
    itself would score it on this machine's CPU, tests/test_cross_hardware_scoring.py)."""
    folder = root / SUITE.name
    if generate_only:
        folder = tmp_path / "alone" / SUITE.name
        folder.mkdir(parents=True)
        for path in (root / SUITE.name).glob("J.*"):  # the golden and its floor replicas
            if path.name.endswith(".parquet"):
                shutil.copy(path, folder / path.name)
        shutil.copy(root / SUITE.name / f"{cid}.run.parquet", folder / f"{cid}.run.parquet")
        from diffcheck.workflows import compare as comparemod

        comparison = comparemod.compare(SUITE, cid, root=folder.parent, run_file=folder / f"{cid}.run.parquet",
                                        echo=lambda _: None, score_missing=False)
        assert not comparison.scored
        seqs = [{"verdict": s.verdict.name, "onset": s.onset} for v in comparison.verdicts for s in v.sequences]
        return exit_code(comparison.verdict), {"cases": [{"sequences": seqs}]}
    run_file = folder / f"{cid}.run.parquet"
    report = tmp_path / f"{cid}.json"
    code = main(["compare", cid, "--suite", str(ROOT / "cases" / "gpu-h200.toml"), "--goldens", str(folder.parent),
                 "--run", str(run_file), "--json", str(report)])
    return code, json.loads(report.read_text())


def sequences(report: dict) -> list[dict]:
    return [s for c in report["cases"] for s in c["sequences"]]


@pytest.mark.parametrize("cid", ["O", "L", "HE", "OF"])
def test_clean_candidates_pass_in_every_sequence(cid, goldens_copy, tmp_path):
    code, report = judge(goldens_copy, cid, tmp_path)
    verdicts = [s["verdict"] for s in sequences(report)]
    assert len(verdicts) == 4 * len(SUITE.cases[cid].references) and set(verdicts) <= PASSING, verdicts
    assert code == 0


@pytest.mark.parametrize("generate_only", [False, True], ids=["with-forced-and-scored", "generate-only"])
def test_the_fault_is_gibberish_from_the_first_decode_steps(generate_only, goldens_copy, tmp_path):
    code, report = judge(goldens_copy, "H", tmp_path, generate_only=generate_only)
    seqs = sequences(report)
    assert len(seqs) == 4
    assert [s["verdict"] for s in seqs] == ["GIBBERISH"] * 4
    assert all(s["onset"] in (1, 2) for s in seqs), [s["onset"] for s in seqs]
    assert code == exit_code(Verdict.GIBBERISH) == 1


@pytest.mark.parametrize("cid", CANDIDATES)
def test_candidate_gets_its_label(cid, goldens_copy, tmp_path):
    code, report = judge(goldens_copy, cid, tmp_path)
    verdict = Verdict[report["verdict"]]
    onsets = [s["onset"] for s in sequences(report) if s.get("onset") is not None]
    case = SUITE.cases[cid]
    assert case.expect is not None, f"case {cid} has no expect in cases/gpu-h200.toml"
    assert case.expect.matches(verdict, min(onsets) if onsets else None), (cid, verdict, onsets)
    assert code == exit_code(verdict)


def test_the_checkout_is_left_alone(goldens_copy, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in GOLDENS.iterdir()}
    judge(goldens_copy, "O", tmp_path)
    assert {p.name: p.stat().st_mtime_ns for p in GOLDENS.iterdir()} == before
    assert (goldens_copy / "ledger.sqlite").exists()


def test_every_recorded_candidate_is_judged_here():
    """A candidate recorded later must join the checks: no run file without its test."""
    recorded = {p.name.split(".")[0] for p in GOLDENS.glob("*.run.parquet")}
    assert recorded == set(CANDIDATES)
    assert set(NOT_RECORDED) <= set(SUITE.cases)


def test_recorded_runs_are_what_the_cases_claim():
    """H200 hardware, vLLM 0.26 on the V1 runner, and the graph mode each case asks for."""
    for cid in CANDIDATES:
        meta = store.read_meta(GOLDENS / f"{cid}.run.parquet")
        assert "H200" in meta.hardware.get("gpu_name", ""), cid
        assert meta.engine["version"].startswith("0.26"), cid
        assert meta.engine["forcing_mechanism"] == "v1_logits_processor", cid
        assert meta.env.get("VLLM_USE_V2_MODEL_RUNNER") == "0", cid
        effective = meta.engine["effective"]
        want = SUITE.cases[cid].engine.cudagraph_mode
        assert effective["cudagraph_mode"] == want, f"{cid}: recorded {effective['cudagraph_mode']}, case asks {want}"
        forced = GOLDENS / f"{cid}.forced-{SUITE.cases[cid].references[0]}.parquet"
        assert forced.is_file(), f"{forced} is missing"
    assert store.read_meta(GOLDENS / "H.run.parquet").env["DIFFCHECK_FAULT"] == "seq-lens-copy"


def test_gpu_fault_refuses_to_install_without_cuda():
    """seq-lens-copy must not silently do nothing on CPU vLLM."""
    from diffcheck.faults import gpu

    with pytest.raises(ConfigError, match="seq-lens-copy' needs CUDA"):
        gpu.install()
