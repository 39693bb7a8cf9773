"""`diffcheck reduce` without an engine: the searches, the probe cases, the cut golden, the script.

The oracles are independent of the code under test: known minimal subsets and thresholds
chosen by the test, brute force over every subset, hand-built runs.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import math
import tomllib
from pathlib import Path

import numpy as np
import pytest

from factories import write_suite

from diffcheck import cases
from diffcheck.cases import derive
from diffcheck.judging import reduce as search


# -- ddmin --------------------------------------------------------------------------------------------------


class Counted:
    def __init__(self, fails):
        self.fails, self.calls = fails, []

    def __call__(self, sub):
        self.calls.append(tuple(sub))
        return self.fails(set(sub))


@pytest.mark.parametrize("n, needed", [(8, {5}), (16, {0}), (16, {15}), (32, {7}), (3, {1}), (100, {42})])
def test_ddmin_finds_one_cause_in_about_2_log2_n_calls(n, needed):
    pred = Counted(lambda s: needed <= s)
    assert search.ddmin(range(n), pred) == tuple(sorted(needed))
    assert len(pred.calls) <= 2 * math.ceil(math.log2(n)), pred.calls
    assert () not in pred.calls and len(set(pred.calls)) == len(pred.calls)  # never empty, never twice


def test_ddmin_finds_two_causes_and_the_result_is_1_minimal():
    needed = {3, 11}
    pred = Counted(lambda s: needed <= s)
    got = search.ddmin(range(16), pred)
    assert set(got) == needed and list(got) == sorted(got)  # order kept
    assert len(pred.calls) <= 16 * 2


@pytest.mark.parametrize("seed", range(20))
def test_ddmin_is_1_minimal_for_random_monotone_predicates(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    # failing: the set holds at least one of a few random "causes" (each a small set)
    causes = [set(rng.choice(n, size=int(rng.integers(1, 3)), replace=False).tolist()) for _ in range(2)]
    fails = lambda s: any(c <= s for c in causes)  # noqa: E731
    got = set(search.ddmin(range(n), lambda sub: fails(set(sub))))
    assert fails(got)
    for x in got:  # removing any one element makes the failure go away
        assert not fails(got - {x})
    # brute force: no failing subset smaller than the smallest cause exists, and ddmin's is a cause
    smallest = min(len(c) for c in causes)
    assert all(not fails(set(sub)) for k in range(smallest) for sub in itertools.combinations(range(n), k))


def test_ddmin_of_one_item_asks_nothing():
    pred = Counted(lambda s: True)
    assert search.ddmin(["only"], pred) == ("only",) and pred.calls == []


# -- bisection on steps -------------------------------------------------------------------------------------


@pytest.mark.parametrize("lo, hi, first", [(5, 40, 13), (1, 256, 1), (1, 256, 256), (9, 10, 10), (7, 7, 7)])
def test_smallest_failing_finds_the_first_failing_step_in_log2_calls(lo, hi, first):
    calls = []

    def fails(t):
        calls.append(t)
        return t >= first

    assert search.smallest_failing(lo, hi, fails) == first
    assert len(calls) <= math.ceil(math.log2(hi - lo + 1)) and hi not in calls
    assert all(lo <= t < hi for t in calls)


def test_smallest_failing_refuses_an_empty_range():
    with pytest.raises(ValueError):
        search.smallest_failing(5, 4, lambda t: True)


def test_the_probe_bound():
    assert search.probe_bound(8, 256, 3) == math.ceil(2 * math.log2(8 * 256)) + 3 == 25
    assert search.probe_bound(1, 1, 0) == 2


# -- probe cases --------------------------------------------------------------------------------------------

PROMPTS = [{"id": "a", "text": "First prompt."}, {"id": "b", "text": "Second \"quoted\" prompt.\nTwo lines."},
           {"id": "c", "text": "Third.", "chat": False}]
CASES = {
    "J": {"role": "reference"},
    "E": {"inherits": "J", "role": "candidate", "references": ["J"],
          "env": {"DIFFCHECK_FAULT": "stale-decode-metadata", "DIFFCHECK_FAULT_STEP": "4"},
          "engine": {"max_num_seqs": 2, "enable_prefix_caching": False}, "expect": {"verdict": "GIBBERISH"}},
}


@pytest.fixture()
def suite(tmp_path):
    path = write_suite(tmp_path / "cases", CASES, name="red", prompts=PROMPTS,
                       sampling={"max_tokens": 40, "temperature": 0.7, "seed": 1},
                       engine={"dtype": "float32", "enforce_eager": True})
    return cases.load_suite(path)


def test_delta_units_come_from_the_factor_model_with_the_fault_as_one_unit(suite):
    units = search.delta_units(suite.cases["E"], suite.cases["J"])
    assert [u.keys for u in units] == [
        (("env", "DIFFCHECK_FAULT"), ("env", "DIFFCHECK_FAULT_STEP")),
        (("engine", "enable_prefix_caching"),),
        (("engine", "max_num_seqs"),),
    ]
    assert search.delta_units(suite.cases["J"], suite.cases["J"]) == []


def test_a_probe_is_a_case_of_its_own_with_the_dropped_keys_at_the_reference_values(suite, tmp_path):
    e, j = suite.cases["E"], suite.cases["J"]
    sub = tmp_path / "sub.toml"
    sub.write_text(derive.prompts_toml([cases.load_prompts(e)[1]]))
    probe = derive.derive(e, j, drop=[("engine", "max_num_seqs"), ("engine", "enable_prefix_caching")],
                          prompts_file=sub, max_tokens=12)
    assert probe.engine.max_num_seqs is None and probe.engine.enable_prefix_caching is None
    assert probe.env == e.env and probe.sampling.max_tokens == 12 and probe.sampling.seed == 1
    assert probe.references == ("J",) and probe.expect is None
    assert probe.id.startswith("E.r") and probe.id != e.id
    delta = cases.config_delta(probe, j)
    assert set(delta) == {"env.DIFFCHECK_FAULT", "env.DIFFCHECK_FAULT_STEP", "sampling.max_tokens", "prompts.count",
                          "prompts.digest"}
    # another probe, another id; the same probe, the same id (its runs and ledger rows are its own)
    other = derive.derive(e, j, prompts_file=sub, max_tokens=12)
    assert other.id != probe.id and other.engine.max_num_seqs == 2
    assert derive.derive(e, j, drop=[("engine", "max_num_seqs"), ("engine", "enable_prefix_caching")],
                         prompts_file=sub, max_tokens=12).id == probe.id
    # dropping the whole fault gives the reference's env
    assert derive.derive(e, j, drop=[("env", "DIFFCHECK_FAULT"), ("env", "DIFFCHECK_FAULT_STEP")]).env == j.env


def test_prompts_and_case_toml_load_back(suite, tmp_path):
    e, j = suite.cases["E"], suite.cases["J"]
    prompts = cases.load_prompts(e)
    folder = tmp_path / "out"
    (folder / "prompts").mkdir(parents=True)
    (folder / "prompts" / "p.toml").write_text(derive.prompts_toml(prompts, header="a header\ntwo lines"))
    assert cases._read_prompts(folder / "prompts" / "p.toml") == prompts
    text = ('[suite]\nname = "w"\ndescription = "d"\n\n'
            + derive.case_toml(j, case_id="R", prompts="prompts/p.toml", role="reference")
            + derive.case_toml(e, case_id="C", prompts="prompts/p.toml", role="candidate", references=["R"]))
    (folder / "w.toml").write_text(text)
    loaded = cases.load_suite(folder / "w.toml")
    assert cases.config_digest(loaded.cases["C"]) == cases.config_digest(e)
    assert cases.config_digest(loaded.cases["R"]) == cases.config_digest(j)


# -- the golden cut to a probe's prompts and steps ----------------------------------------------------------


def _run(lengths, k=2, prompt_ids=None):
    from diffcheck.core.types import Run, RunMeta, SequenceInfo, Steps

    prompt_ids = prompt_ids or [f"p{i}" for i in range(len(lengths))]
    seq = np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(lengths)])
    step = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    tok = (seq * 100 + step).astype(np.int32)
    steps = Steps(seq=seq, step=step, token_id=tok, logprob=-(step.astype(np.float32) / 10),
                  topk_ids=np.stack([tok] * k, 1), topk_logprobs=np.stack([-(step.astype(np.float32) / 10)] * k, 1))
    infos = tuple(SequenceInfo(prompt_id=p, prompt_token_ids=(1, 2), text=f"text {p}", finish_reason="stop",
                               n_tokens=n) for p, n in zip(prompt_ids, lengths))
    return Run(meta=RunMeta(suite="s", case_id="J", role="reference"), sequences=infos, steps=steps)


def test_prefix_view_takes_the_prompts_in_order_and_their_first_steps():
    from diffcheck.judging.align import align, prefix_view

    run = _run([5, 3, 7])
    cut = prefix_view(run, ["p2", "p0"], 4, decode=lambda ids: ",".join(map(str, ids)))
    assert [s.prompt_id for s in cut.sequences] == ["p2", "p0"]
    assert [s.n_tokens for s in cut.sequences] == [4, 4]
    assert cut.steps.token_id.tolist() == [200, 201, 202, 203, 0, 1, 2, 3]
    assert cut.steps.seq.tolist() == [0] * 4 + [1] * 4 and cut.steps.step.tolist() == [0, 1, 2, 3] * 2
    assert cut.sequences[0].text == "200,201,202,203" and cut.sequences[0].finish_reason == "length"
    assert cut.steps.topk_ids.shape == (8, 2)
    # a sequence shorter than the cut stays whole, text and finish reason included
    short = prefix_view(run, ["p1"], 10)
    assert short.sequences[0] == run.sequences[1] and short.steps.token_id.tolist() == [100, 101, 102]
    # the cut of a run is what a probe's candidate is aligned against
    assert align(cut, prefix_view(run, ["p2", "p0"], 4)).t_star.tolist() == [-1, -1]
    with pytest.raises(Exception, match="no sequence for prompt 'zz'"):
        prefix_view(run, ["zz"], 3)


# -- the script ---------------------------------------------------------------------------------------------


def _result(suite):
    from diffcheck.core.types import CaseVerdict, SequenceVerdict, Verdict
    from diffcheck.workflows.reduce import Probe, ReduceResult

    e, j = suite.cases["E"], suite.cases["J"]
    seq = SequenceVerdict(index=0, prompt_id="a", verdict=Verdict.GIBBERISH, t_star=5, onset=6, shared_prefix=5,
                          reference_len=12, candidate_len=12, evidence=("word salad",))
    v = CaseVerdict(candidate_id=e.id, reference_id="J", verdict=Verdict.GIBBERISH, sequences=(seq,))
    spec = {"sides": {"reference": {"llm": {"model": "/m", "dtype": "float32", "enforce_eager": True}, "env": {}},
                      "candidate": {"llm": {"model": "/m", "dtype": "float32", "enforce_eager": True},
                                    "env": {"DIFFCHECK_FAULT": "stale-decode-metadata",
                                            "DIFFCHECK_FAULT_STEP": "4"}}},
            "sampling": {"max_tokens": 12, "temperature": 0.7, "seed": 1, "logprobs": 5},
            "prompt_token_ids": {"a": [1, 2, 3]}, "model": "/models/smollm2", "on_cpu": True}
    probes = (Probe(1, "original", e.id, ("a", "b", "c"), 40, ("fault",), "GIBBERISH", True, False, 12.0),
              Probe(2, "steps", "E.r1", ("a",), 12, ("fault",), "GIBBERISH", True, True, 0.1))
    return ReduceResult(
        suite="red", case_id="E", reference_id="J", verdict="GIBBERISH", original=v, final=v, minimal=e,
        reference_case=j, prompts=tuple(cases.load_prompts(e)[:1]), prompt_token_ids={"a": [1, 2, 3]}, max_tokens=12,
        original_prompts=3, original_max_tokens=40, onset=6, t_star=5, dropped=("max_num_seqs",), kept=("fault",),
        config_delta={"env.DIFFCHECK_FAULT": (None, "stale-decode-metadata")}, fails_alone=True,
        batch_note="one prompt", probes=probes, bound=17, seconds=12.1, versions={"python": "3.12", "vllm": "0.32"},
        script=spec, command="diffcheck reduce E")


def test_the_script_is_valid_python_that_imports_only_vllm_and_the_standard_library(suite):
    import sys

    from diffcheck.report.reduce import render_script

    text = render_script(_result(suite))
    tree = ast.parse(text)
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "vllm" in imported and "diffcheck" not in imported
    assert imported - {"vllm"} <= set(sys.stdlib_module_names), imported
    assert "the fault plugin must be installed" in ast.get_docstring(tree)
    # the data the script runs on is the result's, as Python literals
    consts = {t.targets[0].id: ast.literal_eval(t.value) for t in tree.body
              if isinstance(t, ast.Assign) and isinstance(t.targets[0], ast.Name)
              and t.targets[0].id in ("CONFIGS", "SAMPLING", "PROMPTS", "THRESHOLD")}
    assert consts["CONFIGS"]["candidate"]["env"]["DIFFCHECK_FAULT_STEP"] == "4"
    assert consts["SAMPLING"]["max_tokens"] == 12 and consts["PROMPTS"][0]["prompt_token_ids"] == [1, 2, 3]
    assert consts["THRESHOLD"] > 0


def test_the_script_decides_by_the_same_context_logprob_gap(suite, tmp_path):
    """The script's compare(), run on hand-made outputs (no vLLM: its functions only)."""
    from diffcheck.report.reduce import render_script

    namespace: dict = {"__name__": "not_main"}
    exec(compile(render_script(_result(suite)), "reduce.py", "exec"), namespace)  # defines, runs nothing
    same = {"tokens": [1, 2, 3], "steps": [{"1": -0.1}, {"2": -0.2}, {"3": -0.3}], "text": "x"}
    near = {"tokens": [1, 2, 4], "steps": [{"1": -0.1}, {"2": -0.25}, {"4": -0.2, "3": -0.4}], "text": "y"}
    far = {"tokens": [1, 9, 9], "steps": [{"1": -0.1}, {"9": -0.1, "2": -3.0}, {"9": -0.1}], "text": "z"}
    assert namespace["compare"](same, same) == (None, 0.0, None)
    t_star, worst, bad = namespace["compare"](same, near)
    assert t_star == 2 and bad is None and worst == pytest.approx(0.1)
    t_star, worst, bad = namespace["compare"](same, far)
    assert t_star == 1 and bad == 1 and worst == pytest.approx(2.8)


def test_the_markdown_report_and_json_render(suite):
    import json

    from diffcheck.report import registry

    result = _result(suite)
    md = registry.render("markdown", result)
    for needle in ("## Versions", "| vLLM | 0.32", "env.DIFFCHECK_FAULT", "2 probes", "1 came\nfrom the ledger",
                   "```python", "max_num_seqs"):
        assert needle in md, needle
    doc = json.loads(registry.render("json", result))
    assert doc["schema"] == "diffcheck.reduce" and doc["probes"][1]["reused"] is True
    text = registry.render("terminal", result)
    assert "reduce E: GIBBERISH against J with 1 of 3 prompts, 12 of 40 tokens" in text


def test_write_case_appends_a_loadable_case_and_refuses_to_half_write(suite, tmp_path):
    from diffcheck.workflows.reduce import write_case

    result = _result(suite)
    target = tmp_path / "more" / "reduced.toml"
    target.parent.mkdir()
    assert write_case(result, target) == ("E-reduced", "J-for-E-reduced")
    loaded = cases.load_suite(target)
    assert set(loaded.cases) == {"E-reduced", "J-for-E-reduced"}
    assert loaded.cases["E-reduced"].references == ("J-for-E-reduced",)
    first = target.read_text()
    with pytest.raises(Exception, match="does not load back"):  # the same ids again: a duplicate table
        write_case(result, target)
    assert target.read_text() == first
    assert tomllib.loads(first)["suite"]["name"] == "reduced"
