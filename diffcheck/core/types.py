"""The data that flows through diffcheck: runs, verdicts, and the pass/fail policy.

Knows nothing about engines, files or rendering. Every stage talks in these
frozen dataclasses: engines produce a `Run`, the store persists it, `align` /
`classify` turn two runs into a `CaseVerdict`, reports render verdicts.

A `Run` holds its per-step data as flat columns over all sequences (ordered by
sequence, then step) so the comparison core can stay vectorized; `Run.sequence(i)`
gives a cheap per-sequence view.

Kinds of run (``RunMeta.kind``):

- ``generate``: the engine sampled its own tokens. Goldens and candidate runs.
- ``forced``: the candidate engine was teacher-forced along a reference run's
  tokens in decode mode. ``token_id`` is the reference token, ``logprob`` is the
  candidate's logprob of it, ``topk_*`` is the candidate's own raw top-k.
- ``scored``: the reference engine scored a candidate run's tokens through prompt
  logprobs (prefill). ``token_id`` is the candidate token, ``logprob`` is the
  reference's logprob of it, ``topk_*`` is the reference's top-k at that position.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffcheck.core.errors import EXIT_BISECT_SKIP, EXIT_ENGINE, EXIT_INCONCLUSIVE, EXIT_PASS, EXIT_REGRESSION

RUN_KINDS = ("generate", "forced", "scored")
ROLES = ("reference", "candidate")


@dataclass(frozen=True)
class Steps:
    """Flat per-step columns for all sequences of a run, ordered by (seq, step)."""

    seq: np.ndarray  # int32 [N]
    step: np.ndarray  # int32 [N]
    token_id: np.ndarray  # int32 [N]
    logprob: np.ndarray  # float32 [N], raw logprob of token_id
    topk_ids: np.ndarray  # int32 [N, K], rank order; -1 where fewer than K
    topk_logprobs: np.ndarray  # float32 [N, K], descending; -inf where fewer than K

    def __len__(self) -> int:
        return int(self.token_id.shape[0])

    @property
    def k(self) -> int:
        return int(self.topk_ids.shape[1]) if self.topk_ids.ndim == 2 else 0

    @staticmethod
    def empty(k: int = 0) -> "Steps":
        return Steps(
            seq=np.zeros(0, np.int32),
            step=np.zeros(0, np.int32),
            token_id=np.zeros(0, np.int32),
            logprob=np.zeros(0, np.float32),
            topk_ids=np.zeros((0, k), np.int32),
            topk_logprobs=np.zeros((0, k), np.float32),
        )


@dataclass(frozen=True)
class SequenceInfo:
    """Per-sequence facts: one row per prompt of the prompt set."""

    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" (natural EOS / stop string), "length", "abort", ...
    n_tokens: int


@dataclass(frozen=True)
class SequenceView:
    """One sequence's slice of a run's columns (numpy views, no copies)."""

    index: int
    info: SequenceInfo
    token_id: np.ndarray
    logprob: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray

    def __len__(self) -> int:
        return int(self.token_id.shape[0])


@dataclass(frozen=True)
class RunMeta:
    """Everything needed to know what produced a run. Stored as file metadata."""

    suite: str
    case_id: str
    role: str  # "reference" | "candidate"
    kind: str = "generate"  # see RUN_KINDS
    engine: dict[str, Any] = field(default_factory=dict)
    # engine: name, version, commit, dirty, requested config, effective config,
    # forcing mechanism (for kind="forced")
    model: dict[str, Any] = field(default_factory=dict)  # id, path, digest
    sampling: dict[str, Any] = field(default_factory=dict)
    hardware: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # for forced / scored runs: which runs they were derived from
    source: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    diffcheck_version: str = ""


@dataclass(frozen=True)
class Run:
    meta: RunMeta
    sequences: tuple[SequenceInfo, ...]
    steps: Steps

    @property
    def n_tokens(self) -> int:
        return len(self.steps)

    def offsets(self) -> np.ndarray:
        """Start index of each sequence in `steps`, plus the end: shape [S+1]."""
        counts = np.fromiter((s.n_tokens for s in self.sequences), np.int64, len(self.sequences))
        return np.concatenate([[0], np.cumsum(counts)])

    def sequence(self, i: int) -> SequenceView:
        off = self.offsets()
        a, b = int(off[i]), int(off[i + 1])
        st = self.steps
        return SequenceView(
            index=i,
            info=self.sequences[i],
            token_id=st.token_id[a:b],
            logprob=st.logprob[a:b],
            topk_ids=st.topk_ids[a:b],
            topk_logprobs=st.topk_logprobs[a:b],
        )


class Verdict(enum.Enum):
    """Ordered by severity; a case's verdict is its worst sequence's.

    What each means and which fail: `diffcheck.core.types`."""

    IDENTICAL = 0
    BENIGN_DRIFT = 1
    WITHIN_BUDGET = 2  # a spec-changing candidate's precision cost, inside its budget
    INCONCLUSIVE = 3  # the evidence shows neither a pass nor a failure (never a pass)
    DEGRADED = 4
    GIBBERISH = 5
    ERROR = 6

    @property
    def severity(self) -> int:
        return self.value

    @staticmethod
    def worst(verdicts) -> "Verdict":
        vs = list(verdicts)
        return max(vs, key=lambda v: v.value) if vs else Verdict.IDENTICAL


@dataclass(frozen=True)
class SequenceVerdict:
    """The judgement of one candidate sequence against its reference sequence."""

    index: int
    prompt_id: str
    verdict: Verdict
    t_star: int | None  # first divergence step; None when the tokens are identical
    onset: int | None  # first gibberish step; None unless GIBBERISH
    shared_prefix: int  # number of identical leading tokens
    reference_len: int
    candidate_len: int
    evidence: tuple[str, ...] = ()  # human-readable reasons, most important first
    stats: dict[str, Any] = field(default_factory=dict)  # summaries (KL pctiles, same-top1, RMS dp, NLLs)
    baselines: dict[str, bool] = field(default_factory=dict)  # what older rules say: True = pass
    quality: dict[str, Any] = field(default_factory=dict)  # the seed's text metrics of the candidate
    series: dict[str, np.ndarray] = field(default_factory=dict)  # per-step curves for plots


@dataclass(frozen=True)
class CaseVerdict:
    """A candidate run judged against one reference golden."""

    candidate_id: str
    reference_id: str
    verdict: Verdict
    sequences: tuple[SequenceVerdict, ...]
    summary: dict[str, Any] = field(default_factory=dict)
    config_delta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when verdict is ERROR

    def __bool__(self) -> bool:
        return passes(self.verdict)

    def __str__(self) -> str:
        worst = max(self.sequences, key=lambda s: s.verdict.value, default=None)
        where = ""
        if worst is not None and worst.t_star is not None:
            where = f" (seq {worst.index} t*={worst.t_star}" + (
                f" onset={worst.onset})" if worst.onset is not None else ")"
            )
        return f"{self.candidate_id} vs {self.reference_id}: {self.verdict.name}{where}"


# -- the pass/fail policy --------------------------------------------------------------------
# The pass/fail policy: which verdicts fail, and the exit code of a command.
#
# This is the only place that decides. The CLI, bisect, JUnit, the self-test and
# `CaseVerdict.__bool__` ask it; none of them writes its own rule.
#
# | verdict        | meaning                                                              | exit |
# |----------------|----------------------------------------------------------------------|------|
# | IDENTICAL      | same tokens, distributions shown within the noise floor              | 0    |
# | BENIGN_DRIFT   | diverged, but shown within the floor (sampling flips included)        | 0    |
# | WITHIN_BUDGET  | spec-changing candidate (dtype, KV-cache dtype, quantization, model)  | 0    |
# |                | beyond the floor, but its precision cost is inside its budget         | 1 with --strict |
# | INCONCLUSIVE   | the evidence shows neither: too few same-context steps, a confidence  | 4 (0 with --allow-inconclusive; |
# |                | bound across the margin, or generate-only garbage the floor explains  | 125 with --bisect-codes) |
# | DEGRADED       | beyond the floor (or the budget), not garbage                         | 1    |
# | GIBBERISH      | garbage, with its onset step                                          | 1    |
# | ERROR          | the engine failed: never a verdict on the candidate                   | 3 (125 with --bisect-codes) |
#
# INCONCLUSIVE is not a pass: a CI job that reads exit 0 as "fine" must not be told
# "fine" when nothing was shown, so it exits 4 (its own code, not 1: nothing was found
# wrong either). Under `git bisect run` it maps to 125, "skip": the commit could not be
# judged, which is git bisect's own meaning of 125. `--allow-inconclusive` is for a user
# who accepts it: then it exits 0 (passes) and bisect counts it as good.
#
# Severity: INCONCLUSIVE sits above every pass and below DEGRADED, so a case with one
# INCONCLUSIVE sequence among passes is INCONCLUSIVE, and one DEGRADED sequence beside an
# INCONCLUSIVE one makes the case DEGRADED (a shown failure outranks an undecided one).
#
# Usage, configuration and data errors exit 2 (`diffcheck.core.errors`). A case's verdict
# is its worst sequence's; a command's, its worst case's.

PASSING = frozenset({Verdict.IDENTICAL, Verdict.BENIGN_DRIFT, Verdict.WITHIN_BUDGET})
STRICT_PASSING = frozenset({Verdict.IDENTICAL, Verdict.BENIGN_DRIFT})


def passes(verdict: Verdict, *, strict: bool = False, allow_inconclusive: bool = False) -> bool:
    """True when `verdict` is a pass; with `strict`, a precision cost (WITHIN_BUDGET) fails too;
    with `allow_inconclusive`, an INCONCLUSIVE verdict is accepted as a pass."""
    if verdict is Verdict.INCONCLUSIVE:
        return allow_inconclusive
    return verdict in (STRICT_PASSING if strict else PASSING)


def fails(verdict: Verdict, *, strict: bool = False, allow_inconclusive: bool = False) -> bool:
    """A regression found in the candidate, or (unless allowed) a verdict that could not be shown
    to pass. Never ERROR: an engine failure is no verdict."""
    return verdict is not Verdict.ERROR and not passes(verdict, strict=strict, allow_inconclusive=allow_inconclusive)


def exit_code(verdict: Verdict, *, strict: bool = False, bisect_codes: bool = False,
              allow_inconclusive: bool = False) -> int:
    """0 pass, 1 regression, 3 engine failure, 4 inconclusive (125 for both under
    `git bisect run`: skip this commit; 0 for inconclusive with `allow_inconclusive`)."""
    if verdict is Verdict.ERROR:
        return EXIT_BISECT_SKIP if bisect_codes else EXIT_ENGINE
    if verdict is Verdict.INCONCLUSIVE and not allow_inconclusive:
        return EXIT_BISECT_SKIP if bisect_codes else EXIT_INCONCLUSIVE
    return EXIT_PASS if passes(verdict, strict=strict, allow_inconclusive=allow_inconclusive) else EXIT_REGRESSION


def describe(*, strict: bool = False, allow_inconclusive: bool = False) -> str:
    """One line for --help texts: what passes."""
    ok = sorted(STRICT_PASSING if strict else PASSING, key=lambda v: v.value)
    if allow_inconclusive:
        ok.append(Verdict.INCONCLUSIVE)
    inconclusive = ("" if allow_inconclusive else
                    f"{EXIT_INCONCLUSIVE} on INCONCLUSIVE (125 with --bisect-codes: git bisect's skip); ")
    return (f"Exit 0 when every sequence is {', '.join(v.name for v in ok)}; 1 on "
            f"{'WITHIN_BUDGET, ' if strict else ''}DEGRADED or GIBBERISH; {inconclusive}3 on engine failure "
            "(125 with --bisect-codes); 2 on bad input.")
