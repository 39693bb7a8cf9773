"""Start-up and throughput of each engine kind, and how far vLLM and transformers lie apart in memory.

Setup: the default suite's first two design-doc prompts (~200 prompt tokens each),
64 tokens each with EOS ignored, temperature 0.7 / top-p 0.95 / top-k 20, seed 1234,
top-20 logprobs; SmolLM2-135M in fp32, eager; 1 GiB KV cache. The kinds run one after
another, each opened through `diffcheck.engines.session.open_engine` and closed before
the next starts:

- ``vllm``: vLLM offline (``vllm.LLM``) in this process;
- ``openai``: a ``vllm serve`` diffcheck starts on loopback (start-up = until /health
  answers and the model list is read);
- ``hf``: transformers, eager, one sequence at a time.

Per kind: start-up seconds (``engine.timings["startup_s"]``), generation tokens/s
(both prompts, 128 tokens), forced replay tokens/s (along the vLLM run) and scoring
seconds (of the vLLM run). Then, in memory (before the store's 6-bit logprob
quantization): the largest |Δ logprob| of the forced token and of the top-20 between
HF teacher-forced along the vLLM run and that run, and the share of steps whose top-20
ids agree.

Run: ``.venv/bin/python bench/bench_engine_kinds.py`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = """
[suite]
name = "kinds"
description = "engine kinds benchmark"

[defaults]
model = "smollm2-135m"
prompts = "prompts.toml"
sampling = {{ max_tokens = 64, ignore_eos = true, temperature = 0.7, top_p = 0.95, top_k = 20, seed = 1234, logprobs = 20 }}
engine = {{ dtype = "float32", enforce_eager = true, max_model_len = 1024, kv_cache_memory_gib = 1, enable_prefix_caching = false }}

[cases.vllm]
role = "reference"

[cases.openai]
role = "reference"
engine = {{ kind = "openai" }}

[cases.hf]
role = "reference"
engine = {{ kind = "hf" }}
"""


def _prompts() -> str:
    import tomllib

    data = tomllib.loads((ROOT / "cases" / "prompts" / "design-docs-en.toml").read_text())
    out = []
    for p in data["prompt"][:2]:
        lines = [f"[[prompt]]", f"id = {json.dumps(p['id'])}", f"text = {json.dumps(p['text'])}"]
        if "system" in p:
            lines.append(f"system = {json.dumps(p['system'])}")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def main() -> dict:
    import numpy as np

    from diffcheck import cases
    from diffcheck.engines import session as sessionmod

    folder = Path(tempfile.mkdtemp(prefix="bench-kinds-"))
    (folder / "prompts.toml").write_text(_prompts())
    (folder / "kinds.toml").write_text(SUITE.format())
    suite = cases.load_suite(folder / "kinds.toml")
    results: dict[str, dict] = {}
    reference = None
    hf_forced = None
    for kind in ("vllm", "openai", "hf"):
        with sessionmod.open_engine(suite.cases[kind]) as engine:
            run = engine.generate()
            target = reference if reference is not None else run
            forced = engine.force(target)
            engine.score(target)
            t = engine.timings
            results[kind] = {
                "startup_s": round(t["startup_s"], 1),
                "generate_tokens": run.n_tokens,
                "generate_tokens_per_s": round(run.n_tokens / t["generate_s"], 1),
                "force_tokens_per_s": round(forced.n_tokens / t["force_s"], 1),
                "score_s": round(t["score_s"], 2),
            }
            print(kind, results[kind], flush=True)
        if kind == "vllm":
            reference = run
        if kind == "hf":
            hf_forced = forced
    ref, hf = reference.steps, hf_forced.steps
    results["hf_vs_vllm_in_memory"] = {
        "steps": int(len(ref)),
        "max_abs_dlogprob": float(np.abs(hf.logprob - ref.logprob).max()),
        "max_abs_dtopk_logprob": float(np.abs(hf.topk_logprobs - ref.topk_logprobs).max()),
        "same_topk_ids": float((hf.topk_ids == ref.topk_ids).all(axis=1).mean()),
    }
    print(results["hf_vs_vllm_in_memory"], flush=True)
    return results


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
    sys.exit(0)
