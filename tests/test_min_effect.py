"""The minimum effect of interest (issue 21): a user-set number, not a hidden resolution.

A case (or its suite's ``[defaults]``) sets ``min_effect = { kl = ..., loss = ... }``; the
margins of that case's comparisons are max(floor_factor x floor, min_effect), and every
verdict says which of the two set each margin (evidence and JSON). No engine: suites are
written to a temporary folder, runs are synthetic with a known loss per step."""

from __future__ import annotations

import json

import numpy as np
import pytest

from diffcheck import cases
from diffcheck.cli import main
from diffcheck.core.errors import ConfigError
from diffcheck.core.types import Verdict
from diffcheck.judging.classify import compare_runs
from diffcheck.judging.floor import Floor
from diffcheck.judging.tolerances import Tolerances

from factories import make_run, write_suite

CANDIDATE = {"role": "candidate", "references": ["J"], "description": "candidate"}


# ---------------------------------------------------------------- the setting, in a suite


def _suite(tmp_path, defaults_extra: str = "", case_extra: str = ""):
    path = write_suite(tmp_path, {"J": {"role": "reference", "description": "reference"}, "O": CANDIDATE})
    text = path.read_text().replace("[defaults]\n", "[defaults]\n" + defaults_extra, 1)
    text = text.replace('[cases.O]\n', '[cases.O]\n' + case_extra, 1)
    path.write_text(text)
    return path


def test_the_defaults_are_the_documented_numbers_so_verdicts_do_not_move():
    tol = Tolerances()
    assert (tol.min_effect_kl, tol.min_effect_loss) == (1e-3, 0.02)
    assert tol.min_effect == {"kl": 1e-3, "loss": 0.02}


def test_min_effect_flows_from_the_suites_defaults_and_the_case_into_its_tolerances(tmp_path):
    path = _suite(tmp_path, defaults_extra="min_effect = { kl = 2e-3, loss = 0.01 }\n",
                  case_extra="min_effect = { loss = 0.005 }\n")
    suite = cases.load_suite(path)
    # the case overrides one key, inherits the other from [defaults]
    assert suite.cases["O"].min_effect == {"kl": 2e-3, "loss": 0.005}
    assert suite.cases["J"].min_effect == {"kl": 2e-3, "loss": 0.01}
    tol = Tolerances.of_case(suite.cases["O"])
    assert (tol.min_effect_kl, tol.min_effect_loss) == (2e-3, 0.005)
    # a case without one judges with the defaults
    plain = cases.load_suite(_suite(tmp_path / "plain"))
    assert plain.cases["O"].min_effect == {} and Tolerances.of_case(plain.cases["O"]) == Tolerances()


@pytest.mark.parametrize("line, message", [
    ("min_effect = 0.01\n", "min_effect must be a table like { kl = 1e-3, loss = 0.02 }"),
    ("min_effect = { kl = -1 }\n", "min_effect.kl must be >= 0, got -1 (nats per step)"),
    ("min_effect = { loss = \"0.1\" }\n", "min_effect.loss must be a finite number"),
    ("min_effect = { loss = inf }\n", "min_effect.loss must be a finite number, got inf"),
    ("min_effect = { kld = 0.1 }\n", "unknown key 'min_effect.kld' (valid: kl, loss)"),
    ("tolerances = { loss_resolution = 0.01 }\n",
     "tolerances.loss_resolution is the minimum effect of interest: set min_effect = { loss = ... } instead"),
])
def test_a_bad_min_effect_is_one_line_naming_the_file_and_the_field(tmp_path, capsys, line, message):
    path = _suite(tmp_path, defaults_extra=line)
    with pytest.raises(ConfigError) as info:
        cases.load_suite(path)
    text = str(info.value)
    assert message in text and "\n" not in text and "t.toml: [defaults]: " in text
    assert main(["cases", "list", "--suite", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diffcheck: error: ") and len(err.strip().splitlines()) == 1 and message in err


def test_a_case_level_min_effect_is_checked_too(tmp_path):
    with pytest.raises(ConfigError, match=r"case 'O': min_effect.kl must be >= 0"):
        cases.load_suite(_suite(tmp_path, case_extra="min_effect = { kl = -0.5 }\n"))


# ---------------------------------------------------------------- the margin it sets


N = 256


def _pair(loss_per_step: float, seed: int = 0):
    """A reference and a candidate with the same tokens; the candidate's forced replay gives the
    reference's token `loss_per_step` nats less (± 0.002 noise), its top-k lists the reference's."""
    tokens = [list(range(100, 100 + N))]
    rng = np.random.default_rng(seed)
    lp = -0.1 - (loss_per_step + rng.normal(0.0, 0.002, N))
    ref = make_run(tokens, k=4, role="reference", case_id="J")
    cand = make_run(tokens, k=4, role="candidate", case_id="O")
    forced = make_run(tokens, k=4, kind="forced", role="candidate", case_id="O", logprobs=[lp])
    return ref, cand, forced


def test_a_loss_of_001_per_token_passes_under_the_default_and_fails_under_a_smaller_min_effect():
    # the accumulation bug: 0.01 nats/token is inside the default 0.02, by the user's choice
    ref, cand, forced = _pair(0.01)
    floor = Floor(replicas=("batch3",), n_steps=1000)  # measured, exactly 0 (the CPU lane's)
    default = compare_runs(ref, cand, forced=forced, floor=floor)
    s = default.sequences[0]
    assert default.verdict is Verdict.IDENTICAL, s.evidence
    loss = s.stats["effects"]["loss"]
    assert loss["margin"] == 0.02 and loss["set_by"] == "min_effect" and loss["within"]
    tight = compare_runs(ref, cand, forced=forced, floor=floor,
                         tolerances=Tolerances.from_dict({"min_effect": {"loss": 0.005}}))
    t = tight.sequences[0]
    assert tight.verdict is Verdict.DEGRADED, t.evidence
    assert t.stats["effects"]["loss"]["margin"] == 0.005 and t.stats["effects"]["loss"]["beyond"]


def test_every_verdict_says_what_set_its_margins_and_a_floor_of_0_says_so():
    ref, cand, forced = _pair(0.001)
    zero = compare_runs(ref, cand, forced=forced, floor=Floor(replicas=("batch3",), n_steps=1000))
    s = zero.sequences[0]
    text = " | ".join(s.evidence)
    assert "margin 0.001 set by min_effect" in text and "margin 0.02 set by min_effect" in text
    assert "floor 0: margins are the minimum effect of interest" in text
    m = zero.summary["floor"]["margins"]
    assert m["kl"] == {"margin": 1e-3, "set_by": "min_effect", "floor_x_factor": 0.0, "min_effect": 1e-3}
    assert m["loss"]["set_by"] == "min_effect" and zero.summary["min_effect"] == {"kl": 1e-3, "loss": 0.02}
    assert m["text"].startswith("floor 0: margins are the minimum effect of interest")
    # a floor whose 4x is above the minimum effect sets the margin itself: 4 x 0.01 = 0.04 for the loss
    noisy = Floor(replicas=("batch3",), n_steps=1000, kl_seq_max=1e-4, loss_seq_max=0.01, kl_step_max=1e-3,
                  loss_block_sd=1e-3, kl_block_sd=1e-5)
    v = compare_runs(ref, cand, forced=forced, floor=noisy)
    m = v.summary["floor"]["margins"]
    assert m["loss"] == {"margin": 0.04, "set_by": "floor", "floor_x_factor": 0.04, "min_effect": 0.02}
    assert m["kl"]["set_by"] == "min_effect"  # 4 x 1e-4 < 1e-3
    text = " | ".join(v.sequences[0].evidence)
    assert "margin 0.04 set by floor" in text and "floor 0" not in text
    # an identical sequence (the fast path, no test needed) reports its margins too
    same = compare_runs(ref, cand, forced=make_run([list(range(100, 100 + N))], k=4, kind="forced"), floor=noisy)
    assert same.verdict is Verdict.IDENTICAL
    assert any(e.startswith("margins: KL 0.001 set by min_effect") for e in same.sequences[0].evidence)


def test_without_a_floor_the_report_says_the_margins_are_the_minimum_effect():
    ref, cand, forced = _pair(0.001)
    v = compare_runs(ref, cand, forced=forced)
    assert v.summary["floor"]["description"].endswith("(margins are the minimum effect of interest)")
    assert any(e.startswith("no floor measured: margins are the minimum effect of interest")
               for e in v.sequences[0].evidence)


def test_cases_show_states_the_minimum_effect_each_case_is_judged_with(tmp_path, capsys):
    path = _suite(tmp_path, case_extra="min_effect = { loss = 0.005 }\n")
    out = tmp_path / "O.json"
    assert main(["cases", "show", "O", "--suite", str(path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["min_effect"] == {"kl": 1e-3, "loss": 0.005}  # its own, the default for kl
    capsys.readouterr()
    assert main(["cases", "show", "J", "--suite", str(path)]) == 0
    assert "min_effect  { kl = 0.001, loss = 0.02 } (the defaults)" in capsys.readouterr().out
