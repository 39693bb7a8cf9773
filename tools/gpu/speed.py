"""GPU speed table for docs/gpu.md, measured side by side in one process on one H200.

For each engine configuration of a GPU suite (gpu-h200's J: eager, L: FULL decode graph
without torch.compile, O: FULL decode graph with torch.compile; gpu-h200-tp's J1, O1, J3,
O3 at TP1 and TP3), one engine at a time:

- start-up seconds (model load, compile, graph capture), and the graph-capture seconds
  vLLM logs ("Graph capturing finished in N secs"), where it logs them;
- one warm-up generation (Triton JIT and autotuning stay out of the numbers); it is
  also the candidate run the partial replay below plans against;
- then ``--repeats`` rounds, each running every measurement once, so that drift in
  the machine hits all of them alike (side by side):
  - generation of the suite's prompts as diffcheck records it (``engine.generate()``:
    top-20 logprob capture, conversion into a run, the text), timed whole: tokens/s;
    where the engine captures on the device (`diffcheck.engines.capture`), the same
    through vLLM's own logprobs path too (``logprobs20_vllm``), for the comparison;
  - the same prompts through ``LLM.generate`` as vLLM runs them by default (no
    logprobs, vLLM's own detokenizer); their difference is the **capture overhead**
    row (seconds per 1024 tokens, and its share of the time);
  - forced decode replay along the reference golden (J), **full** (every sequence from step 0);
  - forced decode replay along it, **partial** (`diffcheck.engines.replay`:
    nothing for a sequence whose tokens equal J's, the rest from t*, prompt + shared
    prefix prefilled; with prefix caching on, mostly a cache hit): the steps the
    engine produced, their tokens/s, and the forced path's tokens/s;
  - time to verdict of an identical candidate (``time_to_verdict``; bench/bench_engine.py's
    path: generate, partial replay along the engine's own warm-up run as golden, judging
    against a floor of one forced replica, the runs written), against a bare generate
    without logprobs timed right after it.

Every timed generation starts from an empty prefix cache (``LLM.reset_prefix_cache``), as a
fresh engine's first generation does. After round 7 (an H100), where a candidate that is the
reference's own configuration drifted from its own warm-up in every round, partial prefills from
a warm cache were the suspect. Round 8 emptied the cache and the drift stayed in 7 or 8 of 10
rounds: generations under FULL decode graphs are not bit-reproducible there, cache or not
(docs/gpu.md). The reset stays: it is what a fresh engine sees.
``--copies N`` runs the suite's prompts N times in each timed capture-overhead call (more
tokens per call: the calls' own jitter, 10-25 % at 1024 tokens, weighs less).

Best of the rounds is used. tokens/s counts generated tokens over the wall time of
``LLM.generate`` for the whole batch (4 prompts, <= 256 tokens each), prefill included;
with ~150-token prompts the prefill is a small part. Needs the reference's golden
(``diffcheck golden record J --suite gpu-h200``; ``--reference`` picks another). Writes a JSON file (the keys ``logprobs20``, ``no_logprobs``
and ``forced`` keep their meaning: ``forced`` is the full replay) and prints Markdown
tables. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_engine import verdict_timing  # noqa: E402  (the CPU bench's time-to-verdict path)

GRAPH_CAPTURE = re.compile(r"Graph capturing finished in ([0-9.]+) secs")


def graph_capture_seconds(log_path) -> float | None:
    """What vLLM logged for its CUDA graph capture (the last such line of the engine log), or None."""
    try:
        text = Path(log_path).read_text(errors="replace") if log_path else ""
    except OSError:
        return None
    found = GRAPH_CAPTURE.findall(text)
    return float(found[-1]) if found else None


def _entry(tokens: int, seconds: list[float], **extra) -> dict:
    best = min(seconds)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / best if best else None, **extra}


def _fresh(engine) -> None:
    """An empty prefix cache, as in a fresh engine (a no-op where the engine has none to reset)."""
    llm = getattr(engine, "llm", None)
    if llm is not None and hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()


def measure(case, golden, *, repeats: int, copies: int = 1) -> dict:
    from diffcheck.engines import replay
    from diffcheck.engines import session as sessionmod
    from diffcheck import workspace

    with sessionmod.open_engine(case) as engine:
        row = {"case": case.id, "description": case.description, "startup_s": engine.timings["startup_s"],
               "graph_capture_s": graph_capture_seconds(getattr(engine, "log_path", None)),
               "effective": engine.info().get("effective", {}), "forcing_mechanism": engine.mechanism}
        row["logprob_capture"] = engine.capture
        own = engine.generate()  # warm-up (a fresh engine: an empty cache), and the run the partial replay plans against
        full = replay.plan(golden, own, "full")
        partial = replay.plan(golden, own, "partial")
        sides = ("logprobs20", "logprobs20_vllm", "no_logprobs", "forced", "forced_partial", "verdict", "bare")
        times: dict[str, list[float]] = {k: [] for k in sides}
        tokens: dict[str, int] = {}
        from diffcheck.judging.floor import build_floor

        pool = sessionmod.EngineSession()
        pool.engines["config:" + sessionmod.config_key(case)] = engine  # the open engine, as compare keeps it
        floor = build_floor(own, {"replica": engine.force(own)})
        verdicts, same = [], []
        suite_prompts = list(engine.prompts)
        row["copies"] = copies
        for _ in range(repeats):
            engine.prompts = suite_prompts * copies
            try:
                _fresh(engine)
                t0 = time.perf_counter()
                recorded = engine.generate()
                times["logprobs20"].append(time.perf_counter() - t0)
                tokens["logprobs20"] = recorded.n_tokens
                if engine.capture == "device":
                    engine.capture = "vllm"
                    try:
                        _fresh(engine)
                        t0 = time.perf_counter()
                        through_vllm = engine.generate()
                        times["logprobs20_vllm"].append(time.perf_counter() - t0)
                        same.append(_same_steps(recorded, through_vllm))
                    finally:
                        engine.capture = "device"
                _fresh(engine)
                plain = engine.time_generate(logprobs=False)
                times["no_logprobs"].append(plain.seconds)
                tokens["no_logprobs"] = plain.n_tokens
            finally:
                engine.prompts = suite_prompts
            engine.force(golden, starts=full.starts)
            times["forced"].append(engine.timings["force_s"])
            if partial.replayed:
                engine.force(golden, starts=partial.starts)
                times["forced_partial"].append(engine.timings["force_s"])
            else:
                times["forced_partial"].append(0.0)
            _fresh(engine)
            with tempfile.TemporaryDirectory() as tmp:
                timing, name = verdict_timing(case, engine, pool, own, floor, Path(tmp))
            times["verdict"].append(timing.wall_s)
            verdicts.append(name)
            _fresh(engine)
            t0 = time.perf_counter()
            engine.time_generate(logprobs=False)
            times["bare"].append(time.perf_counter() - t0)
    row["logprobs20"] = _entry(tokens["logprobs20"], times["logprobs20"])
    row["no_logprobs"] = _entry(tokens["no_logprobs"], times["no_logprobs"])
    lp, nolp = min(times["logprobs20"]), min(times["no_logprobs"])
    row["capture_overhead"] = {"seconds": lp - nolp, "per_1024_tokens_s": (lp - nolp) * 1024 / tokens["logprobs20"],
                               "fraction_of_time": (lp - nolp) / lp if lp else None}
    if times["logprobs20_vllm"]:
        row["logprobs20_vllm"] = _entry(tokens["logprobs20"], times["logprobs20_vllm"], same_steps_as_device=same)
        vl = min(times["logprobs20_vllm"])
        row["capture_overhead_vllm"] = {"seconds": vl - nolp, "fraction_of_time": (vl - nolp) / vl if vl else None}
    row["time_to_verdict"] = {"verdict_s": times["verdict"], "bare_generate_s": times["bare"], "verdicts": verdicts,
                              "ratio_of_medians": statistics.median(times["verdict"]) / statistics.median(times["bare"])}
    row["forced"] = _entry(full.replay_steps, times["forced"], replay="full")
    best_partial = min(times["forced_partial"])
    row["forced_partial"] = _entry(partial.replay_steps, times["forced_partial"], replay="partial",
                                   path_steps=golden.n_tokens,
                                   path_tokens_per_s=golden.n_tokens / best_partial if best_partial else None,
                                   replayed=list(partial.replayed), reused=list(partial.reused),
                                   starts=list(partial.starts))
    return row


def _same_steps(a, b) -> bool:
    """Whether two runs hold the same tokens and logprobs, bit for bit."""
    import numpy as np

    return all(np.array_equal(getattr(a.steps, f), getattr(b.steps, f), equal_nan=True)
               for f in ("seq", "step", "token_id", "logprob", "topk_ids", "topk_logprobs"))


def _f(value, fmt="{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def main() -> int:
    from diffcheck import cases
    from diffcheck.engines import session as sessionmod
    from diffcheck import workspace

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="gpu-h200")
    parser.add_argument("--cases", default="J,L,O", help="comma-separated case ids, measured in this order")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds of every measurement (best is used)")
    parser.add_argument("--reference", default=None,
                        help="the golden that forced replay follows (default: the suite's first reference, J)")
    parser.add_argument("--copies", type=int, default=1,
                        help="the suite's prompts this many times in each timed capture-overhead call")
    parser.add_argument("--out", type=Path, default=None, help="default: goldens/SUITE/speed.json")
    args = parser.parse_args()

    suite = cases.load_suite(args.suite)
    reference = args.reference or next(cid for cid, c in suite.cases.items() if c.role == "reference")
    args.out = args.out or Path("goldens") / suite.name / "speed.json"
    golden = workspace.load_golden(workspace.goldens_root(), suite.name, reference)
    rows = []
    for cid in args.cases.split(","):
        rows.append(measure(cases.get_case(suite, cid), golden, repeats=args.repeats, copies=args.copies))
        print(json.dumps({k: rows[-1].get(k) for k in ("case", "startup_s", "graph_capture_s", "logprob_capture",
                                                       "logprobs20", "logprobs20_vllm", "no_logprobs", "capture_overhead",
                                                       "capture_overhead_vllm", "time_to_verdict", "forced",
                                                       "forced_partial")}), flush=True)
        # written after every engine, so a call stopped at its time limit keeps what was measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"suite": suite.name, "repeats": args.repeats, "copies": args.copies, "rows": rows},
                                        indent=2) + "\n")

    base = rows[0]["logprobs20"]["tokens_per_s"]
    print("| case | engine | start-up s | graph capture s | tokens/s (top-20 logprobs) | vs first row "
          "| tokens/s (no logprobs) | capture overhead | forced full tokens/s | replay / generate time "
          "| capture | tokens/s, vLLM's logprobs path | time to verdict / bare generate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        eff = r["effective"]
        engine = f"{eff.get('attention_backend')}, cudagraph {eff.get('cudagraph_mode')}, compile {eff.get('compile_mode')}"
        lp, nolp, forced = r["logprobs20"]["tokens_per_s"], r["no_logprobs"]["tokens_per_s"], r["forced"]["tokens_per_s"]
        cap = r["capture_overhead"]
        print(f"| {r['case']} | {engine} | {r['startup_s']:.1f} | {_f(r['graph_capture_s'], '{:.1f}')} | {lp:.0f} "
              f"| {lp / base:.2f}x | {nolp:.0f} | {cap['per_1024_tokens_s']:+.2f} s per 1024 tokens "
              f"({_f(cap['fraction_of_time'], '{:+.0%}')}) | {forced:.0f} | {lp / forced:.2f}x "
              f"| {r['logprob_capture']} | {_f(r.get('logprobs20_vllm', {}).get('tokens_per_s'))} "
              f"| {r['time_to_verdict']['ratio_of_medians']:.2f}x |")
    print()
    print("| case | forced full: steps, s, tokens/s | forced partial: steps replayed (sequences), s, tokens/s "
          "| forced path tokens/s, full / partial | partial speed-up |")
    print("|---|---|---|---|---|")
    for r in rows:
        full, part = r["forced"], r["forced_partial"]
        full_s, part_s = min(full["seconds"]), min(part["seconds"])
        print(f"| {r['case']} | {full['tokens']}, {full_s:.2f}, {_f(full['tokens_per_s'])} "
              f"| {part['tokens']} ({len(part['replayed'])} of {len(part['starts'])}), {part_s:.2f}, "
              f"{_f(part['tokens_per_s'])} | {_f(full['tokens_per_s'])} / {_f(part['path_tokens_per_s'])} "
              f"| {_f(full_s / part_s if part_s else None, '{:.2f}x')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
