"""GPU speed table for docs/gpu.md, measured side by side in one process on one H200.

For each engine configuration of the gpu-h200 suite (J: eager, L: FULL decode graph
without torch.compile, O: FULL decode graph with torch.compile), one engine at a time:

- start-up seconds (model load, compile, graph capture);
- generation of the suite's prompts with top-20 logprob capture, after one warm-up
  generation (Triton JIT and autotuning stay out of the number): tokens/s;
- the same generation without logprobs: the capture overhead;
- forced decode replay along golden J: the replay overhead against plain generation.

tokens/s counts generated tokens over the wall time of ``LLM.generate`` for the whole
batch (4 prompts, <= 256 tokens each), prefill included; with ~150-token prompts the
prefill is a small part. Needs golden J (``diffcheck golden record J --suite gpu-h200``).
Writes a JSON file and prints a Markdown table. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def measure(case, golden, *, repeats: int) -> dict:
    from diffcheck.pipeline import runner

    with runner.open_engine(case) as engine:
        row = {"case": case.id, "description": case.description, "startup_s": engine.timings["startup_s"],
               "effective": engine.info().get("effective", {}), "forcing_mechanism": engine.mechanism}
        engine.generate()  # warm-up
        for label, logprobs in (("logprobs20", True), ("no_logprobs", False)):
            times, tokens = [], 0
            for _ in range(repeats):
                timed = engine.time_generate(logprobs=logprobs)
                times.append(timed.seconds)
                tokens = timed.n_tokens
            best = min(times)
            row[label] = {"tokens": tokens, "seconds": times, "tokens_per_s": tokens / best}
        forced_times = []
        for _ in range(repeats):
            engine.force(golden)
            forced_times.append(engine.timings["force_s"])
        row["forced"] = {"tokens": golden.n_tokens, "seconds": forced_times,
                         "tokens_per_s": golden.n_tokens / min(forced_times)}
    return row


def main() -> int:
    from diffcheck import cases
    from diffcheck.pipeline import runner

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="gpu-h200")
    parser.add_argument("--cases", default="J,L,O", help="comma-separated case ids, measured in this order")
    parser.add_argument("--repeats", type=int, default=2, help="timed repetitions of each measurement (best is used)")
    parser.add_argument("--out", type=Path, default=Path("goldens/gpu-h200/speed.json"))
    args = parser.parse_args()

    suite = cases.load_suite(args.suite)
    golden = runner.load_golden(runner.goldens_root(), suite.name, "J")
    rows = []
    for cid in args.cases.split(","):
        rows.append(measure(cases.get_case(suite, cid), golden, repeats=args.repeats))
        print(json.dumps({k: rows[-1][k] for k in ("case", "startup_s", "logprobs20", "no_logprobs", "forced")}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"suite": suite.name, "rows": rows}, indent=2) + "\n")

    base = rows[0]["logprobs20"]["tokens_per_s"]
    print("| case | engine | start-up s | tokens/s (top-20 logprobs) | vs first row | tokens/s (no logprobs) "
          "| capture overhead | forced replay tokens/s | replay / generate time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        eff = r["effective"]
        engine = f"{eff.get('attention_backend')}, cudagraph {eff.get('cudagraph_mode')}, compile {eff.get('compile_mode')}"
        lp, nolp, forced = r["logprobs20"]["tokens_per_s"], r["no_logprobs"]["tokens_per_s"], r["forced"]["tokens_per_s"]
        print(f"| {r['case']} | {engine} | {r['startup_s']:.1f} | {lp:.0f} | {lp / base:.2f}x | {nolp:.0f} "
              f"| {nolp / lp - 1:+.0%} | {forced:.0f} | {lp / forced:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
