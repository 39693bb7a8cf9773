"""Smoke runs of the faults on a real vLLM engine: one engine per config, one after another.

``python -m tools.fault_smoke --out results.json clean stale-decode-metadata ...``

Each config (``clean`` or a DIFFCHECK_FAULT value) becomes one case of a small
generated suite whose env holds the DIFFCHECK_FAULT* variables (the engine sets them
while vLLM spawns its engine core and worker, so they are set before those processes
exist). Each case's engine is opened through the public engine API
(`diffcheck.engines.session.open_engine`), runs the smoke prompts greedily, and is
closed before the next config starts: never two engines at once. Then the fault's
marker file is read back.

When ``clean`` is among the configs it runs last, and its engine also scores every
other config's output (`score`: prompt logprobs, prefill, the clean model): the mean
negative log-likelihood per token of the output after decode step N says how much
worse a fault's text is, even where it stays fluent.

Used by tests/test_faults_engine.py; knows nothing about goldens or verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from diffcheck.faults import marker as marker_file
from diffcheck.cases.faults import ENV_FAULT, ENV_MARKER, ENV_OPTIONS, ENV_SCALE, ENV_STEP, parse_env

CLEAN = "clean"
SMOKE_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",  # ends at EOS before 48 tokens: the batch shrinks mid-run
)
# Engine settings known to work on the 2-core CPU lane (docs/model.md); the 1 GiB KV
# cache (VLLM_CPU_KVCACHE_SPACE) instead of vLLM's memory fraction: the machine is shared.
SMOKE_SCALE = "1.0"  # noise as strong as the attention output itself
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 2048, "seed": 0, "kv_cache_memory_gib": 1}


@dataclass(frozen=True)
class SmokeResult:
    config: str
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    marker_events: list[dict]
    driver_pid: int
    start_s: float  # engine start (open_engine)
    generate_s: float
    # Mean NLL (nats/token) under the clean model of output tokens after decode step N,
    # per sequence; filled when a `clean` config ran in the same smoke run.
    nll_after_step: list[float | None] = field(default_factory=list)
    error: str | None = None


def _fault_env(config: str, *, step: int, marker: str) -> dict[str, str]:
    if config == CLEAN:
        return {}
    env = {ENV_FAULT: config, ENV_MARKER: marker}
    spec = parse_env(env)
    if spec is not None and spec.info.takes_step:
        env[ENV_STEP] = str(step)
    if spec is not None and ENV_SCALE in spec.info.options and not spec.fixed:
        # The default strength sits near the edge of what changes a greedy token (the
        # self-test measures that edge); the smoke run checks that the fault acts, so it
        # uses a strength that changes the output for certain.
        env[ENV_SCALE] = SMOKE_SCALE
    return env


def _set_env(env: dict[str, str]) -> None:
    for key in (ENV_FAULT,) + ENV_OPTIONS:
        os.environ.pop(key, None)
    os.environ.update(env)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))  # a TOML basic string


def write_suite(workdir: Path, model: str, envs: dict[str, dict[str, str]], *, max_tokens: int) -> Path:
    """A suite with one case per config (ids c0, c1, ... in `envs` order): greedy, the smoke prompts."""
    prompts = workdir / "smoke-prompts.toml"
    prompts.write_text("".join(f"[[prompt]]\nid = \"p{i}\"\ntext = {_toml(text)}\n\n"
                               for i, text in enumerate(SMOKE_PROMPTS)))
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "seed": 0, "logprobs": 1}
    lines = ['[suite]', 'name = "fault-smoke"', 'description = "faults inside a real engine, one case per config"',
             '', '[defaults]', f"model = {_toml(model)}", f"prompts = {_toml(prompts)}",
             f"sampling = {_toml(sampling)}", f"engine = {_toml(ENGINE)}", '']
    for i, (config, env) in enumerate(envs.items()):
        lines += [f"[cases.c{i}]", 'role = "reference"', f"description = {_toml(config)}", f"env = {_toml(env)}", '']
    path = workdir / "fault-smoke.toml"
    path.write_text("\n".join(lines))
    return path


def _nll_after_step(scored, *, step: int) -> list[float | None]:
    """Mean NLL (nats/token, the scoring model) of each sequence's tokens with index > step; None if none."""
    means: list[float | None] = []
    for i in range(len(scored.sequences)):
        tail = scored.sequence(i).logprob[step + 1 :]
        means.append(float(-tail.astype("float64").mean()) if len(tail) else None)
    return means


@dataclass(frozen=True)
class _EngineRun:
    result: SmokeResult
    run: object  # the generated diffcheck Run, for the clean engine to score
    scores: dict[str, list[float | None]]  # other config -> its nll_after_step under this engine


def run_config(case, config: str, *, step: int, marker: Path, score: dict[str, object] | None = None) -> _EngineRun:
    """One engine for `config`'s case; if `score` (config -> Run) is given, this engine also scores those."""
    from diffcheck.engines import session as sessionmod

    t0 = time.monotonic()
    with sessionmod.open_engine(case) as engine:
        t1 = time.monotonic()
        run = engine.generate()
        t2 = time.monotonic()
        scores = {name: _nll_after_step(engine.score(other), step=step) for name, other in (score or {}).items()}
        own_nll = _nll_after_step(engine.score(run), step=step) if score else []
    events = marker_file.read_events(marker)
    result = SmokeResult(
        config=config,
        token_ids=[run.sequence(i).token_id.tolist() for i in range(len(run.sequences))],
        texts=[s.text for s in run.sequences],
        finish_reasons=[s.finish_reason for s in run.sequences],
        marker_events=events,
        driver_pid=os.getpid(),
        start_s=round(t1 - t0, 2),
        generate_s=round(t2 - t1, 2),
        nll_after_step=own_nll,
    )
    return _EngineRun(result=result, run=run, scores=scores)


def run_all(model: str, configs: list[str], *, step: int, max_tokens: int) -> list[SmokeResult]:
    """Each config in its own engine, sequentially; `clean` last so it can score the others."""
    from diffcheck import cases

    ordered = [c for c in configs if c != CLEAN] + [c for c in configs if c == CLEAN]
    results: list[SmokeResult] = []
    runs: dict[str, object] = {}
    _set_env({})  # only a case's own env selects a fault
    with tempfile.TemporaryDirectory(prefix="diffcheck-faults-") as tmp:
        workdir = Path(tmp)
        markers = {c: workdir / f"marker-{c.replace(':', '_')}.jsonl" for c in ordered}
        envs: dict[str, dict[str, str]] = {}
        refused: dict[str, Exception] = {}
        for config in ordered:
            try:
                envs[config] = _fault_env(config, step=step, marker=str(markers[config]))
            except Exception as exc:  # a bad name fails here, before an engine starts
                refused[config] = exc
        try:
            suite = cases.load_suite(write_suite(workdir, model, envs, max_tokens=max_tokens))
        except Exception as exc:
            refused.update({c: exc for c in envs})
        case_ids = {config: f"c{i}" for i, config in enumerate(envs)}
        for config in ordered:
            score = dict(runs) if config == CLEAN else None
            try:
                if config in refused:
                    raise refused[config]
                run = run_config(suite.cases[case_ids[config]], config, step=step, marker=markers[config],
                                 score=score)
                results = [replace(r, nll_after_step=run.scores[r.config]) if r.config in run.scores else r
                           for r in results]
                results.append(run.result)
                runs[config] = run.run
            except Exception as exc:  # one broken config must not hide the others' results
                message = f"{type(exc).__name__}: {exc}".splitlines()[0]
                results.append(SmokeResult(config=config, token_ids=[], texts=[], finish_reasons=[],
                                           marker_events=[], driver_pid=os.getpid(), start_s=0.0,
                                           generate_s=0.0, error=message))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fault_smoke", description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="'clean' or DIFFCHECK_FAULT values")
    parser.add_argument("--out", required=True, type=Path, help="JSON file for the results")
    parser.add_argument("--model", default="smollm2-135m", help="known model id or path (default smollm2-135m)")
    parser.add_argument("--step", type=int, default=16, help="DIFFCHECK_FAULT_STEP (default 16)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    from diffcheck.core.errors import DiffcheckError
    from diffcheck.engines.models import resolve

    try:
        model_path = str(resolve(args.model).path)
    except DiffcheckError as exc:
        print(f"diffcheck: error: {exc}", file=sys.stderr)
        return exc.exit_code
    t0 = time.monotonic()
    results = run_all(model_path, args.configs, step=args.step, max_tokens=args.max_tokens)
    payload = {
        "model": model_path,
        "step": args.step,
        "max_tokens": args.max_tokens,
        "wall_s": round(time.monotonic() - t0, 2),
        "results": [asdict(r) for r in results],
    }
    args.out.write_text(json.dumps(payload, indent=1))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
