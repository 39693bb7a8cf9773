"""`diffcheck localize` re-judged from the captures recorded on the GPU lane, with no engine.

The captures under goldens/gpu-h200/ (``*.taps-J.npz``: J, its three floor replicas, H and O)
were recorded with vLLM 0.26 on one NVIDIA H100 80GB (the suite is named for the H200 it was
written for; no H200 could be started that day) by ``bash tools/gpu/device-run.sh collect --
install -- localize --step 2 --around 2 H`` and then ``... localize --step 2 --around 2 O``
(docs/localize.md has the results and the times). CI has no GPU: these tests run the
documented command on a copy of that folder, with every engine start made an error, so
the answer must come from the stored captures alone:

- H (the seq-lens-copy fault under a FULL_DECODE_ONLY CUDA graph) is localized to decode
  step 1, layer 0's attention, in that op (its input inside its floor), far beyond its
  margin; the steps after the first were read back from CUDA-graph replays;
- O (the same graph, no fault) has nothing beyond its floor, while many of its sites do
  differ from the reference by more than the fixed minimum: the measured floor decides,
  not a constant.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from diffcheck.cli import main

ROOT = Path(__file__).resolve().parent.parent
SUITE_FILE = ROOT / "cases" / "gpu-h200.toml"
GOLDENS = ROOT / "goldens" / "gpu-h200"
CAPTURES = ("J", "J.floor-restart", "J.floor-batch3", "J.floor-batch5", "H", "O")


def _snapshot(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("goldens")
    shutil.copytree(GOLDENS, root / "gpu-h200")
    before = _snapshot(GOLDENS)
    from diffcheck.engines import session as sessionmod

    def no_engine(self, case, *args, **kw):
        raise AssertionError(f"localize started an engine for {case.id}: the recorded captures should decide")

    mp = pytest.MonkeyPatch()
    mp.setattr(sessionmod.EngineSession, "get", no_engine)
    out = {}
    try:
        for cid in ("H", "O"):
            path = tmp_path_factory.mktemp("out") / f"{cid}.json"
            code = main(["localize", cid, "--suite", str(SUITE_FILE), "--goldens", str(root), "--step", "2",
                         "--around", "2", "--json", str(path)])
            out[cid] = {"code": code, **json.loads(path.read_text())}
    finally:
        mp.undo()
    assert _snapshot(GOLDENS) == before, "localize wrote into the checkout"
    return out


def test_every_recorded_capture_is_in_the_repository():
    for name in CAPTURES:
        assert (GOLDENS / f"{name}.taps-J.npz").is_file(), name


def test_H_is_localized_to_layer_0_attention_at_step_1_under_the_graph(reports):
    report = reports["H"]
    first = report["first"]
    assert (first["step"], first["layer"], first["op"]) == (1, 0, "self_attn"), first
    assert not first["inherited"], first
    assert first["inputs"] and not any(i["beyond"] for i in first["inputs"]), first["inputs"]
    assert first["relative_error"] > 10 * first["margin"], first
    assert max(report["floors"]) > 0  # a measured GPU floor, not the CPU lane's zero
    assert any(n.startswith("H:") and "read back from CUDA-graph replays" in n for n in report["notes"]), \
        report["notes"]


def test_O_the_clean_graph_has_nothing_beyond_its_floor_though_it_differs(reports):
    report = reports["O"]
    assert report["first"] is None and report["beyond_sites"] == 0, report["first"]
    # the floor matters: most sites differ from J by more than the fixed minimum, inside their measured floors
    above_minimum = 0
    for k in range(len(report["sites"])):
        values = [row[k] for row in report["relative_error_by_step"].values() if row[k] is not None]
        if values and max(values) > report["minimum"]:
            above_minimum += 1
    assert above_minimum >= len(report["sites"]) // 2, above_minimum
