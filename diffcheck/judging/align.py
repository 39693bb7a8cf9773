"""Token alignment of a candidate run against its reference: where do they first differ?

Knows only token ids and sequence lengths (numpy); nothing about logprobs, engines
or verdicts. Sequences are matched by index, and their prompt ids must agree.

Definitions, per sequence:

- ``t*`` (``t_star``): the first step whose tokens differ. When one side is a strict
  prefix of the other (a shorter sequence that agrees on every shared step), t* is
  the shorter length: the first step that only one side has. Identical tokens and
  identical length: no t* (``None`` from `first_divergence`, ``-1`` in `Alignment`).
- ``shared_prefix``: the number of identical leading tokens, so ``t* == shared_prefix``
  whenever t* exists, and ``shared_prefix == length`` when identical.

`align` is vectorized over the runs' flat columns: one comparison of the overlapping
token columns and a first-mismatch-per-sequence reduction, no Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diffcheck.core.errors import DataError
from diffcheck.core.types import Run


def first_divergence(reference_tokens, candidate_tokens) -> int | None:
    """t* of one sequence pair: first differing step, the shorter length when one is a
    strict prefix of the other, None when identical (tokens and length)."""
    reference = np.asarray(reference_tokens)
    candidate = np.asarray(candidate_tokens)
    n = min(reference.shape[0], candidate.shape[0])
    differs = reference[:n] != candidate[:n]
    if differs.any():
        return int(np.argmax(differs))
    if reference.shape[0] != candidate.shape[0]:
        return int(n)
    return None


@dataclass(frozen=True)
class Alignment:
    """Per-sequence alignment of a candidate run against a reference run (arrays [S])."""

    t_star: np.ndarray  # int64, -1 where the sequences are identical
    shared_prefix: np.ndarray  # int64, identical leading tokens
    reference_len: np.ndarray  # int64
    candidate_len: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.t_star.shape[0])

    @property
    def diverged(self) -> np.ndarray:
        """bool [S]: the sequence has a t*."""
        return self.t_star >= 0

    @property
    def same_context_len(self) -> np.ndarray:
        """int64 [S]: steps where both sides saw the same context and sampled the same
        token (steps < t*, or the whole sequence when identical)."""
        return self.shared_prefix

    def t_star_of(self, i: int) -> int | None:
        t = int(self.t_star[i])
        return None if t < 0 else t


def check_matched(reference: Run, other: Run, *, what: str, against: str = "reference") -> None:
    """Raise DataError unless `other` has the same prompts as `reference`, in order.
    `what` and `against` name the two runs in the message."""
    if len(reference.sequences) != len(other.sequences):
        raise DataError(
            f"{what} run has {len(other.sequences)} sequences but the {against} run has "
            f"{len(reference.sequences)}; runs must come from the same prompt set"
        )
    for i, (r, o) in enumerate(zip(reference.sequences, other.sequences)):
        if r.prompt_id != o.prompt_id:
            raise DataError(
                f"{what} sequence {i} has prompt_id {o.prompt_id!r} but the {against} run has "
                f"{r.prompt_id!r}; sequences are matched by index"
            )


def lengths(run: Run) -> np.ndarray:
    """int64 [S]: number of steps per sequence."""
    return np.fromiter((s.n_tokens for s in run.sequences), np.int64, len(run.sequences))


def segment_rows(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(starts[i], starts[i] + counts[i])`` for all i, as int64,
    without a Python loop."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    seg_begin = np.cumsum(counts) - counts  # position of each segment in the output
    shift = np.repeat(np.asarray(starts, np.int64) - seg_begin, counts)
    return np.arange(total, dtype=np.int64) + shift


def align(
    reference: Run, candidate: Run, *, reference_len: np.ndarray | None = None,
    candidate_len: np.ndarray | None = None,
) -> Alignment:
    """Vectorized t* and shared prefix for every sequence pair of two runs. The
    per-sequence lengths (`lengths`) may be passed in when the caller has them."""
    check_matched(reference, candidate, what="candidate")
    ref_len = lengths(reference) if reference_len is None else reference_len
    cand_len = lengths(candidate) if candidate_len is None else candidate_len
    if int(ref_len.sum()) != len(reference.steps) or int(cand_len.sum()) != len(candidate.steps):
        raise DataError("run steps do not add up to the sequences' n_tokens; the run is corrupt")
    overlap = np.minimum(ref_len, cand_len)
    ref_tok = reference.steps.token_id
    cand_tok = candidate.steps.token_id

    if np.array_equal(ref_len, cand_len):
        # Common case: equal lengths, so the flat columns line up row for row and the
        # comparison needs no gather.
        differs = ref_tok != cand_tok
        offsets = np.concatenate([[0], np.cumsum(ref_len)])
    else:
        ref_off = np.concatenate([[0], np.cumsum(ref_len)[:-1]])
        cand_off = np.concatenate([[0], np.cumsum(cand_len)[:-1]])
        differs = ref_tok[segment_rows(ref_off, overlap)] != cand_tok[segment_rows(cand_off, overlap)]
        offsets = np.concatenate([[0], np.cumsum(overlap)])

    shared = overlap.copy()
    where = np.flatnonzero(differs)
    if where.size:
        seq_of = np.searchsorted(offsets, where, side="right") - 1
        first = np.concatenate([[True], seq_of[1:] != seq_of[:-1]])
        shared[seq_of[first]] = where[first] - offsets[seq_of[first]]
    t_star = np.where((shared < overlap) | (ref_len != cand_len), shared, -1).astype(np.int64)
    return Alignment(
        t_star=t_star,
        shared_prefix=shared.astype(np.int64),
        reference_len=ref_len,
        candidate_len=cand_len,
    )


def differs(golden: Run, candidate: Run) -> bool:
    """Whether the candidate's sampled tokens differ from the golden's anywhere."""
    if len(golden.sequences) != len(candidate.sequences):
        return True
    if [s.n_tokens for s in golden.sequences] != [s.n_tokens for s in candidate.sequences]:
        return True
    return not np.array_equal(golden.steps.token_id, candidate.steps.token_id)


def prefix_view(run: Run, prompt_ids, max_tokens: int | None = None, *, decode=None) -> Run:
    """`run` cut down to the sequences of `prompt_ids` (in that order) and each one's first
    `max_tokens` steps: what the run would have been on fewer prompts and fewer decode steps.

    For judging a smaller case (a probe of `diffcheck reduce`) against a golden of the larger
    one. A sequence that is cut gets finish_reason ``"length"`` and the text ``decode(tokens)``
    (`decode`: token ids -> text; without it, an empty text). A prompt id the run does not
    have is a DataError.
    """
    import dataclasses

    index = {s.prompt_id: i for i, s in enumerate(run.sequences)}
    missing = [p for p in prompt_ids if p not in index]
    if missing:
        raise DataError(f"run {run.meta.case_id!r} has no sequence for prompt {missing[0]!r} "
                        f"(it has {', '.join(index)})")
    off = run.offsets()
    rows, seqs = [], []
    for new, pid in enumerate(prompt_ids):
        i = index[pid]
        info = run.sequences[i]
        n = info.n_tokens if max_tokens is None else min(info.n_tokens, int(max_tokens))
        rows.append(np.arange(off[i], off[i] + n, dtype=np.int64))
        if n < info.n_tokens:
            tokens = run.steps.token_id[off[i]:off[i] + n]
            text = decode([int(t) for t in tokens]) if decode is not None else ""
            info = dataclasses.replace(info, n_tokens=n, text=text, finish_reason="length")
        seqs.append((new, info))
    take = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    st = run.steps
    seq_col = np.concatenate([np.full(len(r), new, np.int32) for (new, _), r in zip(seqs, rows)]) if rows \
        else np.zeros(0, np.int32)
    steps = dataclasses.replace(st, seq=seq_col, step=st.step[take], token_id=st.token_id[take],
                                logprob=st.logprob[take], topk_ids=st.topk_ids[take],
                                topk_logprobs=st.topk_logprobs[take])
    return Run(meta=run.meta, sequences=tuple(info for _, info in seqs), steps=steps)
