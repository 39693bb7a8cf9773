"""`selftest --localize` without an engine: where each fault of the catalogue acts (its spec alone),
the plan of rows (layer variants, benign variants, what is skipped and why), and the table's logic
on synthetic localizations (`diffcheck.judging.localize` run on synthetic captures)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from diffcheck import cases
from diffcheck.cases import faults as F
from diffcheck.judging import localize as L
from diffcheck.report.registry import render
from diffcheck.workflows import selftest as st
from diffcheck.workflows import selftest_localize as stl

from factories import write_suite

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).parent / "diffcheck"


def spec(**env):
    return F.parse_env({f"DIFFCHECK_FAULT{('_' + k.upper()) if k != 'fault' else ''}": v for k, v in env.items()})


# Read off each fault's runtime (diffcheck/faults/*.py), written out here by hand, not from the catalogue:
# (env, expected (layer, op, localize step)); decode step N produces output token N + 1.
WHERE = [
    ({"fault": "lost-head"}, (0, "self_attn", 33)),  # `all` layers: layer 0 is the first it changes
    ({"fault": "lost-head", "layer": "12"}, (12, "self_attn", 33)),
    ({"fault": "lost-head", "layer": "5", "step": "3"}, (5, "self_attn", 4)),
    ({"fault": "kv-write-corruption"}, (0, "self_attn", 33)),  # default layer 0; written before attention reads
    ({"fault": "kv-write-corruption", "layer": "7", "step": "10"}, (7, "self_attn", 11)),
    ({"fault": "rope-offset"}, (0, "self_attn", 33)),  # rotary runs inside every self_attn: layer 0 first
    ({"fault": "rope-offset", "step": "0"}, (0, "self_attn", 1)),
    ({"fault": "attn-noise", "layer": "3", "scale": "0.01"}, (3, "self_attn", 33)),
    ({"fault": "attn-noise"}, (0, "self_attn", 33)),
    ({"fault": "stale-decode-metadata"}, (0, "self_attn", 34)),  # filled at step N (still right), stale from N + 1
    ({"fault": "stale-decode-metadata", "step": "3"}, (0, "self_attn", 5)),
]


@pytest.mark.parametrize("env,where", WHERE)
def test_each_fault_states_where_it_first_acts(env, where):
    site = F.expected_site(spec(**env))
    assert (site.layer, site.op, site.step) == where
    assert site.site == f"layers.{where[0]}.{where[1]}"


def test_every_fault_of_the_catalogue_states_its_site_in_localize_terms():
    checked = {spec(**env).name for env, _ in WHERE} | {"seq-lens-copy"}
    assert checked == {info.name for info in F.CATALOGUE}  # a new fault must be added to WHERE
    for info in F.CATALOGUE:
        assert info.acts_in in L.OPS
        assert info.layers in ("fault", "first")
        assert info.shows_at >= 1 and info.where
        assert (info.layers == "fault") == F.layer_selectable(info)


@pytest.mark.parametrize("name", [info.name for info in F.CATALOGUE])
def test_a_fixed_fault_acts_nowhere(name):
    assert F.expected_site(spec(fault=name + ":fixed")) is None


def test_seq_lens_copy_acts_only_under_full_decode_graphs():
    s = spec(fault="seq-lens-copy")
    assert F.expected_site(s) is None  # eager: the copy holds this step's values
    site = F.expected_site(s, full_decode_graphs=True)
    assert (site.layer, site.op, site.step) == (0, "self_attn", 1)  # from the first decode pass


@pytest.mark.parametrize("n,taken,layers", [(30, 0, (1, 15, 29)), (30, None, (1, 15, 29)), (30, 15, (1, 29, 0)),
                                            (30, 1, (15, 29, 0)), (4, 0, (1, 2, 3)), (2, 0, (1,))])
def test_variant_layers_are_three_others_spread_over_the_model(n, taken, layers):
    assert stl.variant_layers(n, taken) == layers


# -- the plan -------------------------------------------------------------------------------------

FAULT = {"DIFFCHECK_FAULT_STEP": "32"}
PLAN_CASES = {
    "J": {"role": "reference", "description": "eager reference", "engine": {"enforce_eager": True}},
    "S2": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "batch of 2",
           "engine": {"max_num_seqs": 2}, "expect": {"not_verdict": ["DEGRADED", "GIBBERISH"]}},
    "O": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "compiled",
          "engine": {"enforce_eager": False}, "expect": {"not_verdict": ["DEGRADED", "GIBBERISH"]}},
    "D": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "fp8 kv",
          "engine": {"kv_cache_dtype": "fp8_e5m2"}, "expect": {"not_verdict": ["DEGRADED", "GIBBERISH"]},
          "tags": ["precision"]},
    "E": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "stale",
          "env": {"DIFFCHECK_FAULT": "stale-decode-metadata", **FAULT}, "expect": {"verdict": "GIBBERISH"}},
    "M": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "lost head",
          "env": {"DIFFCHECK_FAULT": "lost-head", **FAULT}, "expect": {"verdict": "DEGRADED"}},
    "M9": {"inherits": "M", "description": "lost head in 9", "env": {"DIFFCHECK_FAULT_LAYER": "9"},
           "expect": {"verdict": "DEGRADED"}},
    "Mx": {"inherits": "M", "description": "lost head fixed", "env": {"DIFFCHECK_FAULT": "lost-head:fixed"},
           "expect": {"not_verdict": ["DEGRADED", "GIBBERISH"]}},
    "Z": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "slow",
          "engine": {"max_num_seqs": 1}, "expect": {"not_verdict": ["GIBBERISH"]}, "tags": ["slow"]},
    "W": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "fails for no fault",
          "engine": {"max_num_seqs": 3}, "expect": {"verdict": "GIBBERISH"}},
    "U": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "unlabelled",
          "env": {"DIFFCHECK_FAULT": "rope-offset"}},
}


@pytest.fixture
def plan_suite(tmp_path):
    return cases.load_suite(write_suite(tmp_path, PLAN_CASES, name="pl"))


def planned(suite, **kw):
    items = stl.plan(st.labelled_cases(suite, exclude_tags=(), include=kw.get("include")), n_layers=30, **kw)
    return {i.case.id: i for i in items}, items


def test_the_plan_runs_faults_at_their_step_with_layer_variants_and_benign_variants_at_the_faults_step(plan_suite):
    by_id, items = planned(plan_suite)
    assert [i.case.id for i in items] == ["S2", "O", "D", "E", "M", "M.layer1", "M.layer15", "M.layer29", "M9", "Mx", "Z", "W"]
    assert (by_id["E"].expected.site, by_id["E"].step) == ("layers.0.self_attn", 34)
    assert (by_id["M"].expected.site, by_id["M"].step) == ("layers.0.self_attn", 33)
    assert (by_id["M9"].expected.site, by_id["M9"].step) == ("layers.9.self_attn", 33)
    for layer in (1, 15, 29):  # derived once per fault (M9 has the same fault: no variants of its own)
        v = by_id[f"M.layer{layer}"]
        assert v.variant_of == "M" and v.case.env["DIFFCHECK_FAULT_LAYER"] == str(layer)
        assert v.case.env["DIFFCHECK_FAULT"] == "lost-head" and v.expected.layer == layer and v.step == 33
        assert v.fault == f"lost-head, layer {layer}, from decode step 32"
        assert cases.config_digest(v.case) != cases.config_digest(by_id["M"].case)
    # benign: nothing expected, at the faults' most common step (33: shares the reference's captures)
    for cid in ("S2", "Mx"):
        assert by_id[cid].expected is None and by_id[cid].step == 33 and not by_id[cid].skip
    assert "torch.compile" in by_id["O"].skip and "precision" in by_id["D"].skip
    assert "--case Z" in by_id["Z"].skip and "no expected site" in by_id["W"].skip
    assert "U" not in by_id  # unlabelled
    assert all(by_id[c].step is None for c in ("O", "D", "Z", "W"))


def test_a_case_named_with_case_is_run_even_when_tagged_slow(plan_suite):
    by_id, _ = planned(plan_suite, include={"Z"})
    assert list(by_id) == ["Z"] and not by_id["Z"].skip and by_id["Z"].step == F.DEFAULT_STEP + 1


def test_the_variants_layers_can_be_given(plan_suite):
    by_id, _ = planned(plan_suite, layers=(4,))
    assert [c for c in by_id if ".layer" in c] == ["M.layer4"]


def test_catalogue_faults_no_row_runs_are_noted(plan_suite):
    _, items = planned(plan_suite)
    notes = stl.uncovered(items)
    assert any(n.startswith("seq-lens-copy: acts only under FULL decode CUDA graphs") for n in notes)
    assert {n.split(":")[0] for n in notes} == {"kv-write-corruption", "rope-offset", "attn-noise", "seq-lens-copy"}


# -- the table's logic on synthetic localizations --------------------------------------------------

N_LAYERS, STEPS, DIM = 4, (29, 30, 31, 32, 33), 16
SITES = L.site_names(N_LAYERS)


def localization(moves=()):
    """A real `Localization` of synthetic captures: the candidate equals the reference except at `moves`
    ((step, layer, op, relative error)), and at every site after each move in that pass."""
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(1, len(STEPS), len(SITES), DIM))
    cand = ref.copy()
    for step, layer, op, size in moves:
        k, i = STEPS.index(step), SITES.index((layer, op))
        for j in range(i, len(SITES)):  # downstream of it in the same pass
            cand[0, k, j] = ref[0, k, j] * (1 + size)
    cap = lambda v, cid: L.Capture(case_id=cid, n_layers=N_LAYERS, steps=STEPS,  # noqa: E731
                                   norm=np.linalg.norm(v, axis=-1), proj=v.copy())
    r = cap(ref, "J")
    return L.localize(r, cap(cand, "X"), L.site_floors(r, [cap(ref.copy(), "J.floor")]))


def item(expected=None):
    return stl.Item(case=types.SimpleNamespace(id="M"), fault="x", expected=expected, step=33)


EXP = F.ExpectedSite(layer=2, op="self_attn", step=33)


@pytest.mark.parametrize("moves,ok", [
    ([(33, 2, "self_attn", 0.5)], True),  # the expected step, layer and op
    ([(33, 1, "self_attn", 0.5)], False),  # another layer
    ([(33, 2, "mlp", 0.5)], False),  # another op of that layer
    ([(32, 2, "self_attn", 0.5), (33, 2, "self_attn", 0.5)], False),  # an earlier step than the spec says
    ([], False),  # nothing named
    ([(33, 2, "self_attn", 1e-6)], False),  # inside the margin (1e-5): nothing named
])
def test_a_fault_row_is_ok_only_when_localize_names_its_step_layer_and_op(moves, ok):
    row = stl.judge(item(EXP), localization(moves))
    assert row.ok is ok
    assert row.expected == "step 33, layers.2.self_attn"
    assert row.named == ("nothing" if not moves or moves[0][3] < 1e-5 else f"step {moves[0][0]}, layers."
                         f"{moves[0][1]}.{moves[0][2]}")


def test_a_fault_row_named_as_inherited_is_not_ok():
    loc = localization([(33, 2, "self_attn", 0.5)])
    loc = dataclasses.replace(loc, first=dataclasses.replace(loc.first, inherited=True))
    row = stl.judge(item(EXP), loc)
    assert row.ok is False and "inherited" in row.note


@pytest.mark.parametrize("moves,ok", [([], True), ([(31, 0, "input_layernorm", 0.01)], False)])
def test_a_benign_row_is_ok_only_when_localize_names_nothing(moves, ok):
    row = stl.judge(item(None), localization(moves))
    assert row.ok is ok and row.expected == "nothing"
    assert row.named == ("nothing" if ok else "step 31, layers.0.input_layernorm")


def test_the_report_table_and_json_and_what_fails():
    rows = (stl.judge(item(EXP), localization([(33, 2, "self_attn", 0.5)])),
            stl.judge(item(None), localization([(31, 0, "mlp", 0.5)])),
            stl.skipped(dataclasses.replace(item(None), skip="compiled (enforce_eager is not true): ...")))
    from diffcheck.report.selftest_localize import SelftestLocalizeReport

    report = SelftestLocalizeReport(suite="pl", rows=rows, around=4, notes=("attn-noise: no labelled case",))
    assert [r.ok for r in report.failed] == [False] and len(report.passed) == 1
    text = render("terminal", report)
    for word in ("expected site", "named site", "step 33, layers.2.self_attn", "NO", "skip", "compiled",
                 "1 ok, 1 not ok, 1 skipped", "note: attn-noise"):
        assert word in text
    data = json.loads(render("json", report))
    assert data["failed"] == 1 and data["passed"] == 1 and len(data["rows"]) == 3
    assert data["rows"][0]["named"] == "step 33, layers.2.self_attn" and data["rows"][2]["ok"] is None


def test_missing_goldens_are_one_usage_error_before_any_engine(tmp_path):
    write_suite(tmp_path, PLAN_CASES, name="pl")
    out = subprocess.run([str(SCRIPT), "selftest", "--localize", "--suite", str(tmp_path / "pl.toml"),
                          "--goldens", str(tmp_path / "goldens"), "--case", "S2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("diffcheck: error: ") and "golden record J" in out.stderr
    assert "Traceback" not in out.stderr


def test_strict_does_not_apply_to_the_localize_selftest(tmp_path):
    write_suite(tmp_path, PLAN_CASES, name="pl")
    out = subprocess.run([str(SCRIPT), "selftest", "--localize", "--strict", "--suite", str(tmp_path / "pl.toml")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().startswith("diffcheck: error: --strict")
