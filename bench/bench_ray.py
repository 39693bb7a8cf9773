"""What Ray adds per case of `diffcheck matrix --ray`, on this machine (no engine).

Measures, on a local loopback cluster started the way the matrix starts it
(`diffcheck.workflows.matrix_ray.connect`): the cluster start, the first task (a
worker process starts), the round trip of a task once a worker is warm, and the
transfer of a run the size of a 4 x 1024-token golden with top-20 logprobs (what a
candidate task receives and returns) through the object store. Run it alone:
``.venv/bin/python bench/bench_ray.py``; `make bench` runs it with the others.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np


def _run(n_seq: int = 4, n_tokens: int = 1024, k: int = 20):
    from diffcheck.core.types import Run, RunMeta, SequenceInfo, Steps

    n = n_seq * n_tokens
    rng = np.random.default_rng(0)
    steps = Steps(seq=np.repeat(np.arange(n_seq, dtype=np.int32), n_tokens),
                  step=np.tile(np.arange(n_tokens, dtype=np.int32), n_seq),
                  token_id=rng.integers(0, 150_000, n).astype(np.int32),
                  logprob=-rng.random(n).astype(np.float32),
                  topk_ids=rng.integers(0, 150_000, (n, k)).astype(np.int32),
                  topk_logprobs=-np.sort(rng.random((n, k)).astype(np.float32), axis=1))
    seqs = tuple(SequenceInfo(prompt_id=f"p{i}", prompt_token_ids=tuple(range(200)), text="x" * 4000,
                              finish_reason="length", n_tokens=n_tokens) for i in range(n_seq))
    return Run(meta=RunMeta(suite="bench", case_id="X", role="candidate"), sequences=seqs, steps=steps)


def _echo(run):
    return run


def _noop():
    return 1


def main() -> dict:
    from diffcheck.workflows import matrix_ray

    t0 = time.perf_counter()
    ray = matrix_ray.connect("local", num_cpus=2)
    start_s = time.perf_counter() - t0
    noop = ray.remote(_noop)
    t0 = time.perf_counter()
    ray.get(noop.remote())
    first_s = time.perf_counter() - t0
    trips = []
    for _ in range(30):
        t0 = time.perf_counter()
        ray.get(noop.remote())
        trips.append(time.perf_counter() - t0)
    run = _run()
    echo = ray.remote(_echo)
    ray.get(echo.remote(_run(1, 8)))  # warm
    moves = []
    for _ in range(5):
        t0 = time.perf_counter()
        back = ray.get(echo.remote(run))
        moves.append(time.perf_counter() - t0)
    assert back.n_tokens == run.n_tokens
    ray.shutdown()
    size_mb = sum(a.nbytes for a in (run.steps.seq, run.steps.step, run.steps.token_id, run.steps.logprob,
                                     run.steps.topk_ids, run.steps.topk_logprobs)) / 2**20
    return {
        "ray_version": ray.__version__,
        "cluster_start_s": round(start_s, 2),
        "first_task_s": round(first_s, 3),
        "warm_task_round_trip_ms": round(1000 * statistics.median(trips), 2),
        "run_mb": round(size_mb, 2),
        "run_there_and_back_s": round(statistics.median(moves), 3),
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
