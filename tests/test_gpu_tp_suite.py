"""The tensor-parallel GPU suite (cases/gpu-h200-tp.toml), checked without its GPUs.

Its recording needs three H200s of one host (the nvidia-h200-x4 machine), which has not
been lent yet; docs/gpu.md ("Tensor parallel") has the commands. Until then:

- the suite's structure is checked against the model (TP3 must divide its attention
  and KV heads) and against the device machines' rule (NVLink multicast off in every
  case);
- its expectations and references are exercised end to end through the offline
  command, on **stand-ins**: the single-GPU H200 recordings of goldens/gpu-h200/
  (J, O, OF, H) copied under the TP suite's names (J3/J1, O3/O1, OF3, H3) in a temp
  folder. A stand-in proves the wiring (references, floors, expectations, exit codes),
  not anything about TP;
- the recordings that are missing are listed in NOT_RECORDED, and a recording that
  arrives must join the checks (the same per-sequence checks as tests/test_gpu_recorded.py,
  plus the fault marker: one acting line from each of the three ranks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from diffcheck import cases
from diffcheck.cli import main
from diffcheck.faults import marker
from diffcheck.cases.faults import ENV_FAULT, ENV_MARKER
from diffcheck.core.types import exit_code
from diffcheck.storage import store
from diffcheck.core.types import Verdict

ROOT = Path(__file__).resolve().parent.parent
SUITE_FILE = ROOT / "cases" / "gpu-h200-tp.toml"
SUITE = cases.load_suite(SUITE_FILE)
GOLDENS = ROOT / "goldens" / SUITE.name
SINGLE = ROOT / "goldens" / "gpu-h200"
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                 "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
WHY = "needs nvidia-h200-x4 (three H200s of one host), not lent so far"
NOT_RECORDED = {cid: WHY for cid in ("O3", "OF3", "O1", "H3")}
CANDIDATES = sorted(cid for cid, c in SUITE.cases.items() if c.role == "candidate")
RECORDED = [cid for cid in CANDIDATES if cid not in NOT_RECORDED]
PASSING = {"IDENTICAL", "BENIGN_DRIFT"}
# stand-in (TP suite name) -> the single-GPU recording it borrows
STAND_IN = {"J3": "J", "J1": "J", "O3": "O", "O1": "O", "OF3": "OF", "H3": "H"}


# -- structure ---------------------------------------------------------------------------------

def test_tp3_divides_the_models_heads_and_kv_heads():
    from diffcheck.engines import models

    config = json.loads((models.resolve_case(SUITE.cases["J3"]).path / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    sizes = {c.engine.tensor_parallel_size for c in SUITE.cases.values()}
    assert sizes == {1, 3}
    for size in sizes:
        assert heads % size == 0 and kv_heads % size == 0, (size, heads, kv_heads)


def test_every_case_keeps_nvlink_multicast_off():
    for cid, case in SUITE.cases.items():
        assert MULTICAST_OFF.items() <= dict(case.env).items(), cid


def test_the_tp3_candidates_stand_against_the_tp3_reference():
    refs = {cid: (c.engine.tensor_parallel_size, c.engine.cudagraph_mode, tuple(c.references))
            for cid, c in SUITE.cases.items() if c.role == "candidate"}
    assert refs["O3"] == (3, "FULL_DECODE_ONLY", ("J3", "J1"))
    assert refs["OF3"][:2] == (3, "FULL_DECODE_ONLY") and SUITE.cases["OF3"].engine.attention_backend == "FLASH_ATTN"
    assert refs["O1"] == (1, "FULL_DECODE_ONLY", ("J1",))
    assert refs["H3"] == (3, "FULL_DECODE_ONLY", ("J3",))
    assert SUITE.cases["J3"].engine.enforce_eager and SUITE.cases["J1"].engine.enforce_eager


def test_the_fault_case_writes_its_marker_beside_the_goldens():
    env = dict(SUITE.cases["H3"].env)
    assert env[ENV_FAULT] == "seq-lens-copy"
    assert Path(env[ENV_MARKER]).parent == Path("goldens") / SUITE.name / "logs"
    assert SUITE.cases["H3"].expect.verdict == Verdict.GIBBERISH


# -- stand-ins -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Path:
    """goldens/gpu-h200's files under the TP suite's names, with a manifest for those names."""
    root = tmp_path_factory.mktemp("stand-ins")
    folder = root / SUITE.name
    folder.mkdir()
    manifest = json.loads((SINGLE / store.MANIFEST).read_text())
    entries = {}

    def copy(src: str, dst: str) -> None:
        shutil.copy(SINGLE / src, folder / dst)
        entries[dst] = manifest[src]

    for cid, case in SUITE.cases.items():
        old = STAND_IN[cid]
        if case.role == "reference":
            copy(f"{old}.parquet", f"{cid}.parquet")
            for floor in SINGLE.glob(f"{old}.floor-*.parquet"):
                copy(floor.name, cid + floor.name[len(old):])
            continue
        copy(f"{old}.run.parquet", f"{cid}.run.parquet")
        for ref in case.references:
            for kind in ("forced", "scored"):
                copy(f"{old}.{kind}-J.parquet", f"{cid}.{kind}-{ref}.parquet")
    (folder / store.MANIFEST).write_text(json.dumps(entries, indent=1))
    return root


def judge(root: Path, cid: str, tmp_path: Path) -> tuple[int, dict]:
    """Exit code and JSON report of `diffcheck compare CID --suite gpu-h200-tp --run FILE`."""
    report = tmp_path / f"{cid}.json"
    code = main(["compare", cid, "--suite", str(SUITE_FILE), "--goldens", str(root),
                 "--run", str(root / SUITE.name / f"{cid}.run.parquet"), "--json", str(report)])
    return code, json.loads(report.read_text())


def check_labels(cid: str, code: int, report: dict) -> None:
    """Every sequence against every reference, and the case's `expect`, as test_gpu_recorded.py checks."""
    case = SUITE.cases[cid]
    seqs = [s for c in report["cases"] for s in c["sequences"]]
    assert len(seqs) == 4 * len(case.references)
    if case.expect.verdict == Verdict.GIBBERISH:
        assert {s["verdict"] for s in seqs} == {"GIBBERISH"}, [s["verdict"] for s in seqs]
        assert all(s["onset"] is not None and abs(s["onset"] - case.expect.onset) <= case.expect.onset_tolerance
                   for s in seqs), [s["onset"] for s in seqs]
    else:
        assert {s["verdict"] for s in seqs} <= PASSING, [s["verdict"] for s in seqs]
    verdict = Verdict[report["verdict"]]
    onsets = [s["onset"] for s in seqs if s.get("onset") is not None]
    assert case.expect.matches(verdict, min(onsets) if onsets else None), (cid, verdict, onsets)
    assert code == exit_code(verdict)


@pytest.mark.parametrize("cid", CANDIDATES)
def test_stand_in_runs_get_the_suites_labels(cid, stand_ins, tmp_path):
    """Single-GPU recordings under TP names: the suite's references, floors and expectations work offline."""
    code, report = judge(stand_ins, cid, tmp_path)
    check_labels(cid, code, report)
    # the report is honest about what it judged: the stand-in's own recorded case
    assert {c["candidate_id"] for c in report["cases"]} == {cid}
    assert store.read_meta(stand_ins / SUITE.name / f"{cid}.run.parquet").case_id == STAND_IN[cid]


# -- recordings ------------------------------------------------------------------------------

def test_every_recorded_candidate_is_judged_here():
    """A TP recording that arrives must leave NOT_RECORDED, and so join the checks below."""
    recorded = {p.name.split(".")[0] for p in GOLDENS.glob("*.run.parquet")} if GOLDENS.exists() else set()
    assert recorded == set(RECORDED)
    assert set(NOT_RECORDED) <= set(CANDIDATES)


@pytest.mark.skipif(not RECORDED, reason=f"GPU-only recording missing: {WHY}")
@pytest.mark.parametrize("cid", RECORDED or ["none"])
def test_recorded_tp_candidates_get_their_labels(cid, tmp_path):
    root = tmp_path / "goldens"
    shutil.copytree(GOLDENS, root / SUITE.name)  # a copy: nothing written into the checkout
    code, report = judge(root, cid, tmp_path)
    check_labels(cid, code, report)
    meta = store.read_meta(GOLDENS / f"{cid}.run.parquet")
    assert "H200" in meta.hardware.get("gpu_name", "")
    assert meta.engine["effective"]["tensor_parallel_size"] == SUITE.cases[cid].engine.tensor_parallel_size


@pytest.mark.skipif("H3" in NOT_RECORDED, reason=f"GPU-only recording missing: {WHY}")
def test_the_recorded_fault_acted_once_in_every_rank():
    events = marker.read_events(ROOT / dict(SUITE.cases["H3"].env)[ENV_MARKER])
    assert marker.acting_ranks(events, 3) == []
