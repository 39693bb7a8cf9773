"""Smoke runs of the faults on a real vLLM engine.

``python -m tools.fault_smoke --out results.json clean stale-decode-metadata ... [--fresh stale-decode-metadata]``

Each config (``clean`` or a DIFFCHECK_FAULT value) becomes one case of a small
generated suite whose env holds the DIFFCHECK_FAULT* variables. The fault configs run in
one engine, each switched in in turn, as the self-test runs them
(`diffcheck.engines.session.EngineSession` with ``switch_faults``: the engine's processes
start with every CPU-lane fault patched in, `diffcheck.faults.switch` picks the one that
acts); that engine then runs once more with its fault switched off (``clean@switched``).
A config named with ``--fresh`` also runs in an engine of its own (``<config>@fresh``),
started with that fault alone, as a user's case would be: the two must agree. Each
config's marker file is read back. Never two engines at once.

When ``clean`` is among the configs it runs last in an engine of its own (no fault
patched in), which also scores every other config's output (`score`: prompt logprobs,
prefill, the clean model): the mean negative log-likelihood per token of the output after
decode step N says how much worse a fault's text is, even where it stays fluent.

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


SWITCHED = "@switched"  # suffix of the clean config run again in the shared engine after every fault
FRESH = "@fresh"  # suffix of a fault config also run in an engine of its own


def _result(config: str, run, *, marker: Path | None, start_s: float, generate_s: float) -> SmokeResult:
    return SmokeResult(
        config=config,
        token_ids=[run.sequence(i).token_id.tolist() for i in range(len(run.sequences))],
        texts=[s.text for s in run.sequences],
        finish_reasons=[s.finish_reason for s in run.sequences],
        marker_events=marker_file.read_events(marker) if marker is not None else [],
        driver_pid=os.getpid(),
        start_s=round(start_s, 2),
        generate_s=round(generate_s, 2),
    )


def _failed(config: str, exc: Exception) -> SmokeResult:
    message = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return SmokeResult(config=config, token_ids=[], texts=[], finish_reasons=[], marker_events=[],
                       driver_pid=os.getpid(), start_s=0.0, generate_s=0.0, error=message)


def run_all(model: str, configs: list[str], *, step: int, max_tokens: int,
            fresh: tuple[str, ...] = ()) -> list[SmokeResult]:
    """The fault configs in one engine, each switched in in turn (`EngineSession(switch_faults=True)`),
    then that engine switched back to clean (config ``clean@switched``); each config in `fresh` once
    more in an engine of its own (``<config>@fresh``); last, when ``clean`` is asked for, a clean
    engine of its own that generates and scores every other config's output."""
    from diffcheck import cases
    from diffcheck.engines import session as sessionmod

    faults = [c for c in configs if c != CLEAN]
    results: list[SmokeResult] = []
    runs: dict[str, object] = {}
    _set_env({})  # only a case's own env selects a fault
    with tempfile.TemporaryDirectory(prefix="diffcheck-faults-") as tmp:
        workdir = Path(tmp)
        names = faults + [f"{c}{FRESH}" for c in fresh if c in faults] + [CLEAN]
        markers = {c: workdir / f"marker-{c.replace(':', '_').replace('@', '_')}.jsonl" for c in names}
        envs: dict[str, dict[str, str]] = {}
        refused: dict[str, Exception] = {}
        for config in names:
            try:
                envs[config] = _fault_env(config.removesuffix(FRESH), step=step, marker=str(markers[config]))
            except Exception as exc:  # a bad name fails here, before an engine starts
                refused[config] = exc
        try:
            suite = cases.load_suite(write_suite(workdir, model, envs, max_tokens=max_tokens))
        except Exception as exc:
            refused.update({c: exc for c in envs})
        case_of = {config: suite.cases[f"c{i}"] for i, config in enumerate(envs)} if len(refused) < len(envs) else {}

        def generate(config: str, engine) -> None:
            """`config`'s case generated on `engine` (a callable that returns the engine for a case)."""
            try:
                if config in refused:
                    raise refused[config]
                t0 = time.monotonic()
                eng = engine(case_of[config.removesuffix(SWITCHED)])
                t1 = time.monotonic()
                run = eng.generate()
                results.append(_result(config, run, marker=markers.get(config), start_s=t1 - t0,
                                       generate_s=time.monotonic() - t1))
                runs[config] = run
            except Exception as exc:  # one broken config must not hide the others' results
                results.append(_failed(config, exc))

        def switched_to_clean(case):
            engine = next(iter(shared.engines.values()))  # the kept engine, its last fault switched off
            engine.switch_fault({})
            engine.case, engine.env = case, {}
            return engine

        with sessionmod.EngineSession(switch_faults=True) as shared:
            for config in faults:
                generate(config, shared.rebound)
            if CLEAN in configs and faults and shared.engines:
                generate(CLEAN + SWITCHED, switched_to_clean)
        with sessionmod.EngineSession() as own:  # an engine of its own per config, one at a time
            for config in [f"{c}{FRESH}" for c in fresh if c in faults]:
                generate(config, own.rebound)
            if CLEAN in configs:
                generate(CLEAN, own.rebound)
                if CLEAN in runs:  # the clean model scores every output after step N
                    try:
                        scorer = own.rebound(case_of[CLEAN])
                        scores = {name: _nll_after_step(scorer.score(run), step=step) for name, run in runs.items()}
                    except Exception as exc:
                        results.append(_failed(CLEAN + ":scoring", exc))
                        scores = {}
                    results = [replace(r, nll_after_step=scores[r.config]) if r.config in scores else r
                               for r in results]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fault_smoke", description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="'clean' or DIFFCHECK_FAULT values")
    parser.add_argument("--out", required=True, type=Path, help="JSON file for the results")
    parser.add_argument("--model", default="smollm2-135m", help="known model id or path (default smollm2-135m)")
    parser.add_argument("--step", type=int, default=16, help="DIFFCHECK_FAULT_STEP (default 16)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--fresh", action="append", default=[],
                        help="also run this fault config in an engine of its own (repeatable)")
    args = parser.parse_args(argv)

    from diffcheck.core.errors import DiffcheckError
    from diffcheck.engines.models import resolve

    try:
        model_path = str(resolve(args.model).path)
    except DiffcheckError as exc:
        print(f"diffcheck: error: {exc}", file=sys.stderr)
        return exc.exit_code
    t0 = time.monotonic()
    results = run_all(model_path, args.configs, step=args.step, max_tokens=args.max_tokens, fresh=tuple(args.fresh))
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
