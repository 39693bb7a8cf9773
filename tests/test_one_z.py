"""One multiple-testing rule (issue 21): Bonferroni over every test of a comparison, the far-step
rule included, counted in one place (`decision.family`), so a candidate faces the same z whichever
command judges it (compare, check, matrix, selftest): before, the count was the command's
sequences, and one candidate faced z 2.50 in compare and 3.28 in selftest.

No engine: the rule by hand, its family-wise error by simulation, the far-step rule's share, and
the committed H200 recordings judged offline (`compare --run`)."""

from __future__ import annotations

import inspect
import json
import math
import shutil
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from diffcheck.cli import main
from diffcheck.judging import classify
from diffcheck.judging.decision import effect_test, family, far_step_level, far_step_threshold
from diffcheck.judging.floor import Floor
from diffcheck.workflows import compare as comparemod
from diffcheck.workflows import matrix as matrixmod

from factories import make_run

ROOT = Path(__file__).resolve().parent.parent
Z = NormalDist().inv_cdf


def test_the_family_is_every_test_of_every_sequence_times_the_looks():
    f = family(4)
    assert f.per_sequence == ("KL", "loss", "far step") and f.m == 12
    assert f.z(0.05) == pytest.approx(Z(1 - 0.05 / 12))  # 2.64
    budget = family(4, budget=True)  # a spec change: the two effects against the budget too
    assert budget.m == 20 and budget.per_sequence[3:] == ("budget KL", "budget loss")
    assert family(8, looks=4).m == 8 * 3 * 4  # a sequential extension plans 4 looks
    d = family(4).as_dict(0.05)
    assert d["m"] == 12 and d["alpha_per_test"] == pytest.approx(0.05 / 12) and d["z"] == pytest.approx(2.638, abs=1e-3)


def test_no_command_passes_a_count_of_its_own():
    # the count is made inside the comparison: nothing upstream can hand it another one
    for fn in (comparemod.compare, comparemod.judge_reference, classify.compare_runs):
        assert "tests" not in inspect.signature(fn).parameters, fn
    assert not hasattr(matrixmod.Plan, "tests")


def test_a_comparisons_summary_states_its_tests_and_z():
    tokens = [list(range(10, 40)) for _ in range(3)]
    ref = make_run(tokens, k=4, role="reference", case_id="J")
    v = classify.compare_runs(ref, make_run(tokens, k=4, role="candidate", case_id="O"))
    t = v.summary["tests"]
    assert t["sequences"] == 3 and t["m"] == 9 and t["z"] == pytest.approx(Z(1 - 0.05 / 9))
    assert t["rule"].startswith("Bonferroni per comparison")


def _false_alarms(tests: int, n_sequences: int, reps: int, seed: int) -> tuple[float, float]:
    """How often any of `n_sequences` sequences, each with both effects exactly on their margins,
    is called beyond a margin, and how often any is called within one (both claims are wrong there;
    as in any equivalence test, each is bounded on its own)."""
    rng = np.random.default_rng(seed)
    margin, sd, n = 0.02, 0.05, 4096  # 256 batch-means blocks: the normal quantile holds
    beyond = within = 0
    for _ in range(reps):
        b = w = False
        for _ in range(n_sequences * 2):  # two effects per sequence
            common = dict(margin=margin, sigma_floor=0.0, alpha=0.05, beta=0.2, tests=tests)
            b |= effect_test("loss", rng.normal(margin, sd, n), **common).beyond
            w |= effect_test("loss", rng.normal(margin, sd, n), **common).within
        beyond, within = beyond + b, within + w
    return beyond / reps, within / reps


def test_bonferroni_over_the_comparisons_tests_keeps_its_false_alarms_at_alpha():
    # 4 sequences x 2 effects on their margins (the far-step rule's share, the third test of each
    # sequence, is left unspent here, so the rate sits below alpha: 8 x 0.05 / 12 = 0.033).
    # Corrected per sequence only (the old count, m = 4), the 8 effects' wrong calls add up to
    # about 8 x 0.05 / 4 = 0.1, twice alpha. 1500 comparisons: a rate of 0.05 within ±0.017.
    old = _false_alarms(4, 4, 1500, seed=11)
    new = _false_alarms(family(4).m, 4, 1500, seed=12)
    assert min(old) > 0.07, old
    assert max(new) <= 0.05 + 0.017, new


def test_the_far_step_rule_holds_its_share_of_alpha():
    # a measured floor: N = 2000 steps, the largest KL 0.02. Under the exponential tail through it
    # (scale 0.02 / ln 2000), 10x the largest step is already far below alpha / m for any path
    floor = Floor(replicas=("r",), n_steps=2000, kl_step_max=0.02, kl_seq_max=1e-3)
    t = far_step_threshold(floor, far_factor=10, far_kl=0.1, alpha=0.05, tests=12, steps=513)
    assert t == pytest.approx(0.2)
    level = far_step_level(floor, t, steps=513)
    assert level == pytest.approx(513 * math.exp(-0.2 / (0.02 / math.log(2000))))
    assert level < 0.05 / 12
    # a floor of two steps says little about its tail: the threshold rises to the alpha / m quantile
    thin = Floor(replicas=("r",), n_steps=2, kl_step_max=0.05, kl_seq_max=1e-3)
    t = far_step_threshold(thin, far_factor=10, far_kl=0.1, alpha=0.05, tests=12, steps=64)
    assert t == pytest.approx(0.05 / math.log(2) * math.log(64 * 12 / 0.05)) and t > 0.5
    assert far_step_level(thin, t, steps=64) == pytest.approx(0.05 / 12)
    # more tests in the family, a higher bar
    assert far_step_threshold(thin, far_factor=10, far_kl=0.1, alpha=0.05, tests=120, steps=64) > t
    # a floor of 0 has no tail: the rule is far_kl, and no level is claimed
    zero = Floor(replicas=("r",), n_steps=2000)
    assert far_step_threshold(zero, far_factor=10, far_kl=0.1, tests=10**6, steps=10**4) == 0.1
    assert far_step_level(zero, 0.1, steps=10) is None


def _z_of(tmp_path: Path, cid: str) -> list[float]:
    root = tmp_path / "goldens"
    if not root.exists():
        shutil.copytree(ROOT / "goldens" / "gpu-h200", root / "gpu-h200")
    report = tmp_path / f"{cid}.json"
    main(["compare", cid, "--suite", str(ROOT / "cases" / "gpu-h200.toml"), "--goldens", str(root),
          "--run", str(root / "gpu-h200" / f"{cid}.run.parquet"), "--json", str(report)])
    return [c["summary"]["tests"]["z"] for c in json.loads(report.read_text())["cases"]]


def test_the_recorded_h200_candidates_face_one_z_whatever_else_is_judged(tmp_path):
    # OF is judged against two references, O against one: each comparison has 4 sequences, so the
    # same z (before: OF's 8 sequences gave z 2.50, O's 4 gave 2.24, a matrix of them all 2.73)
    z_o, z_of = _z_of(tmp_path, "O"), _z_of(tmp_path, "OF")
    assert len(z_o) == 1 and len(z_of) == 2
    assert z_o[0] == z_of[0] == z_of[1] == pytest.approx(Z(1 - 0.05 / 12))
