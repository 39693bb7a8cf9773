"""`diffcheck localize` on the real engine: the lost-head fault in one chosen layer is named as that
layer's attention, from the step the fault spec says it first acts; what follows it is inherited; a
benign variant (another batch shape) names nothing. One engine per configuration, reused."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ROOT
from factories import write_suite

pytestmark = pytest.mark.engine

STEP, AROUND, TOKENS = 7, 4, 10  # capture steps 3..7; the faults act from decode step 3 (output token 4)
FAULT = {"DIFFCHECK_FAULT": "lost-head", "DIFFCHECK_FAULT_STEP": "3"}
CASES = {
    "J": {"role": "reference", "description": "eager fp32 reference"},
    "S1": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "one sequence at a time",
           "engine": {"max_num_seqs": 1}},
    "M5": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "lost head in layer 5",
           "env": {**FAULT, "DIFFCHECK_FAULT_LAYER": "5"}},
    "M17": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "lost head in layer 17",
            "env": {**FAULT, "DIFFCHECK_FAULT_LAYER": "17"}},
}


@pytest.fixture(scope="session")
def localized(tmp_path_factory):
    """The suite, its golden, and the workflow run on each candidate with one shared engine session."""
    from diffcheck import cases, workspace
    from diffcheck.engines import session as sessionmod
    from diffcheck.workflows import calibrate, localize

    folder = tmp_path_factory.mktemp("localize")
    suite = cases.load_suite(write_suite(
        folder, CASES, name="loc", description="localize engine test", prompts=ROOT / "cases" / "prompts" / "smoke-en.toml",
        sampling={"max_tokens": TOKENS, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 1234, "logprobs": 5},
        engine={"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_gib": 1}))
    root = folder / "goldens"
    restart = tuple(p for p in calibrate.PERTURBATIONS if p.name == "restart")  # 2 prompts: batch3/5 = J's shape
    captures, results = {}, {}
    with sessionmod.EngineSession(taps=True) as session:
        golden = sessionmod.generate(suite.cases["J"], session=session, echo=lambda _: None)
        workspace.store_golden(root, suite.cases["J"], golden)
        for cid in ("M5", "M17", "S1"):
            results[cid] = localize.localize(suite.cases[cid], suite=suite, root=root, step=STEP, around=AROUND,
                                             perturbations=restart, session=session, captures=captures,
                                             echo=lambda _: None)
    for cid, r in results.items():  # what the run measured, for docs/localize.md (pytest -s)
        loc = r.localization
        print(cid, loc.first and (loc.first.step, loc.first.site, loc.first.ratio, loc.first.inherited),
              "max rel", float(np.nanmax(loc.worst_by_step)), "floors max", float(loc.floors.max()), r.timings)
    return suite, results, captures


def expected(suite, cid):
    """(step, layer, op) where the fault spec says the fault first acts: decode step N produces token N + 1."""
    from diffcheck.cases.faults import parse_env

    spec = parse_env(suite.cases[cid].env)
    return spec.step + 1, spec.layer, "self_attn"


@pytest.mark.parametrize("cid", ["M5", "M17"])
def test_the_lost_head_is_named_as_its_layers_attention(localized, cid):
    suite, results, _ = localized
    first = results[cid].localization.first
    assert first is not None
    assert (first.step, first.layer, first.op) == expected(suite, cid)
    assert not first.inherited and first.ratio > 10
    assert all(e <= m for _, e, m in first.inputs)  # its input was inside its floor


def test_what_follows_the_faulty_attention_inherits_it(localized):
    from diffcheck.judging import localize as L

    suite, results, captures = localized
    by_case = {key[0]: cap for key, cap in captures.items()}
    loc = L.localize(by_case["J"], by_case["M5"], results["M5"].localization.floors, n_worst=10_000)
    step, layer, _ = expected(suite, "M5")
    others = {(f.layer, f.op): f for f in loc.worst}
    assert others[(layer, "post_attention_layernorm")].inherited
    assert others[(layer, "mlp")].inherited
    assert others[(layer + 1, "self_attn")].inherited
    assert all(f.inherited for f in loc.worst)  # nothing else is blamed
    assert all(f.layer is not None and f.layer >= layer for f in loc.worst)  # nothing before the faulty layer moved


def test_a_benign_batch_shape_names_nothing(localized):
    _, results, _ = localized
    loc = results["S1"].localization
    assert loc.first is None and loc.beyond_sites == 0
