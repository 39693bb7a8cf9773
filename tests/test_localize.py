"""diffcheck.judging.localize on synthetic captures (no engine): relative errors, per-site floors,
the first site beyond in model order, inherited or not, and the report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from diffcheck.judging import localize as L

N_LAYERS, STEPS, SEQS, DIM = 3, (3, 4, 5), 2, 16
SITES = L.site_names(N_LAYERS)


def site(layer, op):
    return SITES.index((layer, op))


def raw(seed=0):
    """Per [seq, step, site] a DIM-vector: the tensors themselves."""
    return np.random.default_rng(seed).normal(size=(SEQS, len(STEPS), len(SITES), DIM))


def capture(vectors, case_id="X"):
    # The identity as the "projection": the relative error must then be exact.
    return L.Capture(case_id=case_id, n_layers=N_LAYERS, steps=STEPS, norm=np.linalg.norm(vectors, axis=-1),
                     proj=vectors.copy())


def moved(base, where, size, seed=1):
    """`base` with a relative error of exactly `size` at each (seq, step index, site) of `where`."""
    out = base.copy()
    noise = np.random.default_rng(seed).normal(size=DIM)
    for s, k, i in where:
        out[s, k, i] = base[s, k, i] + noise / np.linalg.norm(noise) * size * np.linalg.norm(base[s, k, i])
    return out


def test_relative_error_is_the_norm_of_the_difference_over_the_reference_norm():
    a, b = raw(1), raw(2)
    expected = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)
    assert np.allclose(L.relative_error(capture(a), capture(b)), expected)
    assert not L.relative_error(capture(b), capture(b.copy())).any()  # equal tensors: exactly 0


def test_site_inputs_follow_the_decoder_layer():
    assert L.site_inputs(0) == []
    assert L.site_inputs(site(0, "input_layernorm")) == [site(None, "embed")]
    assert L.site_inputs(site(1, "input_layernorm")) == [site(0, "residual")]
    assert L.site_inputs(site(2, "self_attn")) == [site(2, "input_layernorm")]
    assert L.site_inputs(site(2, "mlp")) == [site(2, "post_attention_layernorm")]
    assert set(L.site_inputs(site(1, "residual"))) == {site(1, "mlp"), site(1, "self_attn"), site(0, "residual")}


def downstream(s, k0, first_site):
    """Every (seq, step, site) a bad value at (k0, first_site) reaches: the rest of that pass, then every later
    pass from the layer on (through the KV cache)."""
    layer = SITES[first_site][0]
    where = [(s, k0, i) for i in range(first_site, len(SITES))]
    where += [(s, k, i) for k in range(k0 + 1, len(STEPS)) for i in range(site(layer, "self_attn"), len(SITES))]
    return where


def test_the_first_beyond_in_model_order_is_named_and_what_follows_inherits():
    base = raw()
    bad = site(1, "self_attn")
    cand = moved(base, downstream(1, 1, bad), 0.3)
    result = L.localize(capture(base, "J"), capture(cand, "M"), np.zeros(len(SITES)))
    f = result.first
    assert (f.step, f.layer, f.op, f.seq) == (STEPS[1], 1, "self_attn", 1)
    assert not f.inherited
    assert f.ratio == pytest.approx(0.3 / L.MIN_RELATIVE_ERROR)
    assert [i[0] for i in f.inputs] == ["layers.1.input_layernorm"] and f.inputs[0][1] == 0
    assert len(result.worst) == 5 and all(w.inherited for w in result.worst)
    assert (1, "self_attn") not in [(w.layer, w.op) for w in result.worst]
    # The post-attention norm right after it is beyond too, and is not blamed.
    nxt = L.localize(capture(base), capture(cand), np.zeros(len(SITES)), n_worst=100)
    after = {(w.layer, w.op): w for w in nxt.worst}
    assert after[(1, "post_attention_layernorm")].inherited
    assert after[(2, "self_attn")].inherited


def test_an_attention_whose_input_went_bad_at_an_earlier_step_inherits_through_the_kv_cache():
    base = raw()
    # input_layernorm of layer 2 bad at step index 0 only; layer 2's attention bad at step index 1.
    cand = moved(base, [(0, 0, site(2, "input_layernorm")), (0, 1, site(2, "self_attn"))], 0.1)
    result = L.localize(capture(base), capture(cand), np.zeros(len(SITES)), n_worst=10)
    assert (result.first.layer, result.first.op, result.first.step) == (2, "input_layernorm", STEPS[0])
    attn = [w for w in result.worst if (w.layer, w.op) == (2, "self_attn")]
    assert attn and attn[0].inherited


def test_the_floor_matters_a_benign_move_inside_its_floor_is_not_named():
    base = raw()
    mlp = site(2, "mlp")
    replica = moved(base, [(s, k, mlp) for s in range(SEQS) for k in range(len(STEPS))], 1e-3, seed=5)
    floors = L.site_floors(capture(base), [capture(replica)])
    assert floors[mlp] == pytest.approx(1e-3) and np.count_nonzero(floors) == 1
    benign = moved(base, [(0, 2, mlp)], 2e-3, seed=6)  # twice the floor: inside 4 x floor
    assert L.localize(capture(base), capture(benign), floors).first is None
    # Judged against a zero floor, the same move would have been called bad.
    assert L.localize(capture(base), capture(benign), np.zeros(len(SITES))).first.op == "mlp"
    worse = moved(base, [(0, 2, mlp)], 8e-3, seed=6)  # beyond 4 x floor
    assert L.localize(capture(base), capture(worse), floors).first.ratio == pytest.approx(2.0)


def test_zero_floors_use_the_documented_minimum_and_say_so():
    base = raw()
    floors = L.site_floors(capture(base), [capture(base.copy())])
    assert not floors.any()
    tiny = moved(base, [(0, 1, site(0, "mlp"))], L.MIN_RELATIVE_ERROR / 2)
    result = L.localize(capture(base), capture(tiny), floors, floor_replicas=("restart",))
    assert result.first is None
    assert any("exactly 0" in n for n in result.notes)
    clear = moved(base, [(0, 1, site(0, "mlp"))], L.MIN_RELATIVE_ERROR * 20)
    assert L.localize(capture(base), capture(clear), floors).first.op == "mlp"


def test_a_departure_at_the_first_captured_step_says_it_may_be_earlier():
    base = raw()
    cand = moved(base, [(0, 0, site(0, "self_attn"))], 0.5)
    result = L.localize(capture(base), capture(cand), np.zeros(len(SITES)))
    assert result.first.step == STEPS[0] and any("first captured step" in n for n in result.notes)


def test_mismatched_captures_are_refused():
    a = capture(raw())
    b = L.Capture(case_id="Y", n_layers=N_LAYERS, steps=(4, 5, 6), norm=a.norm, proj=a.proj)
    with pytest.raises(ValueError):
        L.relative_error(a, b)


def test_the_report_renders_in_the_terminal_and_as_json():
    from diffcheck.report import registry
    from diffcheck.report.localize import LocalizeReport

    base = raw()
    cand = moved(base, downstream(0, 1, site(1, "self_attn")), 0.3)
    report = LocalizeReport(localization=L.localize(capture(base, "J"), capture(cand, "M"), np.zeros(len(SITES))),
                            step=5, around=2, onset_source="--step", timings={"J": 1.0})
    text = registry.render("terminal", report)
    assert "first beyond its floor" in text and "layers.1.self_attn" in text and "in this op" in text
    doc = json.loads(registry.render("json", report))
    assert doc["first"]["site"] == "layers.1.self_attn" and doc["first"]["inherited"] is False
    assert doc["kind"] == "localize" and len(doc["floors"]) == len(SITES)
    clean = LocalizeReport(localization=L.localize(capture(base), capture(base.copy()), np.zeros(len(SITES))),
                           step=5, around=2, onset_source="--step")
    assert "nothing beyond its floor" in registry.render("terminal", clean)
    assert json.loads(registry.render("json", clean))["first"] is None


def test_the_onset_is_the_stored_runs_first_divergence_else_step_is_needed(tmp_path):
    from factories import make_run, write_suite

    from diffcheck import cases, workspace
    from diffcheck.core.errors import ConfigError
    from diffcheck.workflows.localize import onset_step

    suite = cases.load_suite(write_suite(tmp_path, {
        "J": {"role": "reference", "description": "reference"},
        "M": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "candidate"}}, name="tiny"))
    root = tmp_path / "goldens"
    golden = make_run([[5, 6, 7, 8, 9], [1, 2, 3, 4]], case_id="J", suite="tiny")
    case = suite.cases["M"]
    assert onset_step(case, golden, root=root, step=2) == (2, "--step")
    with pytest.raises(ConfigError, match="--step"):
        onset_step(case, golden, root=root, step=None)
    cand = make_run([[5, 6, 7, 0, 0], [1, 2, 9, 9]], case_id="M", suite="tiny", role="candidate")
    workspace.store_candidate(case, cand, {}, {"J": golden}, root=root)
    assert onset_step(case, golden, root=root, step=None)[0] == 2  # seq 1 parts at 2, seq 0 at 3
    same = make_run([[5, 6, 7, 8, 9], [1, 2, 3, 4]], case_id="M", suite="tiny", role="candidate")
    workspace.store_candidate(case, same, {}, {"J": golden}, root=root)
    with pytest.raises(ConfigError, match="token for token"):
        onset_step(case, golden, root=root, step=None)


@pytest.mark.parametrize("args, message", [
    (["M", "--step", "9999"], "--step 9999: golden J has 5 steps at most (valid: 0..4)"),
    (["J", "--step", "3"], "case 'J' has no references"),
    (["M", "--reference", "O", "--step", "3"], "--reference O: case 'O' is a candidate"),
])
def test_bad_input_is_one_line_before_any_engine_starts(args, message, tmp_path):
    """On the default suite, against a workspace of its own: a recorded golden J (5 steps), nothing else."""
    import subprocess
    import sys

    from conftest import ROOT
    from factories import make_run

    from diffcheck import cases, workspace

    suite = cases.load_suite("default")
    root = tmp_path / "goldens"
    workspace.store_golden(root, suite.cases["J"], make_run([[5, 6, 7, 8, 9], [1, 2, 3]], case_id="J", suite="default"))
    done = subprocess.run([sys.executable, "-m", "diffcheck", "localize", *args, "--goldens", str(root)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffcheck: error: ") and message in lines[0]
