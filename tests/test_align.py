"""align: t* and shared prefix, per pair and vectorized over whole runs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffcheck.judging.align import align, first_divergence, segment_rows
from diffcheck.core.errors import DataError
from diffcheck.core.types import Run

from factories import make_run


def naive_first_divergence(reference, candidate):
    for t, (r, c) in enumerate(zip(reference, candidate)):
        if r != c:
            return t
    if len(reference) != len(candidate):
        return min(len(reference), len(candidate))
    return None


def token_run(sequences: list[list[int]], *, prompt_prefix: str = "p") -> Run:
    """A run with only tokens (top-1 lists); enough for alignment."""
    return make_run(sequences, k=1, prompt_ids=[f"{prompt_prefix}{i}" for i in range(len(sequences))])


tokens = st.lists(st.integers(0, 3), max_size=12)


@settings(max_examples=300, deadline=None)
@given(tokens, tokens)
def test_first_divergence_matches_a_naive_loop(reference, candidate):
    assert first_divergence(reference, candidate) == naive_first_divergence(reference, candidate)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(tokens, tokens), min_size=1, max_size=8))
def test_align_matches_first_divergence_for_every_sequence(pairs):
    al = align(token_run([r for r, _ in pairs]), token_run([c for _, c in pairs]))
    for i, (r, c) in enumerate(pairs):
        expected = naive_first_divergence(r, c)
        assert al.t_star_of(i) == expected
        assert int(al.t_star[i]) == (-1 if expected is None else expected)
        shared = expected if expected is not None else len(r)
        assert int(al.shared_prefix[i]) == shared
        assert int(al.reference_len[i]) == len(r) and int(al.candidate_len[i]) == len(c)


def test_cases_by_hand():
    al = align(
        token_run([[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 3], []]),
        token_run([[1, 2, 3], [1, 9, 3], [1, 2, 3], [1, 2], []]),
    )
    assert al.t_star.tolist() == [-1, 1, 2, 2, -1]
    assert al.shared_prefix.tolist() == [3, 1, 2, 2, 0]
    assert al.diverged.tolist() == [False, True, True, True, False]


def test_equal_lengths_fast_path_and_first_step():
    al = align(token_run([[5, 6], [7, 8]]), token_run([[0, 6], [7, 8]]))
    assert al.t_star.tolist() == [0, -1]


def test_prompt_mismatch_is_a_one_line_data_error():
    with pytest.raises(DataError, match="prompt_id 'q0' but the reference run has 'p0'") as info:
        align(token_run([[1]]), token_run([[1]], prompt_prefix="q"))
    assert "\n" not in str(info.value)


def test_sequence_count_mismatch_is_a_data_error():
    with pytest.raises(DataError, match="2 sequences but the reference run has 1"):
        align(token_run([[1]]), token_run([[1], [2]]))


def test_segment_rows_concatenates_ranges():
    rows = segment_rows(np.array([10, 0, 5]), np.array([2, 0, 3]))
    assert rows.tolist() == [10, 11, 5, 6, 7]
    assert segment_rows(np.array([3]), np.array([0])).tolist() == []
