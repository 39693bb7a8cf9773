"""Sequential extension of undecided sequences (``diffcheck compare --until-decided``).

A sequence is `INCONCLUSIVE` when its same-context path is too short to show a pass or a
failure (`decision`: fewer than ``min_steps`` steps, a minimum detectable effect above the
margin, or an upper bound across it). Extension gives it a longer path, look after look:
the reference's own continuation of the sequence (the reference engine generating further,
its first tokens checked against the golden's) with the candidate teacher-forced along it,
and the sequence judged again on the longer path, until it is decided or its budget of
steps (``max_tokens``) is spent.

The parts, all pure (the engine work is the caller's callback):

- `plan_looks`: the path lengths of one sequence's looks: its golden's length, then
  doubling, the last one capped at its budget;
- the **alpha rule**, Bonferroni over the planned looks: with m tests in the comparison
  (every sequence's, `decision.family`) and at most L looks per sequence (`planned_looks`,
  fixed before the first look), every test at every look is judged at ``alpha / (m·L)``
  (``family(..., looks=L)``), so the chance that any look of any sequence shows a difference
  or an equivalence that is not there stays at most alpha, however many looks are taken;
- `run_looks`: the loop: extend the undecided sequences to their next look, judge, stop
  those decided, until none is left or none can go further. A sequence still undecided at
  its budget stays `INCONCLUSIVE`: the loop never turns one into a pass;
- `power_reached`: the smallest KL and loss a path of this length would have found with
  probability ``1 - POWER_BETA`` (0.95): `decision`'s minimum detectable effect, asked at
  that β;
- `extend_run`, `first_departure`: the golden made longer by a regenerated reference run,
  and the check that the regeneration is the golden's own continuation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from diffcheck.core.types import Run, SequenceInfo, Steps, Verdict
from diffcheck.judging.decision import decide
from diffcheck.judging.floor import Floor

GROWTH = 2  # each look doubles the path
DEFAULT_MAX_TOKENS = 1024  # the longest path a sequence is extended to (reference steps), unless --max-tokens
POWER_BETA = 0.05  # the power reached is stated at 1 - beta = 0.95
RULE = "Bonferroni over the planned looks"


def plan_looks(start: int, cap: int, growth: int = GROWTH) -> tuple[int, ...]:
    """The path lengths of one sequence's looks: `start` (the golden's length, the first look),
    then ×`growth` each look, the last one `cap`. A sequence at or beyond `cap`, or with no
    steps at all, has its first look only."""
    looks = [int(start)]
    if start <= 0:
        return tuple(looks)
    while looks[-1] < cap:
        looks.append(min(looks[-1] * growth, int(cap)))
    return tuple(looks)


def planned_looks(schedules: Iterable[tuple[int, ...]]) -> int:
    """L: the most looks any sequence may take (at least 1, the plain comparison)."""
    return max((len(s) for s in schedules), default=1)


@dataclass(frozen=True)
class Look:
    steps: int  # same-context steps on the decision path at this look
    verdict: Verdict


@dataclass
class Track:
    """One undecided sequence under extension: its planned looks and the looks taken."""

    index: int
    schedule: tuple[int, ...]  # planned path lengths, schedule[0] = the first look's
    looks: list[Look] = field(default_factory=list)
    tokens: int = 0  # tokens the extension spent on it: reference generated + candidate forced
    stopped: str = ""  # why no further look was taken

    @property
    def verdict(self) -> Verdict:
        return self.looks[-1].verdict

    @property
    def decided(self) -> bool:
        return self.verdict is not Verdict.INCONCLUSIVE

    @property
    def steps(self) -> int:
        return self.looks[-1].steps

    def next_target(self) -> int | None:
        """The next look's path length, or None when no further look is planned."""
        k = len(self.looks)
        return self.schedule[k] if k < len(self.schedule) else None


@dataclass(frozen=True)
class Extended:
    """What one extension of one sequence gave: the path length reached, the verdict on it,
    the tokens spent, and why it cannot go further ("" when it can)."""

    steps: int
    verdict: Verdict
    tokens: int = 0
    ended: str = ""


def run_looks(tracks: list[Track], extend: Callable[[dict[int, int]], dict[int, Extended]], *,
              on_look: Callable[[int, dict[int, int]], None] | None = None) -> list[Track]:
    """Take look after look: each round extends every undecided track to its next planned
    length (`extend`: {index: target steps} -> {index: `Extended`}) and records the verdict,
    until every track is decided, ended, or out of planned looks. `on_look(k, targets)` is
    told before look k (2, 3, ...). Each track must hold its first look already."""
    k = 1
    while True:
        targets = {}
        for t in tracks:
            if t.decided or t.stopped:
                continue
            n = t.next_target()
            if n is None:
                t.stopped = f"budget of {t.schedule[-1]} steps reached"
                continue
            targets[t.index] = n
        if not targets:
            break
        k += 1
        if on_look is not None:
            on_look(k, targets)
        got = extend(targets)
        for t in tracks:
            if t.index not in targets:
                continue
            e = got[t.index]
            t.tokens += e.tokens
            if e.steps <= t.steps:  # no longer path to be had: not a look
                t.stopped = e.ended or f"no longer path than {t.steps} steps"
                continue
            t.looks.append(Look(e.steps, e.verdict))
            if e.ended and not t.decided:
                t.stopped = e.ended
    for t in tracks:
        if t.decided and not t.stopped:
            t.stopped = f"decided at look {len(t.looks)}"
    return tracks


def power_reached(kl: np.ndarray, dlogprob: np.ndarray, *, floor: Floor, tol, tests: int,
                  beta: float = POWER_BETA) -> dict[str, float]:
    """The smallest mean KL and mean loss this path would have shown with probability 1 − `beta`
    at the level its looks were judged at (`decision.decide`'s minimum detectable effect)."""
    amount, loss, _, _ = decide(kl, dlogprob, floor=floor, factor=tol.floor_factor, min_effect_kl=tol.min_effect_kl,
                                min_effect_loss=tol.min_effect_loss, alpha=tol.alpha, beta=beta, tests=tests,
                                min_steps=tol.min_steps)
    return {"power": 1.0 - beta, "kl": amount.mde, "loss": loss.mde, "steps": int(kl.shape[0])}


def first_departure(golden: Run, regenerated: Run) -> str | None:
    """Where `regenerated` (the reference engine generating again, further) leaves `golden`'s
    tokens over the golden's length, in words; None when every sequence starts with its golden."""
    if len(regenerated.sequences) != len(golden.sequences):
        return f"{len(regenerated.sequences)} sequences, the golden has {len(golden.sequences)}"
    for i, info in enumerate(golden.sequences):
        if regenerated.sequences[i].prompt_token_ids != info.prompt_token_ids:
            return f"seq {i} has another prompt than the golden's"
        g, r = golden.sequence(i).token_id, regenerated.sequence(i).token_id
        n = min(len(g), len(r))
        bad = np.flatnonzero(g[:n] != r[:n])
        if bad.size:
            s = int(bad[0])
            return f"seq {i} step {s}: token {int(r[s])}, the golden's {int(g[s])}"
        if len(r) < len(g):
            return f"seq {i} ended at step {len(r)} ({regenerated.sequences[i].finish_reason}), the golden at {len(g)}"
    return None


def extend_run(current: Run, regenerated: Run, targets: dict[int, int], *,
               decode: Callable[[list[int]], str] | None = None) -> tuple[Run, dict[int, tuple[int, str]]]:
    """`current` (the golden, or an earlier extension of it) with each sequence i of `targets`
    made longer by `regenerated`'s rows, up to ``targets[i]`` steps; the other sequences as
    they are. Rows already in `current` stay its own. Returns the run and, per extended
    sequence, (its new length, why it cannot go further: the reference stopped there, or "").

    The meta stays `current`'s (the golden's: a reference generate run); a cut sequence gets
    finish reason ``length`` and the text ``decode(tokens)``."""
    cur_off, reg_off = current.offsets(), regenerated.offsets()
    take: list[tuple[str, int, int]] = []  # (which run, from row, to row)
    seqs, counts, reached = [], [], {}
    for i, info in enumerate(current.sequences):
        a, b = int(cur_off[i]), int(cur_off[i + 1])
        take.append(("cur", a, b))
        n_cur = b - a
        if i not in targets:
            seqs.append(info)
            counts.append(n_cur)
            continue
        reg = regenerated.sequences[i]
        n = min(int(targets[i]), reg.n_tokens)
        if n > n_cur:
            take.append(("reg", int(reg_off[i]) + n_cur, int(reg_off[i]) + n))
        n = max(n, n_cur)
        ended = ""
        if n >= reg.n_tokens and reg.finish_reason != "length":
            ended = f"the reference ended at step {reg.n_tokens} ({reg.finish_reason})"
        if n == reg.n_tokens:
            new = dataclasses.replace(reg, n_tokens=n)
        else:
            tokens = regenerated.sequence(i).token_id[:n].tolist()
            new = dataclasses.replace(reg, n_tokens=n, finish_reason="length",
                                      text=decode([int(t) for t in tokens]) if decode is not None else "")
        seqs.append(new)
        counts.append(n)
        reached[i] = (n, ended)
    cols = {}
    for name in ("token_id", "logprob", "topk_ids", "topk_logprobs"):
        parts = [getattr((current if src == "cur" else regenerated).steps, name)[a:b] for src, a, b in take]
        cols[name] = np.concatenate(parts) if parts else getattr(current.steps, name)[:0]
    steps = Steps(seq=np.repeat(np.arange(len(seqs), dtype=np.int32), counts),
                  step=np.concatenate([np.arange(c, dtype=np.int32) for c in counts] or [np.zeros(0, np.int32)]),
                  **cols)
    return Run(meta=current.meta, sequences=tuple(seqs), steps=steps), reached


def describe(track: Track, power: dict[str, float] | None) -> str:
    """One evidence line: the looks, the tokens, the verdict, the power reached."""
    looks = ", ".join(f"{lk.steps} ({lk.verdict.name})" for lk in track.looks)
    text = (f"sequential extension: {len(track.looks)} look(s) at {looks} steps, {track.tokens} tokens spent; "
            f"{track.verdict.name}, {track.stopped}")
    if power is not None:
        text += (f"; {power['steps']} steps find KL {power['kl']:.2g} or loss {power['loss']:.2g} "
                 f"with power {power['power']:.2f}")
    return text


def record(track: Track, power: dict[str, float] | None) -> dict:
    """The JSON record of one extended sequence (``stats.sequential``)."""
    return {"looks": [{"steps": lk.steps, "verdict": lk.verdict.name} for lk in track.looks],
            "planned": list(track.schedule), "steps": track.steps, "tokens": track.tokens,
            "verdict": track.verdict.name, "stopped": track.stopped, "power_reached": power}
