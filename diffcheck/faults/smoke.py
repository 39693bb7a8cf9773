"""Smoke runs of the faults on a real vLLM engine: one engine per config, one after another.

``python -m diffcheck.faults.smoke --out results.json clean stale-decode-metadata ...``

For each config (``clean`` or a DIFFCHECK_FAULT value) it sets the DIFFCHECK_FAULT*
variables in this process's environment (vLLM spawns its engine core and worker
from it, so they are set before those processes exist), builds ``vllm.LLM``, runs the
smoke prompts greedily, reads back the fault's marker file and shuts the engine down
before the next config starts: never two engines at once.

When ``clean`` is among the configs it runs last, and its engine also scores every
other config's output with prompt logprobs (prefill, the clean model): the mean
negative log-likelihood per token of the output after decode step N says how much
worse a fault's text is, even where it stays fluent.

Used by tests/test_faults_engine.py; knows nothing about goldens or verdicts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from diffcheck.faults.spec import ENV_FAULT, ENV_MARKER, ENV_OPTIONS, ENV_STEP, parse_env

CLEAN = "clean"
SMOKE_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",  # ends at EOS before 48 tokens: the batch shrinks mid-run
)
# Engine settings known to work on the 2-core CPU lane (vllm-facts.md); the 1 GiB KV
# cache (VLLM_CPU_KVCACHE_SPACE) instead of vLLM's memory fraction: the machine is shared.
ENGINE_KWARGS = dict(dtype="float32", enforce_eager=True, max_model_len=2048, seed=0)
KV_CACHE_GIB = "1"


@dataclass(frozen=True)
class SmokeResult:
    config: str
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    marker_events: list[dict]
    driver_pid: int
    start_s: float  # LLM() construction
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
    return env


def _set_env(env: dict[str, str]) -> None:
    for key in (ENV_FAULT,) + ENV_OPTIONS:
        os.environ.pop(key, None)
    os.environ.update(env)


def _chat_prompts(llm) -> list[str]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in SMOKE_PROMPTS
    ]


def _shutdown(llm) -> None:
    # Explicit: waiting for the garbage collector could leave two engines alive at once.
    llm.llm_engine.engine_core.shutdown()


def _score(llm, prompt_ids: list[list[int]], outputs: list[list[int]], *, step: int) -> list[float | None]:
    """Mean NLL (nats/token, clean model) of output tokens with index > step; None if there are none."""
    from vllm import SamplingParams

    requests, spans = [], []
    for prompt, output in zip(prompt_ids, outputs):
        tail = output[step + 1 :]
        spans.append((len(prompt) + step + 1, len(tail)))
        requests.append({"prompt_token_ids": list(prompt) + list(output)})
    scored = llm.generate(requests, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    means: list[float | None] = []
    for result, (start, count) in zip(scored, spans):
        if count == 0:
            means.append(None)
            continue
        ids = result.prompt_token_ids
        nll = [-result.prompt_logprobs[i][ids[i]].logprob for i in range(start, start + count)]
        means.append(sum(nll) / count)
    return means


@dataclass(frozen=True)
class _EngineRun:
    result: SmokeResult
    scores: dict[str, list[float | None]]  # other config -> its nll_after_step under this engine


def run_config(model: str, config: str, *, step: int, max_tokens: int, workdir: Path,
               score: dict[str, list[list[int]]] | None = None) -> _EngineRun:
    """One engine for `config`; if `score` is given, this engine also scores those outputs."""
    from vllm import LLM, SamplingParams

    from diffcheck.faults import validate_env

    marker = workdir / f"marker-{config.replace(':', '_')}.jsonl"
    env = _fault_env(config, step=step, marker=str(marker))
    validate_env(env)  # a bad name fails here, before an engine starts
    _set_env(env)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    try:
        t0 = time.monotonic()
        llm = LLM(model=model, **ENGINE_KWARGS)
        try:
            t1 = time.monotonic()
            prompts = _chat_prompts(llm)
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
            t2 = time.monotonic()
            token_ids = [list(o.outputs[0].token_ids) for o in outs]
            prompt_ids = [list(o.prompt_token_ids) for o in outs]
            scores = {name: _score(llm, prompt_ids, ids, step=step) for name, ids in (score or {}).items()}
            own_nll = _score(llm, prompt_ids, token_ids, step=step) if score else []
        finally:
            _shutdown(llm)
            del llm
            gc.collect()
    finally:
        _set_env({})
    events = [json.loads(line) for line in marker.read_text().splitlines()] if marker.exists() else []
    result = SmokeResult(
        config=config,
        token_ids=token_ids,
        texts=[o.outputs[0].text for o in outs],
        finish_reasons=[str(o.outputs[0].finish_reason) for o in outs],
        marker_events=events,
        driver_pid=os.getpid(),
        start_s=round(t1 - t0, 2),
        generate_s=round(t2 - t1, 2),
        nll_after_step=own_nll,
    )
    return _EngineRun(result=result, scores=scores)


def run_all(model: str, configs: list[str], *, step: int, max_tokens: int) -> list[SmokeResult]:
    """Each config in its own engine, sequentially; `clean` last so it can score the others."""
    ordered = [c for c in configs if c != CLEAN] + [c for c in configs if c == CLEAN]
    results: list[SmokeResult] = []
    with tempfile.TemporaryDirectory(prefix="diffcheck-faults-") as tmp:
        for config in ordered:
            score = {r.config: r.token_ids for r in results if r.error is None} if config == CLEAN else None
            try:
                run = run_config(model, config, step=step, max_tokens=max_tokens, workdir=Path(tmp), score=score)
                results = [replace(r, nll_after_step=run.scores[r.config]) if r.config in run.scores else r
                           for r in results]
                results.append(run.result)
            except Exception as exc:  # one broken config must not hide the others' results
                message = f"{type(exc).__name__}: {exc}".splitlines()[0]
                results.append(SmokeResult(config=config, token_ids=[], texts=[], finish_reasons=[],
                                           marker_events=[], driver_pid=os.getpid(), start_s=0.0,
                                           generate_s=0.0, error=message))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffcheck.faults.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="'clean' or DIFFCHECK_FAULT values")
    parser.add_argument("--out", required=True, type=Path, help="JSON file for the results")
    parser.add_argument("--model", default="smollm2-135m", help="known model id or path (default smollm2-135m)")
    parser.add_argument("--step", type=int, default=16, help="DIFFCHECK_FAULT_STEP (default 16)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    from diffcheck.errors import DiffcheckError
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
