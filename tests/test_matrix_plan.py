"""What a matrix runs, and what a Ray task reserves: pure, no engine, no cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffcheck import cases
from diffcheck.core.errors import DiffcheckError
from diffcheck.workflows import matrix as mx
from diffcheck.workflows import matrix_ray

ROOT = Path(__file__).resolve().parent.parent


def test_the_default_matrix_leaves_slow_and_gpu_cases_out_unless_named():
    suite = cases.load_suite(ROOT / "cases" / "default.toml")
    p = mx.plan(suite)
    assert p.left_out == ("T3", "HF")  # tagged slow
    assert [c.id for c in p.references] == ["J", "F"]
    compared = [c.id for c in p.compared]
    assert "T3" not in compared and "J" not in compared
    assert "F" in compared  # a reference with references of its own is compared too
    named = mx.plan(suite, ["T3"])
    assert [c.id for c in named.compared] == ["T3"] and [c.id for c in named.references] == ["J"]


def test_the_seed_suite_runs_only_what_is_named():
    suite = cases.load_suite(ROOT / "cases" / "flash-v100-quality.toml")
    assert mx.plan(suite).compared == ()  # every case is tagged gpu
    p = mx.plan(suite, ["Q", "O"])
    assert [c.id for c in p.compared] == ["O", "Q"]  # suite order
    assert [c.id for c in p.references] == ["J", "F", "J8", "F8"]


def test_a_task_reserves_its_ranks():
    suite = cases.load_suite(ROOT / "cases" / "flash-v100-quality.toml")
    assert matrix_ray.resources(suite.cases["A"], gpu=True) == {"num_gpus": 4.0, "num_cpus": 1.0}  # TP4
    assert matrix_ray.resources(suite.cases["I"], gpu=True) == {"num_gpus": 2.0, "num_cpus": 1.0}  # TP2
    default = cases.load_suite(ROOT / "cases" / "default.toml")
    assert matrix_ray.resources(default.cases["T3"], gpu=False, cpus_per_rank=2) == {"num_cpus": 6.0}
    assert matrix_ray.resources(default.cases["J"], gpu=False) == {"num_cpus": 1.0}


@pytest.mark.parametrize("value, ok", [(None, True), ("local", True), ("auto", True), ("10.0.0.5:6379", True),
                                       ("J", False), ("O", False)])
def test_ray_addresses(value, ok):
    if ok:
        assert mx.check_ray_address(value) == value
    else:
        with pytest.raises(DiffcheckError, match="not a cluster address"):
            mx.check_ray_address(value)


def test_delta_text_reads_like_the_case_language():
    from diffcheck.report.matrix import delta_text

    assert delta_text({"engine.enforce_eager": (True, False), "engine.max_num_seqs": (None, 1),
                      "env.X": ("a", None)}) == "enforce_eager=false, max_num_seqs=1, env.X=default"
