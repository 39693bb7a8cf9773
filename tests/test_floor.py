"""The noise floor and the statistical decision, on synthetic runs (no engine).

Oracles are written out independently here: plain per-block means for the batch-means
error, the normal quantile from the standard library, the two-sample MDE formula.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from diffcheck.judging.decision import Budget, batch_means_se, decide, effect_test, z_value
from diffcheck.judging.floor import Floor, build_floor, precision_spec, spec_change
from tests.factories import make_run

V = 64


def rows(rng, n, noise=0.0, base=None):
    logits = base if base is not None else rng.standard_normal((n, V)) * 3
    logits = logits + noise * rng.standard_normal(logits.shape)
    return logits - np.log(np.exp(logits).sum(1, keepdims=True))


def test_batch_means_se_matches_block_means_by_hand():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(160)
    blocks = [x[i:i + 16].mean() for i in range(0, 160, 16)]
    mean = sum(blocks) / len(blocks)
    sd = math.sqrt(sum((b - mean) ** 2 for b in blocks) / (len(blocks) - 1))
    assert batch_means_se(x) == pytest.approx(sd / math.sqrt(len(blocks)))
    assert batch_means_se(np.array([1.0])) == math.inf


def test_correlated_steps_get_a_wider_error_than_a_naive_one():
    """A slowly wandering series: per-step errors would claim far too much confidence."""
    rng = np.random.default_rng(1)
    x = np.repeat(rng.standard_normal(20), 16)  # each value held for 16 steps
    naive = x.std(ddof=1) / math.sqrt(len(x))
    assert batch_means_se(x) > 3 * naive


def test_an_effect_is_beyond_only_when_its_lower_bound_clears_the_margin():
    x = np.full(64, 0.05) + np.tile([0.01, -0.01], 32)
    inside = effect_test("KL", x, margin=0.06, sigma_floor=0.01, alpha=0.05, beta=0.2, tests=1)
    assert not inside.beyond and inside.p_within > 0.5
    beyond = effect_test("KL", x, margin=0.01, sigma_floor=0.01, alpha=0.05, beta=0.2, tests=1)
    assert beyond.beyond and beyond.lower > 0.01 and beyond.p_within < 0.05
    z = NormalDist().inv_cdf(1 - 0.05)
    assert beyond.lower == pytest.approx(beyond.estimate - z * beyond.se)


def test_more_tests_need_more_evidence_and_mde_follows_the_two_sample_formula():
    assert z_value(0.05, 20) == pytest.approx(NormalDist().inv_cdf(1 - 0.05 / 20))
    assert z_value(0.05, 20) > z_value(0.05, 1)
    x = np.zeros(128)
    e = effect_test("loss", x, margin=0.02, sigma_floor=0.1, alpha=0.05, beta=0.2, tests=4)
    expected = (NormalDist().inv_cdf(1 - 0.05 / 4) + NormalDist().inv_cdf(0.8)) * 0.1 * math.sqrt(2 / (128 / 16))
    assert e.mde == pytest.approx(expected)


def test_decide_uses_the_floor_for_margins_and_the_budget_when_given():
    kl = np.full(64, 0.05)
    d = np.full(64, -0.05)
    quiet = Floor(replicas=("a",), n_steps=100, kl_seq_max=0.001, loss_seq_max=0.001)
    amount, loss, b_amount, b_loss = decide(kl, d, floor=quiet, factor=4, min_effect_kl=1e-3,
                                            min_effect_loss=0.02, alpha=0.05, beta=0.2, tests=1,
                                            budget=Budget(kl=0.1, loss=0.1))
    assert amount.margin == pytest.approx(4e-3) and amount.beyond and loss.beyond
    assert not b_amount.beyond and not b_loss.beyond  # within a budget of 0.1
    noisy = Floor(replicas=("a",), n_steps=100, kl_seq_max=0.05, loss_seq_max=0.05)
    amount, loss, *_ = decide(kl, d, floor=noisy, factor=4, min_effect_kl=1e-3, min_effect_loss=0.02,
                              alpha=0.05, beta=0.2, tests=1)
    assert not amount.beyond and not loss.beyond


def test_floor_from_forced_replicas_pools_every_step():
    rng = np.random.default_rng(2)
    ref_rows = [rows(rng, 40), rows(rng, 30)]
    tokens = [r.argmax(1) for r in ref_rows]
    golden = make_run(tokens, distributions=ref_rows, k=8)
    replica = make_run(tokens, distributions=[r + 0.01 * rng.standard_normal(r.shape) for r in ref_rows], k=8,
                       kind="forced", role="candidate")
    same = make_run(tokens, distributions=ref_rows, k=8, kind="forced", role="candidate")
    floor = build_floor(golden, {"noisy": replica, "same": same})
    assert floor.n_steps == 2 * 70 and floor.replicas == ("noisy", "same")
    assert 0 < floor.kl_seq_max < 1e-3 and floor.kl_step_max > 0
    assert build_floor(golden, {"same": same}).kl_seq_max == 0.0
    assert not Floor().measured and "no noise floor" in Floor().describe()


def test_a_generate_replica_counts_only_its_steps_before_t_star():
    rng = np.random.default_rng(3)
    ref_rows = [rows(rng, 30)]
    tokens = ref_rows[0].argmax(1)
    other = tokens.copy()
    other[12] = (other[12] + 1) % V
    golden = make_run([tokens], distributions=ref_rows, k=8)
    replica = make_run([other], distributions=ref_rows, k=8)
    assert build_floor(golden, {"r": replica}).n_steps == 12


def test_precision_spec_and_its_change_come_from_the_effective_config():
    a = make_run([[1, 2]], engine={"effective": {"dtype": "float32", "kv_cache_dtype": "auto"}},
                 model={"digest": "m1"})
    b = make_run([[1, 2]], engine={"effective": {"dtype": "float32", "kv_cache_dtype": "fp8_e5m2"}},
                 model={"digest": "m1"})
    graph = make_run([[1, 2]], engine={"effective": {"dtype": "float32", "cudagraph_mode": "FULL"}},
                     model={"digest": "m1"})
    assert precision_spec(a) == {"dtype": "float32", "kv_cache_dtype": "auto", "quantization": None, "model": "m1"}
    assert spec_change(a, b) == {"kv_cache_dtype": ("auto", "fp8_e5m2")}
    assert spec_change(a, graph) == {}  # graph mode is spec-neutral
