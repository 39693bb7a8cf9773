"""The engine interface: what diffcheck needs from an inference engine.

An engine is opened for one case (one engine configuration) and then asked to

- ``generate``: run the case's prompt set with its sampling parameters and capture
  the sampled token and the top-k logprobs at every step;
- ``force``: teacher-force a reference run's tokens through the decode path and
  return the engine's own top-k at every step (a ``forced`` run);
- ``score``: score another run's tokens through prompt logprobs (prefill) and
  return this engine's logprob of each token and its top-k (a ``scored`` run).

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
from abc import ABC, abstractmethod
from typing import Any

from diffcheck.core.types import Run


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

    @abstractmethod
    def force(self, reference: Run, *, progress=None) -> Run: ...

    @abstractmethod
    def score(self, run: Run, *, progress=None) -> Run: ...

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """name, version, commit, dirty, requested and effective config."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_meta(engine, kind: str, source: dict | None = None):
    """The `RunMeta` of a run `engine` produced now (its case, info, model, timings; sampling as configured)."""
    import dataclasses
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
