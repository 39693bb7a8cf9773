"""INCONCLUSIVE: a pass must be shown, not assumed (issue 21).

The policy (exit codes, severity, --allow-inconclusive), the equivalence decision on
synthetic arrays whose answer is known analytically, and the committed H200 recordings
re-judged with and without their forced/scored files (labels from the suite's `expect`)."""

from __future__ import annotations

from click.testing import CliRunner

from diffcheck.core.errors import EXIT_BISECT_SKIP, EXIT_ENGINE, EXIT_INCONCLUSIVE, EXIT_PASS, EXIT_REGRESSION
from diffcheck.core.types import Verdict, describe, exit_code, fails, passes

# ---------------------------------------------------------------- the policy


def test_inconclusive_is_not_a_pass_and_has_its_own_exit_code():
    v = Verdict.INCONCLUSIVE
    assert not passes(v) and not passes(v, strict=True) and fails(v)
    assert exit_code(v) == EXIT_INCONCLUSIVE == 4
    assert EXIT_INCONCLUSIVE not in (EXIT_PASS, EXIT_REGRESSION, EXIT_ENGINE, 2)
    assert exit_code(v, bisect_codes=True) == EXIT_BISECT_SKIP == 125  # git bisect's skip: not judged


def test_allow_inconclusive_accepts_it_and_nothing_else():
    v = Verdict.INCONCLUSIVE
    assert passes(v, allow_inconclusive=True) and not fails(v, allow_inconclusive=True)
    assert exit_code(v, allow_inconclusive=True) == EXIT_PASS
    assert exit_code(v, allow_inconclusive=True, bisect_codes=True) == EXIT_PASS
    for other in (Verdict.DEGRADED, Verdict.GIBBERISH):
        assert exit_code(other, allow_inconclusive=True) == EXIT_REGRESSION
    assert exit_code(Verdict.ERROR, allow_inconclusive=True) == EXIT_ENGINE
    assert exit_code(Verdict.WITHIN_BUDGET, strict=True, allow_inconclusive=True) == EXIT_REGRESSION


def test_severity_degraded_outranks_inconclusive_which_outranks_passes():
    assert Verdict.worst([Verdict.DEGRADED, Verdict.INCONCLUSIVE]) is Verdict.DEGRADED
    assert Verdict.worst([Verdict.INCONCLUSIVE, Verdict.DEGRADED]) is Verdict.DEGRADED
    for ok in (Verdict.IDENTICAL, Verdict.BENIGN_DRIFT, Verdict.WITHIN_BUDGET):
        assert Verdict.worst([ok, Verdict.INCONCLUSIVE, ok]) is Verdict.INCONCLUSIVE
    assert Verdict.worst([Verdict.INCONCLUSIVE, Verdict.GIBBERISH]) is Verdict.GIBBERISH


def test_describe_states_the_inconclusive_code():
    assert "4 on INCONCLUSIVE" in describe() and "125" in describe()
    assert "INCONCLUSIVE" in describe(allow_inconclusive=True).split(";")[0]


def test_the_commands_take_allow_inconclusive():
    from diffcheck.cli import cli

    for command in ("compare", "check", "matrix"):
        result = CliRunner().invoke(cli, [command, "--help"])
        assert "--allow-inconclusive" in result.output, (command, result.output)
