"""Where logprob capture's time goes: vLLM's torch profiler around a generation with and without logprobs.

The GPU speed table shows that top-20 logprob capture costs a FULL-graph engine about a
quarter of its decode time (docs/gpu.md), and that vLLM's front end is not where it goes.
This opens one engine for a case (default: gpu-h200's O) with vLLM's own profiler on
(``profiler_config``: the torch profiler in every worker), warms it up, then profiles two
generations of the suite's prompts back to back:

- ``logprobs20``: ``engine.generate()``, as diffcheck records a run;
- ``no_logprobs``: the same prompts through ``LLM.generate`` with no logprobs.

For each it writes vLLM's trace files and tables into OUT/traces/, and sums the time of
every traced CPU op and GPU kernel by name. The JSON (OUT/profile.json) and the printed
table give the wall time of each side and the names whose time grew most with logprobs:
what is left of the capture's cost inside the worker (sampler, device-to-host copies,
conversion to lists). Wall-time growth that the worker's ops do not explain is outside
the worker (the engine core's scheduler and output serialization). Not a test.

    python tools/gpu/profile_capture.py --suite gpu-h200 --case O
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import time
from collections import Counter
from pathlib import Path


def op_times(trace_files: list[Path]) -> dict[str, Counter]:
    """{"cpu": name -> µs, "gpu": name -> µs} summed over complete events of chrome traces."""
    sums = {"cpu": Counter(), "gpu": Counter()}
    for path in trace_files:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        for e in events:
            if e.get("ph") != "X" or "dur" not in e:
                continue
            cat = str(e.get("cat", ""))
            side = "gpu" if cat in ("kernel", "gpu_memcpy", "gpu_memset") else "cpu" if cat in ("cpu_op", "python_function") else None
            if side:
                sums[side][str(e.get("name"))] += float(e["dur"])
    return sums


def _profiled(engine, traces: Path, label: str, run) -> dict:
    before = set(traces.rglob("*"))
    engine.llm.start_profile(profile_prefix=label)
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    engine.llm.stop_profile()
    deadline = time.monotonic() + 120  # the workers write their traces after stop
    new: list[Path] = []
    while time.monotonic() < deadline:
        new = sorted(p for p in set(traces.rglob("*")) - before if p.is_file())
        if any(".json" in p.name for p in new):
            time.sleep(2)  # let every worker finish writing
            new = sorted(p for p in set(traces.rglob("*")) - before if p.is_file())
            break
        time.sleep(1)
    files = [p for p in new if ".json" in p.name]
    if not files:
        raise SystemExit(f"profile_capture: vLLM wrote no trace for {label} into {traces}")
    return {"seconds": seconds, "files": [str(p) for p in new], "ops": op_times(files)}


def main() -> int:
    from diffcheck import cases
    from diffcheck.engines import session as sessionmod

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="gpu-h200")
    parser.add_argument("--case", default="O")
    parser.add_argument("--top", type=int, default=25, help="rows of the table")
    parser.add_argument("--out", type=Path, default=None, help="default: goldens/SUITE/profile-capture")
    args = parser.parse_args()

    suite = cases.load_suite(args.suite)
    case = cases.get_case(suite, args.case)
    out = (args.out or Path("goldens") / suite.name / "profile-capture").resolve()
    traces = out / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    profiler = {"profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_with_stack": False}
    engine_cfg = dataclasses.replace(case.engine, extra={**case.engine.extra, "profiler_config": profiler})
    case = dataclasses.replace(case, engine=engine_cfg)

    with sessionmod.open_engine(case) as engine:
        engine.generate()  # warm-up: JIT, autotuning and first-call costs stay out of the traces
        engine.time_generate(logprobs=False)
        sides = {"logprobs20": _profiled(engine, traces, "logprobs20", engine.generate),
                 "no_logprobs": _profiled(engine, traces, "no_logprobs",
                                          lambda: engine.time_generate(logprobs=False))}
        info = engine.info()

    rows = []
    for side in ("cpu", "gpu"):
        with_lp, without = sides["logprobs20"]["ops"][side], sides["no_logprobs"]["ops"][side]
        for name in set(with_lp) | set(without):
            rows.append({"side": side, "name": name, "logprobs20_us": with_lp[name], "no_logprobs_us": without[name],
                         "growth_us": with_lp[name] - without[name]})
    rows.sort(key=lambda r: -r["growth_us"])
    wall = {k: v["seconds"] for k, v in sides.items()}
    result = {"suite": suite.name, "case": args.case, "effective": info.get("effective", {}),
              "wall_s": wall, "files": {k: v["files"] for k, v in sides.items()}, "growth": rows[:200]}
    (out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")

    print(f"wall: {wall['logprobs20']:.3f} s with top-20 logprobs, {wall['no_logprobs']:.3f} s without "
          f"(+{wall['logprobs20'] - wall['no_logprobs']:.3f} s)")
    print("| side | name | with logprobs, ms | without, ms | growth, ms |")
    print("|---|---|---|---|---|")
    for r in rows[: args.top]:
        print(f"| {r['side']} | {r['name'][:80]} | {r['logprobs20_us'] / 1e3:.1f} | {r['no_logprobs_us'] / 1e3:.1f} "
              f"| {r['growth_us'] / 1e3:+.1f} |")
    print(f"wrote {out / 'profile.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
