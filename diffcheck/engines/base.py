"""The engine interface: what diffcheck needs from an inference engine.

An engine is opened for one case (one engine configuration) and then asked to

- ``generate``: run the case's prompt set with its sampling parameters and capture
  the sampled token and the top-k logprobs at every step;
- ``force``: teacher-force a reference run's tokens through the decode path and
  return the engine's own top-k at every step (a ``forced`` run);
- ``score``: score another run's tokens through prompt logprobs (prefill) and
  return this engine's logprob of each token and its top-k (a ``scored`` run).

``force`` and ``score`` are written once, here (lm-evaluation-harness's ``TemplateLM``
pattern): the bookkeeping (which sequences and steps, the context each starts from,
the check that a forced engine followed the path, the run's sequences, timings,
progress and source) lives in `Engine`, and each kind implements two primitives:
`Engine._force_rows` (per `ForceJob`, the engine's rows along the forced tokens, as a
`ForcedRows`) and `Engine._score_rows` (per `ScoreJob`, the step columns of the
engine's prompt logprobs of the tokens).

Engines know nothing about verdicts or files: they return `Run` objects.
Each engine class registers its ``engine.kind`` and capabilities with
`diffcheck.engines.registry.register_engine`; `unavailable` says what it cannot do
for one configuration.

``progress``: an optional callback ``progress(done, total)`` that each of the three calls
invokes as work gets done (tokens generated or forced, tokens scored; ``total`` may
shrink when a sequence stops early), so a caller can show tokens/s and an ETA
(`diffcheck.core.progress`). None: no reports.
A failed start or a crash raises `EngineError` (exit 3) with one root-cause line.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from diffcheck.core.errors import EngineError
from diffcheck.core.types import Run
from diffcheck.engines.vllm_outputs import concat, steps_from_logprobs


@dataclass(frozen=True)
class ForceJob:
    """One sequence of a reference to teacher-force: `context` (its prompt + the reference's
    tokens before `start`) is the prompt, and the engine is forced along `forced` (the rest)."""

    index: int  # the sequence's index in the reference
    start: int
    context: list[int]
    forced: list[int]


@dataclass(frozen=True)
class ForcedRows:
    """What an engine's forced replay of one `ForceJob` gave: its step columns
    (`vllm_outputs.steps_from_logprobs`), the tokens it emitted, their text and finish reason."""

    steps: dict[str, np.ndarray]
    tokens: list[int]
    text: str
    finish_reason: str


@dataclass(frozen=True)
class ScoreJob:
    """One sequence of a run to score: `tokens` after `prompt`, in one prefill over `context`."""

    index: int
    prompt: list[int]
    tokens: list[int]

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens


def force_jobs(reference: Run, starts: Sequence[int | None] | None) -> tuple[list[ForceJob], list[int | None]]:
    """The sequences of `reference` to force from `starts` (default: every one from step 0; None leaves
    one out), and per sequence the step its forced rows begin at (None: none forced)."""
    n = len(reference.sequences)
    starts = [0] * n if starts is None else list(starts)
    if len(starts) != n:
        raise ValueError(f"starts has {len(starts)} entries for {n} sequences")
    jobs, from_steps = [], []
    for i, seq in enumerate(reference.sequences):
        path = [int(t) for t in reference.sequence(i).token_id]
        start = starts[i]
        if start is not None and not 0 <= int(start) <= len(path):
            raise ValueError(f"seq {i}: start {start} is outside its {len(path)} steps")
        forced = path[int(start):] if start is not None else []
        from_steps.append(int(start) if forced else None)
        if forced:
            jobs.append(ForceJob(index=i, start=int(start), context=list(seq.prompt_token_ids) + path[: int(start)],
                                 forced=forced))
    return jobs, from_steps


def score_jobs(run: Run) -> list[ScoreJob]:
    """The sequences of `run` that have tokens to score."""
    jobs = []
    for i, seq in enumerate(run.sequences):
        tokens = [int(t) for t in run.sequence(i).token_id]
        if tokens:
            jobs.append(ScoreJob(index=i, prompt=list(seq.prompt_token_ids), tokens=tokens))
    return jobs


class Engine(ABC):
    name = "engine"
    # Set by `registry.register_engine`: the case's engine.kind and what the class can do.
    kind = "engine"
    capabilities: frozenset[str] = frozenset()
    description = ""

    @classmethod
    def unavailable(cls, engine_cfg: dict[str, Any]) -> dict[str, str]:
        """{capability: why} for what this class cannot do with `engine_cfg` (a case's engine table)."""
        from diffcheck.engines.registry import CAPABILITIES

        return {c: "" for c in CAPABILITIES if c not in cls.capabilities}

    @classmethod
    def code_identity(cls, engine_cfg: dict[str, Any]) -> dict[str, Any] | None:
        """What code this engine would run (version, commit, dirty), without starting it; None when
        diffcheck cannot know (a server someone else runs), so no golden counts as up to date."""
        from diffcheck.storage.identity import vllm_source_state

        return vllm_source_state()

    def _take_case(self, case, model, prompts, verbose: bool, kind: str) -> None:
        """What every engine keeps of its case; a fault env or an engine.kind it cannot run is
        refused in one line, before anything starts."""
        from diffcheck import faults
        from diffcheck.core.errors import ConfigError

        self.case, self.model, self.prompts, self.verbose = case, model, list(prompts), verbose
        self.env = {str(k): str(v) for k, v in (case.env or {}).items()}
        faults.validate_env(self.env)
        self.requested = dataclasses.asdict(case.engine)
        if (self.requested.get("kind") or "vllm") != kind:
            raise ConfigError(f"case '{case.id}': engine.kind {self.requested.get('kind')!r} is not {kind!r}")

    @abstractmethod
    def generate(self, *, progress=None) -> Run: ...

    # -- forced replay and scoring: the bookkeeping, once ---------------------------------------
    #: Whether `_force_rows` and `_score_rows` report ``progress`` as they go; else `force` and
    #: `score` report the whole once it is done.
    streams_progress = False

    def _require_open(self) -> None:
        """Raise `EngineError` when the engine is closed (a kind that can tell overrides this)."""

    def _check_forcing(self) -> None:
        """Raise `EngineError` where this engine cannot be teacher-forced (before any work)."""

    def _force_hint(self) -> str:
        """What the error for a forced replay that left the reference's path names as the likely cause."""
        return f"mechanism {self.mechanism}"

    def _k(self) -> int:
        return int(self.case.sampling.logprobs or 0)

    @abstractmethod
    def _force_rows(self, jobs: list[ForceJob], k: int, *, progress=None) -> list[ForcedRows]:
        """The primitive of `force`: per job, in order, the engine's top-`k` rows along ``job.forced``
        from ``job.context``, through its decode path where it has one."""

    @abstractmethod
    def _score_rows(self, jobs: list[ScoreJob], k: int, *, progress=None) -> list[dict[str, np.ndarray]]:
        """The primitive of `score`: per job, in order, the step columns of the engine's logprob of
        each of ``job.tokens`` and its top-`k`, from one prefill of ``job.context``."""

    def force(self, reference: Run, *, starts: Sequence[int | None] | None = None, progress=None) -> Run:
        """Teacher-force `reference`'s tokens through this engine's decode path (a ``forced`` run).

        `starts`: per sequence of `reference`, the first step to force (default: 0 for
        every sequence, the whole path); None leaves a sequence out. A sequence started
        at step s > 0 gets its prompt + the reference's first s tokens as the prompt (a
        prefill; a prefix-cache hit where the engine caches prefixes) and is forced
        along the rest: its row at step s comes from that prefill's last position, not
        from a decode step; rows after s are decode steps again. The returned run's
        sequence i holds steps ``starts[i]..`` only (`diffcheck.engines.replay`
        puts the whole forced path together); ``meta.source["from_steps"]`` says where
        each began.
        """
        self._check_forcing()
        self._require_open()
        k = self._k()
        jobs, from_steps = force_jobs(reference, starts)
        done, elapsed = self._timed(self._force_rows, jobs, k, progress)
        seqs, steps = [], []
        for i, seq in enumerate(reference.sequences):
            if i not in done:
                seqs.append(dataclasses.replace(seq, text="", n_tokens=0))
                steps.append(steps_from_logprobs([], None, k))
                continue
            job, r = done[i]
            if r.tokens != job.forced:
                raise EngineError(f"forced replay did not follow the reference for case '{self.case.id}' seq {i} "
                                  f"({len(r.tokens)} of {len(job.forced)} tokens; {self._force_hint()})")
            steps.append(r.steps)
            seqs.append(dataclasses.replace(seq, text=r.text, finish_reason=r.finish_reason, n_tokens=len(r.tokens)))
        n = sum(s.n_tokens for s in seqs)
        self._report(progress, n)
        self.timings.update(force_s=elapsed, force_tokens=n)
        source = {"reference": reference.meta.case_id, "mechanism": self.mechanism}
        if any(s not in (0, None) for s in from_steps):
            source["from_steps"] = from_steps
        return Run(meta=run_meta(self, "forced", source), sequences=tuple(seqs), steps=concat(steps, k))

    def score(self, run: Run, *, progress=None) -> Run:
        """This engine's logprob of each of `run`'s tokens, through prompt logprobs (prefill): a ``scored`` run."""
        self._require_open()
        k = self._k()
        done, elapsed = self._timed(self._score_rows, score_jobs(run), k, progress)
        seqs, steps = [], []
        for i, seq in enumerate(run.sequences):
            if i not in done:
                seqs.append(dataclasses.replace(seq, text="", finish_reason="scored", n_tokens=0))
                steps.append(steps_from_logprobs([], None, k))
                continue
            job, r = done[i]
            steps.append(r)
            seqs.append(dataclasses.replace(seq, finish_reason="scored", n_tokens=len(job.tokens)))
        self._report(progress, sum(s.n_tokens for s in seqs))
        self.timings.update(score_s=elapsed)
        source = {"scored_run": run.meta.case_id, "scored_kind": run.meta.kind, "scorer": self.case.id}
        return Run(meta=run_meta(self, "scored", source), sequences=tuple(seqs), steps=concat(steps, k))

    @staticmethod
    def _timed(primitive, jobs: list, k: int, progress) -> tuple[dict[int, tuple[Any, Any]], float]:
        """`primitive` over `jobs` (not called for none): {sequence index: (job, its rows)}, and its seconds."""
        t0 = time.perf_counter()
        rows = primitive(jobs, k, progress=progress) if jobs else []
        elapsed = time.perf_counter() - t0
        return {job.index: (job, r) for job, r in zip(jobs, rows)}, elapsed

    def _report(self, progress, n: int) -> None:
        """The whole, once done, for a kind whose primitives do not report as they go."""
        if progress is not None and not self.streams_progress:
            progress(n, n)

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """name, version, commit, dirty, requested and effective config."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def warn(line: str) -> None:
    """One ``diffcheck: warning: ...`` line: through the CLI's progress display where one shows (so a
    live display does not draw over it), else on stderr; never dropped, also for library callers."""
    import sys

    from diffcheck.core import progress

    text = f"diffcheck: warning: {line}"
    reporter = progress.current()
    if type(reporter) is progress.Reporter:  # the silent default: nobody would see it there
        print(text, file=sys.stderr, flush=True)
    else:
        reporter.log(text)


def run_meta(engine, kind: str, source: dict | None = None):
    """The `RunMeta` of a run `engine` produced now (its case, info, model, timings; sampling as configured)."""
    import datetime

    from diffcheck.core import __version__
    from diffcheck.core.types import RunMeta

    case = engine.case
    return RunMeta(
        suite=case.suite, case_id=case.id, role=case.role, kind=kind, engine=engine.info(),
        model=engine.model.identity(), sampling=dataclasses.asdict(case.sampling), hardware=hardware(),
        env=dict(engine.env), timings=dict(engine.timings), source=source or {},
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        diffcheck_version=__version__,
    )


def hardware() -> dict[str, Any]:
    """CPU model and the flags that change numerics, or GPU name and count."""
    info: dict[str, Any] = {"machine": platform.machine(), "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                info["cpu_flags"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
                break
    except OSError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu_name"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
            info["cuda"] = torch.version.cuda
        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info
