"""Forced replay, full against partial, side by side in one engine, and the verdicts of both.

For each candidate of the default suite named (default O, E, M, D), one engine with the
case's own configuration (``sessionmod.open_engine``):

1. generate the suite's prompts (the tokens must equal the stored candidate run
   ``goldens/default/X.run.parquet``'s, whose forced run along J was a full replay);
2. teacher-force along golden J, interleaved ``rounds`` times: **full** (every sequence
   from step 0, as before) and **partial** (`diffcheck.engines.replay`: nothing for a
   sequence that kept J's tokens, the rest from t* with the shared prefix prefilled);
   the engine call alone is timed;
3. judge four ways with `compare_runs` against golden J and J's floor (`load_floor`):
   the stored run with its stored full forced run; this run with its full replay; this
   run with its partial replay; each run passing through the golden store's codec first,
   as a compare does. The stored scored run (X.scored-J.parquet) is used when this run's
   tokens equal the stored run's (scoring depends on the tokens only). The per-sequence
   (verdict, t*, onset) of the three must agree.

E and M carry faults that count decode steps; `replay.mode_for` gives them full replays in
`diffcheck compare`. They are forced partially here anyway, to show what a partial replay
would do to them.

Rates: ``path tokens/s`` = the forced path's steps (the golden's tokens) per second of
engine time; ``replayed tokens/s`` = the steps the engine itself produced per second.

Also: the forcing processor's ``apply`` against the per-row loop it replaced (CPU
tensors of SmolLM2's vocabulary; per call).

Run: ``.venv/bin/python bench/bench_replay.py [CASES] [ROUNDS]`` (about 3 minutes per case
on 2 shared cores at 2 rounds). Needs the default suite's goldens, floor and stored
candidate runs (``make golden``, ``diffcheck run X --replay full``).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CASES = ("O", "E", "M", "D")
SUITE = "default"
REFERENCE = "J"


def _codec(run, folder: Path, name: str):
    """The run as a compare sees it: written by the golden store and read back."""
    from diffcheck.storage import store

    path = folder / f"{name}.parquet"
    store.write_run(path, run)
    return store.read_run(path)


def _key(verdict) -> list[tuple]:
    return [(s.verdict.name, s.t_star, s.onset) for s in verdict.sequences]


def bench_case(suite, cid: str, *, root: Path, golden, floor, rounds: int) -> dict:
    from diffcheck import cases
    from diffcheck.judging import classify
    from diffcheck.engines import replay
    from diffcheck.engines import session as sessionmod
    from diffcheck import workspace
    from diffcheck.storage import store

    case = cases.get_case(suite, cid)
    stored = store.read_run(store.run_path(root, SUITE, cid, role="candidate"))
    stored_forced = store.read_run(store.run_path(root, SUITE, cid, kind="forced", reference=REFERENCE))
    scored_path = store.run_path(root, SUITE, cid, kind="scored", reference=REFERENCE)
    scored = store.read_run(scored_path) if scored_path.exists() else None
    tolerances = classify.Tolerances.of_case(case)
    t0 = time.perf_counter()
    with sessionmod.open_engine(case) as engine:
        startup = time.perf_counter() - t0
        cand = engine.generate()
        full_plan = replay.plan(golden, cand, "full")
        part_plan = replay.plan(golden, cand, "partial")
        print(f"{cid}: up in {startup:.0f} s; generated {cand.n_tokens} tokens in "
              f"{engine.timings['generate_s']:.1f} s; "
              f"partial plan: {part_plan.describe()}", flush=True)
        full_s, part_s = [], []
        full = part = None
        for r in range(rounds):
            full = engine.force(golden, starts=full_plan.starts)
            full_s.append(engine.timings["force_s"])
            if part_plan.replayed:
                part = engine.force(golden, starts=part_plan.starts)
                part_s.append(engine.timings["force_s"])
            else:
                part_s.append(0.0)
            print(f"{cid}: round {r + 1}/{rounds}: full {full_s[-1]:.2f} s, partial {part_s[-1]:.2f} s", flush=True)
        mechanism = engine.mechanism
    full_run = replay.assemble(golden, cand, full_plan, full, reference_id=REFERENCE, mechanism=mechanism)
    part_run = replay.assemble(golden, cand, part_plan, part, reference_id=REFERENCE, mechanism=mechanism)
    same_tokens = (len(cand.sequences) == len(stored.sequences)
                   and [s.n_tokens for s in cand.sequences] == [s.n_tokens for s in stored.sequences]
                   and np.array_equal(cand.steps.token_id, stored.steps.token_id))
    with tempfile.TemporaryDirectory(prefix="diffcheck-bench-") as tmp:
        cand_s = _codec(cand, Path(tmp), "cand")
        full_s_run = _codec(full_run, Path(tmp), "full")
        part_s_run = _codec(part_run, Path(tmp), "part")
    judge = dict(tolerances=tolerances, candidate_id=cid, reference_id=REFERENCE, floor=floor, text_metrics=True)
    v_stored = classify.compare_runs(golden, stored, forced=stored_forced, scored=scored, **judge)
    use_scored = scored if same_tokens else None
    v_full = classify.compare_runs(golden, cand_s, forced=full_s_run, scored=use_scored, **judge)
    v_part = classify.compare_runs(golden, cand_s, forced=part_s_run, scored=use_scored, **judge)
    # how far the partial forced rows are from the full ones (same engine, same run)
    dlp = np.abs(part_run.steps.logprob.astype(np.float64) - full_run.steps.logprob.astype(np.float64))
    mode, why = replay.mode_for(case)
    med_full, med_part = statistics.median(full_s), statistics.median(part_s)
    row = {
        "case": cid, "description": case.description, "startup_s": startup, "mechanism": mechanism,
        "compare_default_mode": mode, "compare_default_why": why, "same_tokens_as_stored": bool(same_tokens),
        "path_steps": golden.n_tokens, "full_steps": full_plan.replay_steps, "partial_steps": part_plan.replay_steps,
        "replayed": list(part_plan.replayed), "reused": list(part_plan.reused), "starts": list(part_plan.starts),
        "full_s": full_s, "partial_s": part_s,
        "full_path_tokens_per_s": golden.n_tokens / med_full,
        "partial_path_tokens_per_s": golden.n_tokens / med_part if med_part else None,
        "partial_replayed_tokens_per_s": part_plan.replay_steps / med_part if med_part else None,
        "speedup": med_full / med_part if med_part else None,
        "max_abs_dlogprob_partial_vs_full": float(dlp.max()) if len(dlp) else 0.0,
        "verdict": {"stored_full": v_stored.verdict.name, "full": v_full.verdict.name, "partial": v_part.verdict.name},
        "sequences": {"stored_full": _key(v_stored), "full": _key(v_full), "partial": _key(v_part)},
    }
    row["verdicts_agree"] = row["sequences"]["partial"] == row["sequences"]["full"] == row["sequences"]["stored_full"]
    row["partial_agrees_with_full"] = row["sequences"]["partial"] == row["sequences"]["full"]
    return row


def _per_row_apply(rows: dict, logits):
    """The previous ForceTokens.apply (Python per row per step), the baseline of `bench_apply`."""
    import torch

    for index, (forced, output_ids) in rows.items():
        step = len(output_ids)
        if step >= len(forced) or index >= logits.shape[0]:
            continue
        token = forced[step]
        keep = logits[index, token].clone()
        logits[index].fill_(float("-inf"))
        logits[index, token] = keep if torch.isfinite(keep) else 0.0
    return logits


def bench_apply(sizes=(8, 64, 256), vocab: int = 49152, calls: int = 300) -> list[dict]:
    """Median seconds per ``apply`` call, batched against the per-row loop, interleaved call by call."""
    import torch

    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core each: less noise from a shared machine
    try:
        return [_bench_apply_rows(n, vocab, calls, rng) for n in sizes]
    finally:
        torch.set_num_threads(threads)


def _bench_apply_rows(n: int, vocab: int, calls: int, rng) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from diffcheck.engines.forcing import EXTRA_ARG, ForceTokens

    paths = [rng.integers(0, vocab, 256).tolist() for _ in range(n)]
    outputs = [list(p[:100]) for p in paths]
    proc = ForceTokens(None, torch.device("cpu"), False)
    proc.update_state(BatchUpdate(batch_size=n, removed=[], moved=[], added=[
        (i, SamplingParams(extra_args={EXTRA_ARG: p}), None, o) for i, (p, o) in enumerate(zip(paths, outputs))]))
    old_rows = {i: (p, o) for i, (p, o) in enumerate(zip(paths, outputs))}
    base = torch.randn(n, vocab)
    fns = {"batched": lambda x: proc.apply(x), "per_row": lambda x: _per_row_apply(old_rows, x)}
    work = [base.clone() for _ in range(8)]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for c in range(calls):  # interleaved, so machine load hits both alike
        for name, fn in fns.items():
            x = work[c % 8]
            t0 = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - t0)
    timings = {name: statistics.median(t) for name, t in times.items()}
    assert torch.equal(proc.apply(base.clone()), _per_row_apply(old_rows, base.clone()))
    return {"rows": n, "vocab": vocab, "batched_us": timings["batched"] * 1e6,
            "per_row_us": timings["per_row"] * 1e6, "ratio": timings["per_row"] / timings["batched"]}


def main(case_ids: tuple[str, ...] = CASES, rounds: int = 2) -> dict:
    from diffcheck import cases
    from diffcheck.engines import session as sessionmod
    from diffcheck import workspace
    from diffcheck.workspace import load_floor

    root = workspace.goldens_root()
    suite = cases.load_suite(SUITE)
    golden = workspace.load_golden(root, SUITE, REFERENCE)
    floor, notes = load_floor(root, SUITE, REFERENCE, golden)
    for note in notes:
        print(note)
    apply_rows = bench_apply()
    for a in apply_rows:
        print(f"apply, {a['rows']} rows x {a['vocab']}: batched {a['batched_us']:.0f} us, per-row loop "
              f"{a['per_row_us']:.0f} us ({a['ratio']:.1f}x)", flush=True)
    rows = [bench_case(suite, cid, root=root, golden=golden, floor=floor, rounds=rounds) for cid in case_ids]
    print("| case | compare's mode | sequences replayed | forced steps full / partial | full s | partial s "
          "| path tok/s full / partial | speed-up | verdict stored / full / partial | per-sequence agree |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ptps = r["partial_path_tokens_per_s"]
        partial_rate = "no replay" if ptps is None else f"{ptps:.0f}"
        speedup = "no replay" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        verdicts = " / ".join(r["verdict"].values())
        print(f"| {r['case']} | {r['compare_default_mode']} | {len(r['replayed'])}/{len(r['starts'])} "
              f"| {r['full_steps']} / {r['partial_steps']} | {statistics.median(r['full_s']):.2f} "
              f"| {statistics.median(r['partial_s']):.2f} | {r['full_path_tokens_per_s']:.0f} / {partial_rate} "
              f"| {speedup} | {verdicts} | {'yes' if r['verdicts_agree'] else 'NO'} |")
    for r in rows:
        if not r["verdicts_agree"]:
            for name, seqs in r["sequences"].items():
                print(f"  {r['case']} {name}: {seqs}")
    return {"rounds": rounds, "floor": floor.describe(), "apply": apply_rows, "cases": rows,
            "all_agree": all(r["verdicts_agree"] for r in rows)}


if __name__ == "__main__":
    args = sys.argv[1:]
    ids = tuple(a for a in (args[0].split(",") if args and not args[0].isdigit() else []) if a) or CASES
    n = int(args[-1]) if args and args[-1].isdigit() else 2
    result = main(ids, n)
    out = ROOT / "reports" / "bench-replay.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import json

    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}")
