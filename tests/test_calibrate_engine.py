"""`diffcheck calibrate` on the real engine: replicas stored beside the golden, the floor
built from them, stale replicas left out, and `compare` judging against it."""

from __future__ import annotations

import dataclasses

import pytest

from diffcheck import workspace
from diffcheck.workflows import calibrate as cal
from diffcheck.storage import store

pytestmark = pytest.mark.engine


def test_calibrate_records_a_replica_and_compare_uses_the_floor(smoke_suite, reference_run, tmp_path):
    ref = smoke_suite.cases["J"]
    golden_path = store.run_path(tmp_path, smoke_suite.name, "J")
    store.write_run(golden_path, dataclasses.replace(reference_run, meta=dataclasses.replace(
        reference_run.meta, source={**reference_run.meta.source, "config_digest": "x"})))
    golden = store.read_run(golden_path)
    one = (cal.Perturbation("batch1", "one sequence at a time", {"max_num_seqs": 1}),)
    lines = []
    floor = cal.calibrate(ref, root=tmp_path, golden=golden, perturbations=one, echo=lines.append)
    path = workspace.replica_path(tmp_path, smoke_suite.name, "J", "batch1")
    assert path.exists() and store.manifest_entry(path) is not None  # content-hashed, in the manifest
    replica = store.read_run(path)
    assert replica.meta.kind == "forced" and replica.meta.source["golden_digest"] == store.content_digest(golden)
    assert floor.replicas == ("batch1",) and floor.n_steps == golden.n_tokens
    # up to date: a second calibrate starts no engine
    lines.clear()
    cal.calibrate(ref, root=tmp_path, golden=golden, perturbations=one, echo=lines.append)
    assert any("up to date" in line for line in lines) and not any("starting engine" in line for line in lines)
    # a golden that moved makes the replica stale: left out, and said so
    moved = dataclasses.replace(golden, steps=dataclasses.replace(golden.steps, logprob=golden.steps.logprob - 0.5))
    stale_floor, notes = workspace.load_floor(tmp_path, smoke_suite.name, "J", moved)
    assert not stale_floor.measured and "older golden" in notes[0]
