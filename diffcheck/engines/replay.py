"""Forced decode replay, only where it is needed: which steps to replay, and the forced run put together.

A forced run along a golden holds, at every step t, the candidate's own distribution in
the golden's context (prompt + golden[:t]). Much of that the candidate has already
computed: at every step t <= t* its generate run saw exactly that context (the two
texts agree before t*), through its own decode path. So, per sequence:

- **reused**: the candidate's tokens equal the golden's (or the golden is a prefix of
  them). It has walked the golden's whole path; its forced rows are its own generate
  rows and nothing is replayed.
- **replayed from t\\***: the texts part at t* before the golden ends. Rows before t*
  are the candidate's generate rows; the engine is given prompt + golden[:t*] as the
  prompt and forced along golden[t*:]. The row **at t\\*** then comes from a *prefill*
  of the last prefix token (with prefix caching, the prefix is mostly a cache hit),
  not from a decode step as in a full replay; from t*+1 on it is decode again. With
  prefix caching off, the KV of golden[:t*] is the prefill's, not the decode path's
  that wrote it during generation.

Mode ``"full"`` replays every sequence from step 0, as diffcheck always did: use it
when the decode path at t* matters (`mode_for`: a CLI option, the case tag
``replay-full``, and automatically for faults whose decode-step clock a prefill
restarts). Either way the run records in ``meta.source`` which sequences were
replayed (and from which step) and which were reused.

A partial replay must reproduce the generation where both saw the same context: at t* the
candidate's generate row and its replayed row are the same engine on the same tokens, one
through the decode path, one through a prefill. Where they disagree by more than
`REPRODUCE_KL` (`unreproduced`), the bug depends on the decode history, not on the context
alone (a fault that counts decode steps, state a prefill resets), and the partial replay
would hide it: that sequence is replayed again from step 0 (`with_full`), and
``meta.source["replayed_full"]`` says which and why.

Pure: numpy, diffcheck's types and its top-k KL; the engine side is `VllmOffline.force(starts=...)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from diffcheck.core.errors import ConfigError
from diffcheck.core.types import Run, SequenceInfo, Steps

MODES = ("partial", "full")
FULL_TAG = "replay-full"  # a case tagged so always gets full replays
# The most KL (nats, top-k estimate) by which a partial replay's row at t* may differ from the
# generation's own row at t* (same engine, same context) before the sequence is replayed in
# full. The clean fp32 CPU engine stays below it (tests/test_engine.py); a step-counting fault
# goes far above it (tests/test_selftest_engine.py). Too low only costs a replay; too high
# hides a history-dependent bug behind the prefill.
REPRODUCE_KL = 1e-3


@dataclass(frozen=True)
class ReplayPlan:
    """Per golden sequence, the first step to replay, or None when the candidate's own rows cover it."""

    mode: str
    starts: tuple[int | None, ...]
    lengths: tuple[int, ...]  # the golden's sequence lengths

    @property
    def replayed(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.starts) if s is not None)

    @property
    def reused(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.starts) if s is None)

    @property
    def replay_steps(self) -> int:
        """Forced steps the engine has to produce."""
        return sum(n - s for s, n in zip(self.starts, self.lengths) if s is not None)

    @property
    def total_steps(self) -> int:
        return sum(self.lengths)

    def describe(self) -> str:
        if self.mode == "full":
            return f"full replay: {self.replay_steps} steps"
        return (f"{len(self.replayed)} of {len(self.starts)} sequences replayed from their t*, "
                f"{len(self.reused)} reused; {self.replay_steps} of {self.total_steps} steps")


def mode_for(case, requested: str | None = None) -> tuple[str, str]:
    """The replay mode for `case` and why: `requested` (a CLI or API choice) wins, then the
    case tag ``replay-full``, then ``full`` for a fault that counts decode steps (its clock
    restarts at every prefill, so a partial replay's prefill would move where it acts),
    else ``partial``."""
    if requested is not None:
        if requested not in MODES:
            raise ConfigError(f"replay mode {requested!r} is not valid (valid: {', '.join(MODES)})")
        return requested, "requested"
    if FULL_TAG in (getattr(case, "tags", ()) or ()):
        return "full", f"case tag {FULL_TAG}"
    from diffcheck.cases.faults import parse_env

    spec = parse_env(getattr(case, "env", None) or {})
    if spec is not None and spec.info.takes_step:
        return "full", (f"fault {spec.label} counts decode steps from the last prefill; "
                        "a partial replay's prefill would restart that count")
    return "partial", "default"


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Number of identical leading tokens of two id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def plan(golden: Run, candidate: Run | None, mode: str) -> ReplayPlan:
    """What to replay of `golden` for `candidate` (None or ``mode="full"``: everything)."""
    if mode not in MODES:
        raise ConfigError(f"replay mode {mode!r} is not valid (valid: {', '.join(MODES)})")
    lengths = tuple(int(s.n_tokens) for s in golden.sequences)
    starts: list[int | None] = []
    for i, n in enumerate(lengths):
        if n == 0:
            starts.append(None)  # nothing to force
        elif mode == "full" or candidate is None or i >= len(candidate.sequences) or \
                candidate.sequences[i].prompt_token_ids != golden.sequences[i].prompt_token_ids:
            starts.append(0)
        else:
            shared = shared_prefix(golden.sequence(i).token_id, candidate.sequence(i).token_id)
            starts.append(None if shared >= n else shared)
    return ReplayPlan(mode=mode, starts=tuple(starts), lengths=lengths)


def assemble(golden: Run, candidate: Run | None, replay: ReplayPlan, replayed: Run | None, *,
             reference_id: str, mechanism: str) -> Run:
    """The forced run along `golden`: the candidate's own generate rows where `replay` reuses
    them, the engine's `replayed` rows (sequence i holding steps ``starts[i]..``) elsewhere.

    A sequence replayed from step 0 keeps the engine's sequence row as is; any other keeps the
    golden's text (the forced path is the golden's tokens) with finish reason ``length``, as a
    full replay (``max_tokens`` = the golden's length, EOS ignored) reports it.
    """
    if replayed is None and replay.replayed:
        raise ValueError("sequences were to be replayed but no replayed run was given")
    if replayed is not None and len(replayed.sequences) != len(golden.sequences):
        raise ValueError(f"replayed run has {len(replayed.sequences)} sequences, the golden {len(golden.sequences)}")
    k = (replayed if replayed is not None else candidate).steps.k
    parts: dict[str, list[np.ndarray]] = {c: [] for c in ("token_id", "logprob", "topk_ids", "topk_logprobs")}
    seqs = []
    for i, (start, n) in enumerate(zip(replay.starts, replay.lengths)):
        own = n if start is None else start  # rows taken from the candidate's generate run
        views = []
        if own:
            view = candidate.sequence(i)
            if len(view) < own:
                raise ValueError(f"seq {i}: the candidate has {len(view)} steps, {own} were to be reused")
            views.append((view, 0, own))
        if start is not None:
            view = replayed.sequence(i)
            if len(view) != n - start:
                raise ValueError(f"seq {i}: replayed {len(view)} steps from step {start}, expected {n - start}")
            views.append((view, 0, n - start))
        for view, a, b in views:
            if view.topk_ids.shape[1] != k:
                raise ValueError(f"seq {i}: top-k width {view.topk_ids.shape[1]} differs from {k}")
            for column in parts:
                parts[column].append(np.asarray(getattr(view, column)[a:b]))
        tokens = np.concatenate([v.token_id[a:b] for v, a, b in views]) if views else np.zeros(0, np.int32)
        if not np.array_equal(tokens, golden.sequence(i).token_id):
            raise ValueError(f"seq {i}: the assembled forced path does not follow the golden's tokens")
        info = golden.sequences[i]
        if start == 0:
            seqs.append(replayed.sequences[i])
        elif n == 0:
            seqs.append(dataclasses.replace(info, text="", n_tokens=0))
        else:
            seqs.append(SequenceInfo(prompt_id=info.prompt_id, prompt_token_ids=info.prompt_token_ids,
                                     text=info.text, finish_reason="length", n_tokens=n))
    counts = [s.n_tokens for s in seqs]
    steps = Steps(
        seq=np.repeat(np.arange(len(seqs), dtype=np.int32), counts),
        step=np.concatenate([np.arange(c, dtype=np.int32) for c in counts] or [np.zeros(0, np.int32)]),
        token_id=_cat(parts["token_id"], (0,), np.int32),
        logprob=_cat(parts["logprob"], (0,), np.float32),
        topk_ids=_cat(parts["topk_ids"], (0, k), np.int32),
        topk_logprobs=_cat(parts["topk_logprobs"], (0, k), np.float32),
    )
    source = {"reference": reference_id, "mechanism": mechanism, "replay": replay.mode,
              "replayed": list(replay.replayed), "reused": list(replay.reused), "replay_from": list(replay.starts)}
    if replayed is not None:
        meta = replayed.meta
        source = {**{k_: v for k_, v in meta.source.items() if k_ != "from_steps"}, **source}
    else:  # nothing replayed: the engine never ran a forced request
        meta = dataclasses.replace(candidate.meta, kind="forced",
                                   timings={**candidate.meta.timings, "force_s": 0.0, "force_tokens": 0})
    return Run(meta=dataclasses.replace(meta, kind="forced", source=source), sequences=tuple(seqs), steps=steps)


def unreproduced(candidate: Run, replay: ReplayPlan, replayed: Run | None) -> dict[int, float]:
    """{sequence: KL} of the partially replayed sequences whose row at their t* (a prefill)
    differs from the candidate's own generate row at t* (a decode step, same context) by
    more than `REPRODUCE_KL`: KL(generate || replay), top-k estimate."""
    from diffcheck.judging.kl_estimator import topk_kl

    out: dict[int, float] = {}
    if replayed is None or replay.mode != "partial":
        return out
    for i, start in enumerate(replay.starts):
        if not start:  # not replayed, or replayed from step 0 (a prefill on both sides)
            continue
        own, again = candidate.sequence(i), replayed.sequence(i)
        if len(own) <= start or len(again) == 0:
            continue  # the candidate ended at t*: no generate row there
        kl = float(topk_kl(own.topk_ids[start:start + 1], own.topk_logprobs[start:start + 1],
                           again.topk_ids[:1], again.topk_logprobs[:1])[0])
        if not kl <= REPRODUCE_KL:  # NaN counts as a disagreement
            out[i] = kl
    return out


def with_full(replay: ReplayPlan, replayed: Run, full: Run, which: Mapping[int, float]) -> tuple[ReplayPlan, Run]:
    """`replay` and its `replayed` run with the sequences in `which` taken from `full`, a
    replay of exactly those from step 0; ``meta.source["replayed_full"]`` records them."""
    starts = tuple(0 if i in which else s for i, s in enumerate(replay.starts))
    seqs = tuple(full.sequences[i] if i in which else replayed.sequences[i] for i in range(len(starts)))
    parts: dict[str, list[np.ndarray]] = {c: [] for c in ("seq", "step", "token_id", "logprob", "topk_ids",
                                                            "topk_logprobs")}
    for i in range(len(starts)):
        run = full if i in which else replayed
        off = run.offsets()
        a, b = int(off[i]), int(off[i + 1])
        for column in parts:
            parts[column].append(np.asarray(getattr(run.steps, column)[a:b]))
    k = replayed.steps.k
    steps = Steps(seq=_cat(parts["seq"], (0,), np.int32), step=_cat(parts["step"], (0,), np.int32),
                  token_id=_cat(parts["token_id"], (0,), np.int32), logprob=_cat(parts["logprob"], (0,), np.float32),
                  topk_ids=_cat(parts["topk_ids"], (0, k), np.int32),
                  topk_logprobs=_cat(parts["topk_logprobs"], (0, k), np.float32))
    t = {key: (replayed.meta.timings or {}).get(key, 0) + (full.meta.timings or {}).get(key, 0)
         for key in ("force_s", "force_tokens")}
    source = {**replayed.meta.source, "replayed_full": [
        {"seq": i, "from_step": replay.starts[i], "kl": round(kl, 6)} for i, kl in sorted(which.items())]}
    meta = dataclasses.replace(replayed.meta, timings={**(replayed.meta.timings or {}), **t}, source=source)
    return dataclasses.replace(replay, starts=starts), Run(meta=meta, sequences=seqs, steps=steps)


def _cat(arrays: list[np.ndarray], empty_shape: tuple[int, ...], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(empty_shape, dtype)


def forced_meta_mode(run: Run) -> str:
    """The replay mode a stored forced run was made with (runs from before partial replay: full)."""
    return str(run.meta.source.get("replay", "full"))


def serves(run: Run, mode: str) -> bool:
    """Whether a stored forced run may stand in for a replay in `mode`: its own mode, or a full
    replay for a partial one (every row from the decode path, which partial would reuse or replay)."""
    stored = forced_meta_mode(run)
    return stored == mode or (mode == "partial" and stored == "full")


__all__ = ["MODES", "FULL_TAG", "REPRODUCE_KL", "ReplayPlan", "mode_for", "plan", "assemble", "shared_prefix",
           "unreproduced", "with_full", "forced_meta_mode", "serves"]
