"""What the older rules say, per sequence: vLLM's check_outputs_equal and
check_logprobs_close, computed on the same runs for comparison in every report."""

from __future__ import annotations

import numpy as np

from diffcheck.judging.align import Alignment
from diffcheck.judging.paths import Layout
from diffcheck.judging.tolerances import Tolerances
from diffcheck.core.types import Run


def baselines(reference: Run, candidate: Run, ref: Layout, cand: Layout, al: Alignment, tol: Tolerances
               ) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's check_outputs_equal and check_logprobs_close, per sequence (True = pass).

    check_logprobs_close walks to the first mismatch within the shorter sequence and
    requires each side's token to be in the other side's top-N logprobs there, then
    stops; a strict prefix passes (vLLM only warns on the text)."""
    texts_equal = np.fromiter(
        (r.text == c.text for r, c in zip(reference.sequences, candidate.sequences)), bool, len(al))
    exact = (al.t_star < 0) & texts_equal
    close = np.ones(len(al), bool)
    mismatch = np.flatnonzero((al.t_star >= 0) & (al.t_star < np.minimum(al.reference_len, al.candidate_len)))
    if mismatch.size:
        t = al.t_star[mismatch]
        rr, cr = ref.off[mismatch] + t, cand.off[mismatch] + t
        n = min(tol.baseline_topn, reference.steps.k, candidate.steps.k)
        ref_tok = reference.steps.token_id[rr]
        cand_tok = candidate.steps.token_id[cr]
        in_cand = (candidate.steps.topk_ids[cr, :n] == ref_tok[:, None]).any(1)
        in_ref = (reference.steps.topk_ids[rr, :n] == cand_tok[:, None]).any(1)
        close[mismatch] = in_cand & in_ref
    return exact, close
