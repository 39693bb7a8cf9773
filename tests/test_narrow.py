"""Narrowing (diffcheck/judging/narrow.py, factors.py, next_cases.py) and `diffcheck matrix
--from-outcomes`: no engine.

The oracle is a brute force written here: every conjunction of the literals the bad
cases carry, checked against every case, with none of narrow.py's search code. The
inputs: the seed's recorded outcomes (cases/outcomes/), small made-up factor sets, the
default suite's labels, and the verdicts of the real H200 runs committed under
goldens/gpu-h200/, re-judged here.
"""

from __future__ import annotations

import itertools
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from diffcheck import cases
from diffcheck.cases.outcomes import load_outcomes
from diffcheck.core.errors import ConfigError
from diffcheck.judging import factors, narrow
from diffcheck.workflows import matrix as mx

ROOT = Path(__file__).resolve().parent.parent
SEED_SUITE = ROOT / "cases" / "flash-v100-quality.toml"
SEED_OUTCOMES = ROOT / "cases" / "outcomes" / "flash-v100-quality.toml"


def brute_force(outcomes: dict[str, str], facts: dict[str, frozenset]) -> list[frozenset]:
    """Every inclusion-minimal conjunction true in all bad cases and in no clean case."""
    bad = [facts[c] for c, o in outcomes.items() if o == "bad"]
    clean = [facts[c] for c, o in outcomes.items() if o == "clean"]
    universe = sorted(set().union(*bad), key=str)
    fits = []
    for size in range(len(universe) + 1):
        for combo in itertools.combinations(universe, size):
            s = frozenset(combo)
            if all(s <= b for b in bad) and not any(s <= c for c in clean) and not any(f <= s for f in fits):
                fits.append(s)
    return fits


def texts(literals) -> set[str]:
    return {str(lit) for lit in literals}


@pytest.fixture(scope="module")
def seed():
    suite = cases.load_suite(SEED_SUITE)
    return suite, mx.from_outcomes(suite, SEED_OUTCOMES)


def test_the_seed_reaches_its_conclusion(seed):
    suite, result = seed
    n = result.narrowing
    assert set(n.bad) == set("ADEGHLMN") and set(n.clean) == set("BFIJKOPQ")
    assert result.left_out == ("C",)  # the first-token comparison is not a quality verdict
    assert n.single and len(n.causes) == 1
    main = n.causes[0]
    assert texts(main.literals) == {"decode_graph=FULL", "attention_backend=FLASH_ATTN_V100",
                                    "tensor_parallel_size=4", "code=pre-fix"}
    assert set(main.cases) == set("AEGHLMN")
    assert not n.alternatives  # each of the four literals is needed: nothing else fits
    needed = {str(lit): set(held) for lit, held in main.needed}
    assert needed == {"attention_backend=FLASH_ATTN_V100": {"B", "F"}, "code=pre-fix": {"O", "P", "Q"},
                      "decode_graph=FULL": {"J", "K"}, "tensor_parallel_size=4": {"I"}}
    # fp8 KV: a separate cause (D), which D's main-cause factors leave open
    assert [(texts(s.literals), s.cases, s.also_main) for s in n.separate] == [({"kv_cache_dtype=fp8_e5m2"}, ("D",), ("D",))]
    # the toggles the log calls "not root"
    assert {str(lit) for lit, _ in n.not_needed} == {"VLLM_FLASH_V100_DYNAMIC_PARTITIONS=0", "compile_mode=0",
                                                     "VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0",
                                                     "VLLM_GDN_FLASHQLA_DECODE=0"}
    assert n.same_output.get("G") == "E" and n.same_output.get("K") == "J"


def test_the_seed_against_a_brute_force_oracle(seed):
    suite, result = seed
    rec = load_outcomes(SEED_OUTCOMES, suite=suite)
    ids = [c for c, r in rec.ids.items() if r.outcome != "not-a-verdict"]
    facts = factors.case_factors({c: cases.resolved_config(suite.cases[c]) for c in ids},
                                baseline=cases.resolved_config(suite.cases["J"]),
                                explicit={c: rec.ids[c].factors for c in ids})
    outcomes = {c: rec.ids[c].outcome for c in ids if c != "D"}  # D: the precision change, set aside
    oracle = brute_force(outcomes, facts)
    assert [texts(s) for s in oracle] == [texts(result.narrowing.causes[0].literals)]
    # with D in the must-explain set the same conjunction still fits: D is confounded, not refuted
    assert brute_force({**outcomes, "D": "bad"}, facts) == oracle


def test_the_next_case_splits_the_open_question_and_loads_as_a_case(seed, tmp_path):
    suite, result = seed
    n = result.narrowing
    assert len(n.next_cases) == 1
    nc = n.next_cases[0]
    assert nc.base == "D"
    (old, new), = nc.toggles
    assert str(old) in texts(n.causes[0].literals)  # it turns one literal of the main cause off
    # pasted into the suite, it loads, inherits D and differs from D only by that toggle
    text = SEED_SUITE.read_text() + "\n" + n.toml()
    (tmp_path / "prompts").symlink_to(SEED_SUITE.parent / "prompts")
    path = tmp_path / "flash-v100-quality.toml"
    path.write_text(text)
    loaded = cases.load_suite(path)
    variant = loaded.cases[nc.case_id]
    delta = cases.config_delta(variant, loaded.cases["D"])
    assert list(delta) == [f"{new.source}.{new.name}"] and delta[f"{new.source}.{new.name}"][1] == new.value
    # predictions differ: the main cause is false in the variant, fp8 KV is still there
    facts = factors.case_factors({"D": cases.resolved_config(loaded.cases["D"]),
                                 "V": cases.resolved_config(variant)},
                                baseline=cases.resolved_config(loaded.cases["J"]))
    assert "kv_cache_dtype=fp8_e5m2" in texts(facts["V"])
    assert str(new) in texts(facts["V"]) and str(old) not in texts(facts["V"])
    assert tomllib.loads(n.toml())["cases"][nc.case_id]["inherits"] == "D"


def test_matrix_from_outcomes_cli(tmp_path):
    from diffcheck.cli import cli

    md = tmp_path / "seed.md"
    res = CliRunner().invoke(cli, ["matrix", "--from-outcomes", str(SEED_OUTCOMES), "--suite", str(SEED_SUITE),
                                   "--md", str(md)], obj={})
    assert res.exit_code == 0, res.output
    assert ("attention_backend=FLASH_ATTN_V100 ∧ code=pre-fix ∧ decode_graph=FULL ∧ tensor_parallel_size=4"
            in res.output)
    assert "separate cause (a precision change): kv_cache_dtype=fp8_e5m2 explains D" in res.output
    page = md.read_text()
    assert "| case | vs | config delta | verdict |" in page and "## Next cases worth running" in page
    row = next(line for line in page.splitlines() if line.startswith("| O |"))
    assert "| clean |" in row and "121.3" in row and "0.0060" in row
    assert next(line for line in page.splitlines() if line.startswith("| G |")).endswith("| E |")


def test_several_causes_give_a_greedy_cover_that_the_oracle_confirms():
    L = lambda k, v: factors.Literal("engine", k, v)  # noqa: E731
    facts = {
        "a1": frozenset({L("x", 1), L("y", 0), L("z", 0)}), "a2": frozenset({L("x", 1), L("y", 1), L("z", 0)}),
        "b1": frozenset({L("x", 0), L("y", 0), L("z", 1)}),
        "c1": frozenset({L("x", 0), L("y", 0), L("z", 0)}), "c2": frozenset({L("x", 0), L("y", 1), L("z", 0)}),
    }
    outcomes = {"a1": "bad", "a2": "bad", "b1": "bad", "c1": "clean", "c2": "clean"}
    assert brute_force(outcomes, facts) == []  # no single conjunction
    n = narrow.narrow(outcomes, facts)
    assert not n.single
    assert sorted((texts(c.literals), c.cases) for c in n.causes) == sorted([({"x=1"}, ("a1", "a2")), ({"z=1"}, ("b1",))])
    for cause in n.causes:  # each term is true in its cases and in no clean case
        assert all(frozenset(cause.literals) <= facts[c] for c in cause.cases)
        assert not any(frozenset(cause.literals) <= facts[c] for c in ("c1", "c2"))
    assert any("no single conjunction explains it: 2 causes" in line for line in n.lines())


def test_equal_factors_with_opposite_outcomes_are_a_contradiction():
    lit = factors.Literal("engine", "x", 1)
    n = narrow.narrow({"H": "bad", "O": "clean"}, {"H": frozenset({lit}), "O": frozenset({lit})})
    assert n.contradictions == (("H", "O"),) and not n.causes
    assert "contradiction: bad H and clean O have the same factors" in "\n".join(n.lines())


def test_tied_conjunctions_stand_until_a_next_case_splits_them():
    L = lambda k, v: factors.Literal("engine", k, v)  # noqa: E731
    facts = {"b": frozenset({L("x", 1), L("y", 1)}), "c": frozenset({L("x", 0), L("y", 0)})}
    n = narrow.narrow({"b": "bad", "c": "clean"}, facts)
    assert n.single and len(n.alternatives) == 1
    assert sorted([sorted(texts(n.causes[0].literals)), sorted(texts(n.alternatives[0]))]) == [["x=1"], ["y=1"]]
    (nc,) = n.next_cases
    (old, new), = nc.toggles
    variant = (facts["b"] - {old}) | {new}
    # exactly one of the two explanations holds in the variant: its outcome decides
    assert sum(frozenset(h) <= variant for h in (n.causes[0].literals, n.alternatives[0])) == 1


@pytest.mark.parametrize("line, words", [
    ('A = { outcome = "meh", reason = "r" }', "ids.A.outcome: must be one of bad, clean, not-a-verdict"),
    ('A = { outcome = "bad" }', "ids.A.reason: must be one non-empty line"),
    ('A = { outcome = "bad", reason = "r", colour = 1 }', "ids.A.colour: unknown key"),
    ('Z = { outcome = "bad", reason = "r" }', "ids.Z: no case 'Z'"),
    ('A = { outcome = "bad", reason = "r", metrics = { digits = 1 } }', "ids.A.metrics.digits: unknown metric"),
])
def test_bad_outcomes_files_are_refused_in_one_line(tmp_path, line, words):
    suite = cases.load_suite(SEED_SUITE)
    path = tmp_path / "o.toml"
    path.write_text(f'[outcomes]\nsuite = "flash-v100-quality"\nbaseline = "J"\n[ids]\n{line}\n')
    with pytest.raises(ConfigError) as err:
        load_outcomes(path, suite=suite)
    message = err.value.message
    assert "\n" not in message and message.startswith(str(path)) and words in message


# -- the default suite's labels -----------------------------------------------------------------------

DEFAULT_SUITE = ROOT / "cases" / "default.toml"


def test_narrowing_the_default_suite_labels_names_each_fault():
    """The default suite's labelled CPU cases, bad or clean by their labels (`expect.verdict`
    through `fails`), not by verdicts: their runs are not committed and `make test` does not
    record them (test_selftest judges the labels against real runs). What this checks is the
    narrowing of the suite's factor structure under those outcomes."""
    from diffcheck.core.types import fails
    from diffcheck.workflows import selftest

    suite = cases.load_suite(DEFAULT_SUITE)
    outcomes = {c.id: "bad" if c.expect.verdict is not None and fails(c.expect.verdict) else "clean"
                for c in selftest.labelled_cases(suite)}
    outcomes["J"] = "clean"  # the reference
    assert {c for c, o in outcomes.items() if o == "bad"} == {"E", "H", "K", "N", "M"}  # the labels reasoned over
    n = mx.narrow_suite(suite, outcomes)
    print("\n".join(n.lines()))
    assert not n.single  # no single conjunction: the faults differ
    # The smallest cover the data allows: the eager fault cases share DIFFCHECK_FAULT_STEP=32 with
    # enforce_eager=true (P, the fixed fault, is compiled), H (compiled) needs its fault's name.
    got = sorted((sorted(texts(c.literals)), sorted(c.cases)) for c in n.causes)
    assert got == [(["DIFFCHECK_FAULT=stale-decode-metadata"], ["H"]),
                   (["DIFFCHECK_FAULT_STEP=32", "enforce_eager=true"], ["E", "K", "M", "N"])]
    facts = factors.case_factors({c: cases.resolved_config(suite.cases[c]) for c in outcomes},
                                 baseline=cases.resolved_config(suite.cases["J"]))
    assert brute_force(outcomes, facts) == []  # the oracle agrees: no single conjunction
    for cause in n.causes:
        assert not any(frozenset(cause.literals) <= facts[c] for c, o in outcomes.items() if o == "clean")
    assert any("no single conjunction explains it: 2 causes" in line for line in n.lines())
    # The fault names are the competing explanation; one next case splits the two.
    assert {str(lit) for lit, _ in n.not_needed} >= {"DIFFCHECK_FAULT=kv-write-corruption", "DIFFCHECK_FAULT=rope-offset",
                                                     "DIFFCHECK_FAULT=lost-head"}
    (nc,) = n.next_cases
    (old, new), = nc.toggles
    variant = (facts[nc.base] - {old}) | {new}
    cover = any(frozenset(c.literals) <= variant for c in n.causes)
    names = any(lit.name == "DIFFCHECK_FAULT" and lit.value in ("stale-decode-metadata", "kv-write-corruption",
                                                                "rope-offset", "lost-head") for lit in variant)
    assert cover != names


# -- the H200 runs' verdicts ----------------------------------------------------------------------------

GPU_SUITE_FILE = ROOT / "cases" / "gpu-h200.toml"


def test_narrowing_the_recorded_h200_verdicts_finds_the_graph_fault(tmp_path):
    """Outcomes from real verdicts: each candidate's H200 run committed under goldens/gpu-h200/ is
    re-judged here with no engine (`api.compare_case(..., run_file=...)`, in a copy of the folder,
    forced and scored files included) and is bad exactly when `fails`. J, the reference the
    factors are taken against, is clean; F (a reference, recorded for J's noise floor) is left out.
    Checked: the verdicts (only H, seq-lens-copy under a FULL decode graph, is bad; HE, the same
    fault under eager, is clean), the conjunctions against the brute-force oracle, and the next
    case, which loads as a case, differs from H by one toggle and is predicted bad by exactly one
    of the two standing explanations."""
    import shutil

    from diffcheck import api
    from diffcheck.core.types import fails

    suite = cases.load_suite(GPU_SUITE_FILE)
    copy = tmp_path / "goldens"
    shutil.copytree(ROOT / "goldens" / suite.name, copy / suite.name)
    candidates = sorted(c for c, case in suite.cases.items() if case.role == "candidate")
    assert candidates == ["H", "HE", "L", "O", "OF"]
    outcomes = {"J": "clean"}
    for cid in candidates:
        comparison = api.compare_case(cid, suite=suite, goldens=copy, run_file=copy / suite.name / f"{cid}.run.parquet")
        outcomes[cid] = "bad" if fails(comparison.verdict) else "clean"
    assert outcomes == {"J": "clean", "H": "bad", "HE": "clean", "L": "clean", "O": "clean", "OF": "clean"}

    facts = factors.case_factors({c: cases.resolved_config(suite.cases[c]) for c in outcomes},
                                 baseline=cases.resolved_config(suite.cases["J"]))
    n = narrow.narrow(outcomes, facts)
    print("\n".join(n.lines()))
    assert n.single and n.causes[0].cases == ("H",)
    standing = [n.causes[0].literals, *n.alternatives]
    assert sorted(sorted(texts(h)) for h in standing) == sorted(sorted(texts(h)) for h in brute_force(outcomes, facts))
    # The fault needs the graph: HE (eager) and the clean graphs (O, OF, L) rule out either alone,
    # and this matrix cannot tell "a CUDA graph" from "not eager", which change together in it.
    assert sorted(sorted(texts(h)) for h in standing) == [
        ["DIFFCHECK_FAULT=seq-lens-copy", "cudagraph_mode=FULL_DECODE_ONLY"],
        ["DIFFCHECK_FAULT=seq-lens-copy", "enforce_eager=false"]]
    (nc,) = n.next_cases
    (old, new), = nc.toggles
    assert nc.base == "H" and old.name in ("cudagraph_mode", "enforce_eager")
    variant = (facts["H"] - {old}) | {new}
    assert sum(frozenset(h) <= variant for h in standing) == 1  # its outcome decides between the two
    # pasted into the suite, it loads and differs from H only by that toggle
    (tmp_path / "prompts").symlink_to(GPU_SUITE_FILE.parent / "prompts")
    path = tmp_path / GPU_SUITE_FILE.name
    path.write_text(GPU_SUITE_FILE.read_text() + "\n" + n.toml())
    loaded = cases.load_suite(path)
    delta = cases.config_delta(loaded.cases[nc.case_id], loaded.cases["H"])
    assert list(delta) == [f"{new.source}.{new.name}"] and delta[f"{new.source}.{new.name}"][1] == new.value
