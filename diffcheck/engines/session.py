"""The engine session: the one way to drive an engine for a case.

open -> generate -> force along goldens -> score -> close, with progress and the
engine's one-line errors, written once. Every workflow (record, compare, calibrate,
matrix on either executor, bisect, selftest) drives engines through here; nothing in
this module writes a file (`diffcheck.workspace` alone writes).

`EngineSession` keeps engines up across the cases of one command: an engine is opened
once per case configuration and closed when the session ends, the last opened first.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from diffcheck import cases as casesmod
from diffcheck.cases.faults import ENV_SWITCHABLE, parse_env, without_faults
from diffcheck.core import progress
from diffcheck.core.types import Run
from diffcheck.engines import registry
from diffcheck.engines import replay as replaymod

Echo = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def open_engine(case, *, verbose: bool = False, taps: bool = False):
    """Start the engine the case's ``engine.kind`` names (`diffcheck.engines.registry`); with `taps`, one
    that can capture per-layer taps (`diffcheck.engines.taps`: vLLM offline only)."""
    from diffcheck.engines import models

    engine_class = registry.engine_class(case.engine.kind or "vllm")
    model = models.resolve_case(case)
    prompts = casesmod.load_prompts(case)
    progress.activity(f"{case.id}: starting the engine")
    extra, shown = {}, progress.current()  # the phases arrive on the engine's log-tailing thread
    if "on_phase" in inspect.signature(engine_class).parameters:  # start-up phases, where the engine has them
        extra["on_phase"] = lambda phase: shown.activity(f"{case.id}: engine start: {phase}")
    if taps:
        if "taps" not in inspect.signature(engine_class).parameters:
            from diffcheck.core.errors import ConfigError

            raise ConfigError(f"case '{case.id}': engine.kind {case.engine.kind or 'vllm'!r} cannot capture "
                              "per-layer taps (vllm only)")
        extra["taps"] = True
    return engine_class(case, model, prompts=prompts, verbose=verbose, **extra)


def config_key(case, *, faults_switched: bool = False) -> str:
    """What an engine is built from: the model, the engine table and the env (not the prompts, not
    the sampling, which each request carries); with `faults_switched`, the env without its fault
    (`fault_switchable`)."""
    import hashlib
    import json

    env = without_faults(case.env) if faults_switched else case.env
    payload = {"model": case.model, "engine": dataclasses.asdict(case.engine), "env": dict(sorted(env.items()))}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def fault_switchable(case) -> bool:
    """Whether `case`'s fault can be switched into a kept engine of its configuration instead of
    needing an engine of its own: a CPU-lane fault (`diffcheck.faults.switch`) in an eager vLLM
    offline engine (under torch.compile a patched Python path is traced once)."""
    spec = parse_env(case.env)
    return (spec is not None and spec.info.lane == "cpu" and (case.engine.kind or "vllm") == "vllm"
            and bool(case.engine.enforce_eager))


def with_config(run: Run, case) -> Run:
    """`run` stamped with the config digest of the case that produced it."""
    source = {**run.meta.source, "config_digest": casesmod.config_digest(case)}
    return dataclasses.replace(run, meta=dataclasses.replace(run.meta, source=source))


def on_this_cpu(case):
    """`case`'s model as this machine's CPU runs it: vLLM, float32, eager (the CPU lane's reference
    configuration), to score a run whose golden was recorded on a GPU this machine lacks
    (cross-hardware scoring, `workflows.compare`).

    Kept: the model and so its tokenizer, the prompts, the sampling (the top-k width a scored run
    holds), ``max_model_len``, ``seed`` and ``trust_remote_code``. Everything else in the engine
    table belongs to the GPU run and is dropped here, the one place it is: the attention backend,
    CUDA graphs and torch.compile, the dtype, KV-cache dtype and quantization (the model scores in
    float32; a checkpoint's own quantization is still read from its config), tensor parallelism,
    batch shape and memory settings, ``extra`` constructor arguments, and the case's env (the GPU
    image's workarounds; never a fault). The KV cache is the CPU lane's 1 GiB (``kv_cache_memory_gib``)."""
    e = case.engine
    engine = casesmod.EngineConfig(kind="vllm", dtype="float32", enforce_eager=True, max_model_len=e.max_model_len,
                                   seed=e.seed, trust_remote_code=e.trust_remote_code, kv_cache_memory_gib=1,
                                   enable_prefix_caching=False)
    return dataclasses.replace(case, engine=engine, env={})


def candidate_references(case, references: list[str]) -> list[str]:
    """The references a candidate is forced along: none where its engine cannot force."""
    return [] if "forced_replay" in registry.missing(case) else list(references)


class EngineSession:
    """Engines kept open across the cases of one command: one start per case configuration.

    """

    def __init__(self, *, verbose: bool = False, taps: bool = False, exclusive: bool = False,
                 switch_faults: bool = False):
        self.verbose = verbose
        self.taps = taps  # engines opened with the per-layer taps (`diffcheck.engines.taps`)
        self.exclusive = exclusive  # one engine at a time: a GPU holds one engine at vLLM's memory fraction
        # `rebound`: cases whose configurations differ only in a switchable fault share one engine
        self.switch_faults = switch_faults
        self.engines: dict[str, Any] = {}
        self.kept = False  # whether the last `rebound` found its engine open already

    def key(self, case) -> str:
        """What `get` keeps `case`'s engine under: its id, or with ``switch_faults`` and a switchable
        fault (`fault_switchable`) the engine its configuration's fault cases share."""
        if self.switch_faults and fault_switchable(case):
            return "switched:" + config_key(case, faults_switched=True)
        return case.id

    def get(self, case, echo: Echo = print, *, key: str | None = None):
        """The open engine of `case`, started on first use (with `exclusive`, once the others are closed).
        `key`: what it is kept under, where it is not the case's own engine (default: `EngineSession.key`;
        an engine kept under a switched key gets `case`'s fault switched in, as in `rebound`)."""
        switched = key is None and self.key(case) != case.id
        key = key or self.key(case)
        if key not in self.engines and self.exclusive:
            self.close()
        kept = " (kept open for this command" + (", faults switched in at runtime)" if switched else ")")
        return self._open_or_switch(key, case, switched, echo, f"starting engine {case.id if switched else key}"
                                    + ("" if self.exclusive else kept), taps=self.taps)

    def _open_or_switch(self, key: str, case, switched: bool, echo: Echo, starting: str, *, taps: bool = False):
        """The engine under `key`: started for `case` (with every CPU-lane fault patched in where
        `switched`) and announced with `starting`, or, kept and `switched`, with `case`'s fault switched in."""
        if key not in self.engines:
            echo(starting)
            opened = dataclasses.replace(case, env={**case.env, ENV_SWITCHABLE: "1"}) if switched else case
            self.engines[key] = open_engine(opened, verbose=self.verbose, taps=taps)
        elif switched:
            echo(f"{case.id}: switching the kept engine to fault {parse_env(case.env).label}")
            self.engines[key].switch_fault(case.env)
        return self.engines[key]

    def release(self, case, keep_for=None) -> None:
        """Close the engine `get` gave `case`, unless `keep_for` (the next case) would get the same one."""
        key = self.key(case)
        if keep_for is not None and self.key(keep_for) == key:
            return
        engine = self.engines.pop(key, None)
        if engine is not None:
            progress.activity(f"{case.id}: shutting the engine down")
            engine.close()

    def rebound(self, case, echo: Echo = print):
        """An open engine built from `case`'s configuration (model, engine table, env) and bound to
        `case`'s prompts and sampling, so cases that differ only there (the probes of
        `diffcheck reduce`) share one start. One such engine at a time: the one of another
        configuration is closed first.

        With ``switch_faults``, cases that differ only in a switchable fault (`fault_switchable`)
        share one too: its processes start with every CPU-lane fault patched in, and each case
        switches its own fault in (`engines.vllm_offline.VllmOffline.switch_fault`: the
        decode-step clock restarts, the prefix cache is emptied)."""
        switched = self.switch_faults and fault_switchable(case)
        # never the key of an engine without the faults patched in (a clean case of this configuration)
        key = ("config:switched:" if switched else "config:") + config_key(case, faults_switched=switched)
        for other in [k for k in self.engines if k.startswith("config:") and k != key]:
            self.engines.pop(other).close()
        self.kept = key in self.engines  # for the output: no start this time
        engine = self._open_or_switch(key, case, switched, echo,
                                      f"{case.id}: starting candidate engine (kept open for cases of this "
                                      f"configuration{', faults switched in at runtime' if switched else ''})")
        engine.case, engine.prompts = case, list(casesmod.load_prompts(case))
        engine.env = {str(k): str(v) for k, v in case.env.items()}
        return engine

    def close(self) -> None:
        """Close every engine, the last one opened first; a failing close does not keep the others open."""
        failures = []
        while self.engines:
            _, engine = self.engines.popitem()  # dicts pop the last inserted first
            try:
                engine.close()
            except Exception as exc:  # re-raised below, once the others are closed
                failures.append(exc)
        if failures:
            raise failures[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def generate(case, *, session: EngineSession | None = None, verbose: bool = False, echo: Echo = print,
             again: bool = False) -> Run | tuple[Run, Run]:
    """The case's prompts generated by its engine (from `session` when given); with `again`, twice."""
    import contextlib

    with contextlib.ExitStack() as stack:
        if session is not None:
            engine = session.get(case, echo)
        else:
            echo(f"{case.id}: starting engine ({case.description or case.role})")
            engine = stack.enter_context(open_engine(case, verbose=verbose))
        echo(f"{case.id}: engine up in {engine.timings['startup_s']:.1f}s; generating {len(engine.prompts)} prompts")
        run = with_config(engine.generate(progress=progress.task(f"{case.id}: generating")), case)
        echo(f"{case.id}: {run.n_tokens} tokens in {engine.timings['generate_s']:.1f}s")
        second = None
        if again:
            echo(f"{case.id}: generating again to check determinism")
            second = with_config(engine.generate(progress=progress.task(f"{case.id}: generating again")), case)
        if session is None:
            progress.activity(f"{case.id}: shutting the engine down")
    return (run, second) if again else run


def generate_and_force(case, references: list[str], goldens: dict[str, Run], *, mode: str, why: str = "",
                       verbose: bool = False, echo: Echo = print,
                       session: EngineSession | None = None) -> tuple[Run, dict[str, Run]]:
    """One engine start: generate the candidate, then teacher-force it along each golden.

    Forced replay runs only where it is needed (`diffcheck.engines.replay`): a sequence
    whose sampled tokens equal the golden's has walked the golden's path already, and its
    forced rows are its own generate rows (reused); a sequence that diverged at t* is
    replayed from t* only (``mode="partial"``), or every sequence from step 0
    (``mode="full"``); a partial replay that does not reproduce the generation at t* is
    redone from step 0 for that sequence (`replay.unreproduced`). Writes nothing. With
    `session`, its engine of this configuration (`EngineSession.rebound`) is used and left open.
    """
    import contextlib

    with contextlib.ExitStack() as stack:
        if session is not None:
            engine = session.rebound(case, echo)
        else:
            engine = stack.enter_context(open_engine(case, verbose=verbose))
        up = "engine kept from an earlier case" if session is not None and session.kept else \
            f"engine up in {engine.timings['startup_s']:.1f}s"
        echo(f"{case.id}: {up}; generating {len(engine.prompts)} prompts")
        cand = with_config(engine.generate(progress=progress.task(f"{case.id}: generating")), case)
        if cand.meta.role != "candidate":  # a reference re-run against its own golden: a run, never a golden
            cand = dataclasses.replace(cand, meta=dataclasses.replace(cand.meta, role="candidate"))
        echo(f"{case.id}: {cand.n_tokens} tokens in {engine.timings['generate_s']:.1f}s")
        forced = {}
        for ref_id in references:
            golden = goldens[ref_id]
            todo = replaymod.plan(golden, cand, mode)
            echo(f"{case.id}: forced decode replay along golden {ref_id} ({todo.describe()}; {engine.mechanism}"
                 + (f"; full because {why}" if mode == "full" and why != "requested" else "") + ")")
            part = engine.force(golden, starts=todo.starts, progress=progress.task(
                f"{case.id}: forced replay along {ref_id}")) if todo.replayed else None
            redo = replaymod.unreproduced(cand, todo, part)
            if redo:  # the prefill at t* did not give what the decode step gave: the history matters
                echo(f"{case.id}: the partial replay along {ref_id} does not reproduce the generation at t* of "
                     f"sequence(s) {', '.join(f'{i} (KL {kl:.2g})' for i, kl in sorted(redo.items()))}; "
                     "replaying them from step 0")
                full = engine.force(golden, starts=[0 if i in redo else None for i in range(len(todo.starts))],
                                    progress=progress.task(f"{case.id}: full replay along {ref_id}"))
                todo, part = replaymod.with_full(todo, part, full, redo)
            run = replaymod.assemble(golden, cand, todo, part, reference_id=ref_id, mechanism=engine.mechanism)
            forced[ref_id] = with_config(run, case)
        if session is None:
            progress.activity(f"{case.id}: shutting the engine down")
    return cand, forced


def force(case, golden: Run, *, verbose: bool = False, label: str = "") -> Run:
    """A fresh engine of `case` teacher-forced along `golden` from step 0 (a noise-floor replica)."""
    with open_engine(case, verbose=verbose) as engine:
        run = engine.force(golden, progress=progress.task(f"{case.id}: forcing along the golden{label}"))
        progress.activity(f"{case.id}: shutting the engine down")
    return run


def score(ref_case, candidate: Run, *, session: EngineSession | None = None, verbose: bool = False,
          echo: Echo = print, key: str | None = None) -> Run:
    """The reference engine's logprobs of the candidate's tokens (prefill scoring). Writes nothing.
    `key`: the engine's key in `session` (`EngineSession.get`)."""
    task = progress.task(f"{ref_case.id}: scoring {candidate.meta.case_id}'s text")
    if session is not None:
        return session.get(ref_case, echo, key=key).score(candidate, progress=task)
    echo(f"{candidate.meta.case_id}: starting reference engine {ref_case.id} to score the candidate's text")
    with open_engine(ref_case, verbose=verbose) as engine:
        scored = engine.score(candidate, progress=task)
        progress.activity(f"{ref_case.id}: shutting the engine down")
    return scored
