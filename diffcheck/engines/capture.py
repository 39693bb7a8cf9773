"""Top-k logprobs captured on the device, inside vLLM's engine process, moved to the host once.

vLLM's own logprobs path (``SamplingParams(logprobs=k)``) turns every decode step's top-k
arrays into host lists and per-request slices before the next step can start; under a
FULL CUDA graph, where the replay of a small model is short, that host work is on the
critical path (docs/gpu.md: +26 % of decode time on the H200). This module captures the
same numbers without it:

- `CaptureWorker`, a vLLM *worker extension* mixed into the worker class (with the
  per-layer taps, `DiffcheckWorker`): ``diffcheck_capture_arm(k)`` wraps the V1 model
  runner's ``_sample``. Per step the wrapper copies the logits it is handed, before any
  logits processor touches them, into a persistent device buffer (one launch); once the
  buffer is full, and at the end, it runs the ops vLLM's sampler runs for
  ``logprobs_mode = "raw_logprobs"`` (``log_softmax(dtype=float32)``, ``topk``, a
  ``gather`` of the sampled token) over every buffered row at once (`_Chunks`). Nothing is
  copied to the host and no Python object is built per step. ``diffcheck_capture_collect()`` unwraps,
  concatenates every step, groups the rows by request and copies each array to the host once, as raw
  bytes (`requests_of` reads them back).
- `steps_for` (this process): matches what came back to vLLM's outputs (by prompt and
  sampled tokens: the engine's request ids are not the caller's) and returns per-output
  dense arrays, the layout of `vllm_outputs.steps_from_logprobs`.

The values are those vLLM would have returned (the same ops on the same logits), so a run
captured either way is judged the same. The requests themselves ask vLLM for no logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from diffcheck.core.errors import EngineError
from diffcheck.engines.taps import TapWorker, prompt_key

WORKER_EXTENSION = "diffcheck.engines.capture.DiffcheckWorker"
CHUNK_BYTES = 64 << 20  # logits buffered on the device between reductions


class CaptureWorker:
    """Mixed into vLLM's worker class (worker_extension_cls); runs in the process that runs the model."""

    def diffcheck_capture_arm(self, k: int, budget_bytes: int = CHUNK_BYTES) -> bool:
        """Capture the top `k` logprobs and the sampled token's logprob of every sampled row from now
        on. False where this runner has no V1 ``_sample`` to wrap (the caller then uses vLLM's path)."""
        self.diffcheck_capture_collect()  # a stale arm from an interrupted run: drop it
        runner = self.model_runner
        original = getattr(type(runner), "_sample", None)
        if original is None:
            return False
        state = _Chunks(int(k), int(budget_bytes))

        def sample(logits, spec_decode_metadata=None, *args, **kwargs):
            if logits is None or spec_decode_metadata is not None:  # nothing sampled here, or speculative
                state.unsampled += 1
                return original(runner, logits, spec_decode_metadata, *args, **kwargs)
            req_ids = runner.input_batch.req_ids[: logits.shape[0]]  # a copy: vLLM reorders its list in place
            prompts = state.prompts
            for rid in req_ids:
                if rid not in prompts:
                    req = runner.requests.get(rid)
                    ids = getattr(req, "prompt_token_ids", None)
                    prompts[rid] = prompt_key(ids) if ids is not None else ""
            state.keep(logits)  # before the sampler: its logits processors may change them in place
            try:
                out = original(runner, logits, spec_decode_metadata, *args, **kwargs)
            except BaseException:
                state.drop(logits.shape[0])
                raise
            state.sampled(req_ids, out.sampled_token_ids[:, :1])
            return out

        runner._sample = sample  # an instance attribute: collect deletes it, the class's method returns
        self._diffcheck_capture = state
        return True

    def diffcheck_capture_collect(self) -> dict | None:
        """Unwrap; every captured row, per engine request in step order (None when not armed)."""
        state = getattr(self, "_diffcheck_capture", None)
        self._diffcheck_capture = None
        if state is None:
            return None
        self.model_runner.__dict__.pop("_sample", None)
        state.flush()
        answer = {"k": state.k, "unsampled": state.unsampled, "prompts": [], "counts": [],
                  **dict.fromkeys(_FIELDS, b"")}
        if not state.done:
            return answer
        # One host copy per array for the whole run; rows grouped by engine request, in step order within
        # each, and sent as raw bytes (a list of Python numbers per row cost more than the capture did).
        names: dict[str, int] = {}
        codes = np.fromiter((names.setdefault(rid, len(names)) for rid in state.req_rows), np.int64,
                            len(state.req_rows))
        order = np.argsort(codes, kind="stable")
        sampled, own, values, ids = (_host([d[i] for d in state.done]) for i in range(4))
        columns = {"tokens": sampled[order, 0], "logprob": own[order, 0], "topk_ids": ids[order],
                   "topk_logprobs": values[order]}
        answer.update(prompts=[state.prompts.get(rid, "") for rid in names], counts=np.bincount(codes).tolist(),
                      **{name: np.ascontiguousarray(a, _FIELDS[name]).tobytes() for name, a in columns.items()})
        return answer


# The answer's arrays as raw C-ordered bytes: name -> dtype (the top-k ones have k columns).
_FIELDS = {"tokens": np.int32, "logprob": np.float32, "topk_ids": np.int32, "topk_logprobs": np.float32}


def _host(parts: list) -> np.ndarray:
    """Device tensors, concatenated, on the host (one copy)."""
    import torch

    return (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu().numpy()


def requests_of(answer: dict) -> list[dict]:
    """`CaptureWorker.diffcheck_capture_collect`'s answer, per engine request: its prompt key and its rows'
    sampled tokens, own logprobs, top-k ids and top-k logprobs as arrays (views of one buffer each)."""
    k, counts = int(answer["k"]), [int(c) for c in answer["counts"]]
    n = sum(counts)
    arrays = {name: np.frombuffer(answer[name], dtype).reshape((n, k) if name.startswith("topk_") else n)
              for name, dtype in _FIELDS.items()}
    out, start = [], 0
    for prompt, count in zip(answer["prompts"], counts):
        out.append({"prompt": prompt, **{key: a[start:start + count] for key, a in arrays.items()}})
        start += count
    return out


class _Chunks:
    """A run's captured steps, on the device. Per step only the logits are copied, into one persistent
    buffer (one launch after the sampler's input is ready); every `budget` bytes of logits, and at the end,
    one log-softmax, top-k and gather over all the buffered rows at once. The per-row numbers are those of
    the per-step ops (each row is reduced alone), with a handful of launches per chunk instead of per step:
    on a small model under a FULL CUDA graph those host-side launches were the capture's cost."""

    def __init__(self, k: int, budget: int):
        self.k, self.budget = k, budget
        self.prompts: dict[str, str] = {}
        self.unsampled = 0
        self.buffer = None
        self.used = 0
        self.tokens: list = []  # the sampled ids of the buffered steps (device tensors, [rows, 1])
        self.req_rows: list[str] = []  # the engine request of every captured row, in row order
        self.done: list[tuple] = []  # (sampled, own logprob, top-k values, top-k ids) per flushed chunk

    def keep(self, logits) -> None:
        import torch

        n, vocab = logits.shape
        fits = (self.buffer is not None and self.buffer.dtype == logits.dtype and self.buffer.shape[1] == vocab
                and n <= self.buffer.shape[0])
        if not fits or self.used + n > self.buffer.shape[0]:
            self.flush()
        if not fits:
            rows = max(n, self.budget // (vocab * logits.element_size()))
            self.buffer = torch.empty((rows, vocab), dtype=logits.dtype, device=logits.device)
        self.buffer[self.used:self.used + n].copy_(logits)
        self.used += n

    def drop(self, n: int) -> None:
        """The last `n` kept rows got no tokens (the sampler raised)."""
        self.used -= n

    def sampled(self, req_ids: list[str], tokens) -> None:
        self.tokens.append(tokens)
        self.req_rows.extend(req_ids)

    def flush(self) -> None:
        used, self.used = self.used, 0
        if not self.tokens:
            return
        import torch

        sampled = torch.cat(self.tokens)
        self.tokens = []
        logits = self.buffer[:used]
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # Sampler.compute_logprobs
        values, ids = torch.topk(logprobs, self.k, dim=-1)  # Sampler.gather_logprobs
        self.done.append((sampled, logprobs.gather(-1, sampled.long()), values, ids))


class DiffcheckWorker(TapWorker, CaptureWorker):
    """diffcheck's worker extension: the per-layer taps, the device capture, and the fault switch."""

    def diffcheck_fault_switch(self, env: dict) -> str | None:
        """Make the fault `env` selects this worker's active one (`diffcheck.faults.switch`); its label."""
        from diffcheck import faults

        return faults.switch(env)


def steps_for(answer: dict, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], k: int,
              *, case_id: str) -> list[dict[str, np.ndarray]]:
    """Dense arrays per output (prompt token ids, output token ids), from `CaptureWorker`'s answer.

    An engine request's rows can hold more than its output: a chunked prefill samples (and vLLM
    discards) a token per chunk before the last, and a request that stops on a token may have had
    one more step scheduled (async scheduling). Its output is the first run of rows whose sampled
    tokens equal the output's tokens (the earliest: extra steps after a stop are the common case,
    chunked prefills of diffcheck's short prompts the rare one). Each request answers one output;
    two outputs of one prompt take the requests in the order the engine first sampled them.
    """
    if answer is None or int(answer.get("k", -1)) != int(k):
        raise EngineError(f"case '{case_id}': the device capture was not armed for top-{k} logprobs")
    pool: dict[str, list[dict]] = {}
    for req in requests_of(answer):
        pool.setdefault(req["prompt"], []).append(req)
    parts = []
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        candidates = pool.get(prompt_key(prompt), [])
        for j, req in enumerate(candidates):
            start = _run_start(req["tokens"], tokens)
            if start is not None:
                del candidates[j]
                break
        else:
            raise EngineError(f"case '{case_id}': the device capture holds no rows for output {i} "
                              f"({len(tokens)} tokens; {answer.get('unsampled', 0)} steps were not sampled by "
                              "the wrapped sampler, e.g. speculative decoding)")
        stop = start + len(tokens)
        parts.append({"token_id": tokens, "logprob": req["logprob"][start:stop].copy(),
                      "topk_ids": req["topk_ids"][start:stop].copy(),
                      "topk_logprobs": req["topk_logprobs"][start:stop].copy()})
    return parts


def _run_start(rows: np.ndarray, tokens: np.ndarray) -> int | None:
    """The earliest offset at which `tokens` occur in `rows`, or None."""
    n = len(tokens)
    if n == 0:
        return 0
    for start in np.flatnonzero(rows[:max(0, len(rows) - n + 1)] == tokens[0]):
        if np.array_equal(rows[start:start + n], tokens):
            return int(start)
    return None
