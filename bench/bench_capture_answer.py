"""The host-side cost of the device capture's answer: what a generate pays after the last step.

The device capture (`diffcheck.engines.capture`) keeps every step's top-k on the device; after the
generation, `CaptureWorker.diffcheck_capture_collect` moves it to the host in the engine's process,
vLLM's utility RPC carries it to the caller (msgpack, `vllm.v1.serial_utils`) and `steps_for`
matches its rows to the outputs. None of it overlaps the decode, so on a small model under a FULL
CUDA graph it shows in the capture's overhead. This benchmark runs that code on synthetic captured
rows (16 sequences x 256 steps, top-20, SmolLM2's vocabulary size; torch on the CPU) and reports
milliseconds per 1024 tokens for each part, medians over rounds.

``--against FILE`` runs an older ``capture.py`` side by side, interleaved round by round, e.g.
the one that answered in Python lists::

    git show 3f4da9f:diffcheck/engines/capture.py > /tmp/capture_lists.py
    .venv/bin/python bench/bench_capture_answer.py --against /tmp/capture_lists.py

Run: ``.venv/bin/python bench/bench_capture_answer.py [--rounds N] [--against FILE]`` (seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQUENCES, STEPS, K, VOCAB = 16, 256, 20, 49152
PARTS = ("collect", "rpc_codec", "match")


def _load(path: str):
    spec = importlib.util.spec_from_file_location(f"capture_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case(seed: int = 0):
    """Prompts, outputs and the captured rows as a run's chunks hold them (rows in step order)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    prompts = [[100 + s, 7, 8] for s in range(SEQUENCES)]
    outputs = torch.randint(0, VOCAB, (SEQUENCES, STEPS), generator=gen)
    rows = SEQUENCES * STEPS
    sampled = outputs.t().reshape(rows, 1)  # step-major, as the sampler sees them
    done = [(sampled, torch.randn(rows, 1, generator=gen), torch.randn(rows, K, generator=gen),
             torch.randint(0, VOCAB, (rows, K), generator=gen))]
    req_rows = [f"r{s}" for _ in range(STEPS) for s in range(SEQUENCES)]
    return prompts, outputs.tolist(), done, req_rows


def _once(module, case, codec) -> tuple[dict[str, float], list[dict]]:
    from diffcheck.engines.taps import prompt_key

    prompts, outputs, done, req_rows = case
    worker = module.CaptureWorker.__new__(module.CaptureWorker)
    state = module._Chunks(K, 1 << 30)
    state.prompts = {f"r{s}": prompt_key(p) for s, p in enumerate(prompts)}
    state.done, state.req_rows = list(done), list(req_rows)
    worker._diffcheck_capture = state
    worker.model_runner = type("Runner", (), {})()
    encoder, decoder = codec
    t0 = time.perf_counter()
    answer = worker.diffcheck_capture_collect()
    t1 = time.perf_counter()
    answer = decoder.decode(encoder.encode(answer))
    t2 = time.perf_counter()
    parts = module.steps_for(answer, prompts, outputs, K, case_id="bench")
    t3 = time.perf_counter()
    return {"collect": t1 - t0, "rpc_codec": t2 - t1, "match": t3 - t2}, parts


def main(rounds: int = 15, against: str | None = None) -> dict:
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from diffcheck.engines import capture

    codec = (MsgpackEncoder(), MsgpackDecoder())
    modules = {"current": capture}
    if against:
        modules["against"] = _load(against)
    case = _case()
    first = {name: _once(m, case, codec)[1] for name, m in modules.items()}  # warm-up, and the same arrays?
    same = all(np.array_equal(np.asarray(a[key]), np.asarray(b[key]))
               for a, b in zip(first["current"], first["against"]) for key in a) if against else None
    seconds = {name: {part: [] for part in PARTS} for name in modules}
    for _ in range(rounds):
        for name, module in modules.items():
            timed, _parts = _once(module, case, codec)
            for part in PARTS:
                seconds[name][part].append(timed[part])
    tokens = SEQUENCES * STEPS
    ms = {name: {part: round(statistics.median(v) * 1e3 * 1024 / tokens, 3) for part, v in parts.items()}
          for name, parts in seconds.items()}
    for m in ms.values():
        m["total"] = round(sum(m[p] for p in PARTS), 3)
    result = {"tokens": tokens, "k": K, "rounds": rounds, "ms_per_1024_tokens": ms, "same_arrays": same}
    if against:
        result["against"] = against
        result["against_over_current"] = round(ms["against"]["total"] / ms["current"]["total"], 2)
    for name, m in ms.items():
        print(f"{name}: per 1024 tokens " + ", ".join(f"{p} {m[p]:.2f} ms" for p in (*PARTS, "total")), flush=True)
    if against:
        print(f"same arrays: {same}; against / current: {result['against_over_current']}x", flush=True)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--against", help="an older diffcheck/engines/capture.py, run side by side")
    args = parser.parse_args()
    main(args.rounds, args.against)
