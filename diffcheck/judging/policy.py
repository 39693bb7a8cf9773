"""The pass/fail policy: which verdicts fail, and the exit code of a command.

This is the only place that decides. The CLI, bisect, JUnit, the self-test and
`CaseVerdict.__bool__` ask it; none of them writes its own rule.

| verdict        | meaning                                                              | exit |
|----------------|----------------------------------------------------------------------|------|
| IDENTICAL      | same tokens, distributions within the noise floor                    | 0    |
| BENIGN_DRIFT   | diverged, but within the floor (sampling flips included)              | 0    |
| WITHIN_BUDGET  | spec-changing candidate (dtype, KV-cache dtype, quantization, model)  | 0    |
|                | beyond the floor, but its precision cost is inside its budget         | 1 with --strict |
| DEGRADED       | beyond the floor (or the budget), not garbage                         | 1    |
| GIBBERISH      | garbage, with its onset step                                          | 1    |
| ERROR          | the engine failed: never a verdict on the candidate                   | 3 (125 with --bisect-codes) |

Usage, configuration and data errors exit 2 (`diffcheck.errors`). A case's verdict
is its worst sequence's; a command's, its worst case's.
"""

from __future__ import annotations

from diffcheck.errors import EXIT_BISECT_SKIP, EXIT_ENGINE, EXIT_PASS, EXIT_REGRESSION
from diffcheck.types import Verdict

PASSING = frozenset({Verdict.IDENTICAL, Verdict.BENIGN_DRIFT, Verdict.WITHIN_BUDGET})
STRICT_PASSING = frozenset({Verdict.IDENTICAL, Verdict.BENIGN_DRIFT})


def passes(verdict: Verdict, *, strict: bool = False) -> bool:
    """True when `verdict` is a pass; with `strict`, a precision cost (WITHIN_BUDGET) fails too."""
    return verdict in (STRICT_PASSING if strict else PASSING)


def fails(verdict: Verdict, *, strict: bool = False) -> bool:
    """A regression found in the candidate (never ERROR: an engine failure is no verdict)."""
    return verdict is not Verdict.ERROR and not passes(verdict, strict=strict)


def exit_code(verdict: Verdict, *, strict: bool = False, bisect_codes: bool = False) -> int:
    """0 pass, 1 regression, 3 engine failure (125 under `git bisect run`: skip this commit)."""
    if verdict is Verdict.ERROR:
        return EXIT_BISECT_SKIP if bisect_codes else EXIT_ENGINE
    return EXIT_PASS if passes(verdict, strict=strict) else EXIT_REGRESSION


def describe(*, strict: bool = False) -> str:
    """One line for --help texts: what passes."""
    ok = sorted(STRICT_PASSING if strict else PASSING, key=lambda v: v.value)
    return (f"Exit 0 when every sequence is {', '.join(v.name for v in ok)}; 1 on "
            f"{'WITHIN_BUDGET, ' if strict else ''}DEGRADED or GIBBERISH; 3 on engine failure "
            "(125 with --bisect-codes); 2 on bad input.")
