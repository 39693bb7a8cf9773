"""Top-k logprobs captured on the device, inside vLLM's engine process, moved to the host once.

vLLM's own logprobs path (``SamplingParams(logprobs=k)``) turns every decode step's top-k
arrays into host lists and per-request slices before the next step can start; under a
FULL CUDA graph, where the replay of a small model is short, that host work is on the
critical path (docs/gpu.md: +26 % of decode time on the H200). This module captures the
same numbers without it:

- `CaptureWorker`, a vLLM *worker extension* mixed into the worker class (with the
  per-layer taps, `DiffcheckWorker`): ``diffcheck_capture_arm(k)`` wraps the V1 model
  runner's ``_sample``. Per step the wrapper runs the ops vLLM's sampler runs for
  ``logprobs_mode = "raw_logprobs"`` on the logits it is handed, before any logits
  processor touches them (``log_softmax(dtype=float32)``, ``topk``, a ``gather`` of the
  sampled token), and keeps the resulting device tensors; nothing is copied to the host
  and no Python object is built per request. ``diffcheck_capture_collect()`` unwraps,
  concatenates every step and copies each array to the host once.
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


class CaptureWorker:
    """Mixed into vLLM's worker class (worker_extension_cls); runs in the process that runs the model."""

    def diffcheck_capture_arm(self, k: int) -> bool:
        """Capture the top `k` logprobs and the sampled token's logprob of every sampled row from now
        on. False where this runner has no V1 ``_sample`` to wrap (the caller then uses vLLM's path)."""
        import torch

        self.diffcheck_capture_collect()  # a stale arm from an interrupted run: drop it
        runner = self.model_runner
        original = getattr(type(runner), "_sample", None)
        if original is None:
            return False
        k = int(k)
        state = {"k": k, "steps": [], "prompts": {}, "unsampled": 0}

        def sample(logits, spec_decode_metadata=None, *args, **kwargs):
            if logits is None or spec_decode_metadata is not None:  # nothing sampled here, or speculative
                state["unsampled"] += 1
                return original(runner, logits, spec_decode_metadata, *args, **kwargs)
            req_ids = runner.input_batch.req_ids[: logits.shape[0]]  # a copy: vLLM reorders its list in place
            prompts = state["prompts"]
            for rid in req_ids:
                if rid not in prompts:
                    req = runner.requests.get(rid)
                    ids = getattr(req, "prompt_token_ids", None)
                    prompts[rid] = prompt_key(ids) if ids is not None else ""
            logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # Sampler.compute_logprobs
            values, ids = torch.topk(logprobs, k, dim=-1)  # Sampler.gather_logprobs
            out = original(runner, logits, spec_decode_metadata, *args, **kwargs)
            sampled = out.sampled_token_ids[:, :1]
            state["steps"].append((req_ids, sampled, logprobs.gather(-1, sampled.long()), values, ids))
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
        steps = state["steps"]
        answer = {"k": state["k"], "unsampled": state["unsampled"], "requests": []}
        if not steps:
            return answer
        import torch

        # One host copy per array for the whole run. Plain lists: vLLM's RPC answer carries no typed arrays.
        tokens = torch.cat([s[1] for s in steps])[:, 0].tolist()
        own = torch.cat([s[2] for s in steps])[:, 0].tolist()
        values = torch.cat([s[3] for s in steps]).tolist()
        ids = torch.cat([s[4] for s in steps]).tolist()
        rows: dict[str, list[int]] = {}
        row = 0
        for req_ids, *_ in steps:
            for rid in req_ids:
                rows.setdefault(rid, []).append(row)
                row += 1
        for rid, picked in rows.items():
            answer["requests"].append({
                "prompt": state["prompts"].get(rid, ""), "tokens": [tokens[r] for r in picked],
                "logprob": [own[r] for r in picked], "topk_ids": [ids[r] for r in picked],
                "topk_logprobs": [values[r] for r in picked]})
        return answer


class DiffcheckWorker(TapWorker, CaptureWorker):
    """diffcheck's worker extension: the per-layer taps and the device capture."""


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
    for req in answer["requests"]:
        pool.setdefault(req["prompt"], []).append(req)
    parts = []
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        tokens = [int(t) for t in tokens]
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
        n = len(tokens)
        parts.append({
            "token_id": np.asarray(tokens, np.int32),
            "logprob": np.asarray(req["logprob"][start:stop], np.float32).reshape(n),
            "topk_ids": np.asarray(req["topk_ids"][start:stop], np.int32).reshape(n, k),
            "topk_logprobs": np.asarray(req["topk_logprobs"][start:stop], np.float32).reshape(n, k)})
    return parts


def _run_start(rows: Sequence[int], tokens: Sequence[int]) -> int | None:
    """The earliest offset at which `tokens` occur in `rows`, or None."""
    n = len(tokens)
    for start in range(len(rows) - n + 1):
        if list(rows[start:start + n]) == list(tokens):
            return start
    return None
