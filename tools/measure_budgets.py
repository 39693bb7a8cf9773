"""Measure what each CPU-measurable precision change costs the default suite's model, on a
prompt set no suite uses: the data the default precision budgets are set from (issue 21).

``python -m tools.measure_budgets [--json reports/budget-calibration.json]``

The default suite's cases define the configurations (its eager fp32 reference J, its
bf16 variant B16 and its fp8 KV-cache variant D: the model, engine, sampling and spec
change exactly as the suite runs them), but every one of them runs the calibration prompts
(``cases/prompts/budget-calibration.toml``) instead of the suite's; a prompt that is also
one of the default suite's, or of any other prompt file beside it, is refused. The suite's
own D and B16 then *check* the budgets set here; they never set them.

The engine work is diffcheck's own, in a workspace of its own (``--workdir``, default
``reports/budget-calibration/``; never ``goldens/``): J's golden recorded as ``diffcheck
golden record`` records one (`workflows.record`), each variant generated and teacher-forced
along it as ``diffcheck compare`` does (`workflows.compare.run_candidate`; ledger reuse
included, so a second run of this command reuses its engine work), and judged by the judge
(`judging.classify.compare_runs`). The per-sequence cost read off the verdict is the forced
path's mean KL(reference ‖ candidate) per step and its mean loss per step (−mean Δlogprob of
the reference's token): the two numbers the budget decision tests (`judging.decision`).

The rule (docs/verdicts.md, "Precision budgets"): a key's default budget is ``--factor``
(default 2) times the largest per-sequence cost measured here, rounded up to one
significant digit. The command prints a table and writes everything (per sequence, the
maxima, the budgets the rule gives and the ones in force) to ``--json``.

About 8.5 minutes on 2 cores (measured: 499 s): three eager engine starts, 8 prompts x at
most 192 tokens each (bf16 generates slowest, ~3 minutes), forced replays of the two variants.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from diffcheck import cases as casesmod
from diffcheck import workspace
from diffcheck.cases.prompts import load_prompts
from diffcheck.judging import classify
from diffcheck.judging.floor import spec_change
from diffcheck.judging.tolerances import BUDGETS
from diffcheck.workflows import compare as comparemod
from diffcheck.workflows import record as recordmod

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "cases" / "prompts" / "budget-calibration.toml"
SUITE = "default"
REFERENCE = "J"
VARIANTS = ("B16", "D")  # the default suite's precision variants: their configurations, not their prompts
CALIBRATION_SUITE = "budget-calibration"  # the workspace folder of these runs


def round_up_1sig(x: float) -> float:
    """`x` rounded up to one significant digit (0.0231 -> 0.03, 0.2 -> 0.2, 0.91 -> 1)."""
    if not x > 0:
        return 0.0
    e = math.floor(math.log10(x))
    m = math.ceil(round(x / 10.0 ** e, 9))
    if m >= 10:
        m, e = 1, e + 1
    return float(f"{m}e{e}")


def _echo(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _refuse_shared_prompts(ref_case, suite) -> None:
    """The calibration prompts must be none of the default suite's, nor of any prompt file beside them."""
    prompts_file = Path(ref_case.prompts_file).resolve()
    ours = {p.text for p in load_prompts(ref_case)}
    others = {p.resolve() for p in (REPO / "cases" / "prompts").glob("*.toml")} - {prompts_file}
    others |= {Path(c.prompts_file).resolve() for c in suite.cases.values()}  # even when passed as --prompts
    for other in sorted(others):
        shared = ours & {p.text for p in load_prompts(dataclasses.replace(ref_case, prompts_file=other))}
        if shared:
            raise SystemExit(f"{prompts_file}: {len(shared)} prompt(s) also in {other}: the calibration set "
                             "must be apart from the prompts the budgets are checked on")


def _calibration_case(case, prompts_file: Path):
    return dataclasses.replace(case, prompts_file=prompts_file, suite=CALIBRATION_SUITE)


def measure(prompts_file: Path, workdir: Path, *, factor: float) -> dict:
    suite = casesmod.load_suite(SUITE)
    ref_case = _calibration_case(casesmod.get_case(suite, REFERENCE), prompts_file)
    _refuse_shared_prompts(ref_case, suite)
    prompts = load_prompts(ref_case)
    t0 = time.monotonic()
    # update=True: this workspace's golden follows the calibration prompts when they change
    result = recordmod.record_golden(ref_case, root=workdir, update=True, echo=_echo)
    _echo(f"{REFERENCE}: golden {result.status} ({result.path})")
    golden = workspace.load_golden(workdir, CALIBRATION_SUITE, REFERENCE)
    variants = {}
    for vid in VARIANTS:
        case = _calibration_case(casesmod.get_case(suite, vid), prompts_file)
        cand, forced, reused = comparemod.run_candidate(case, [REFERENCE], {REFERENCE: golden}, root=workdir,
                                                        echo=_echo)
        for line in reused:
            _echo(line)
        change = spec_change(golden, cand)
        if len(change) != 1:
            raise SystemExit(f"{vid}: changes {sorted(change) or 'no precision key'}; expected exactly one")
        (key, (before, after)), = change.items()
        verdict = classify.compare_runs(golden, cand, forced=forced[REFERENCE],
                                        tolerances=classify.Tolerances.of_case(case), candidate_id=vid,
                                        reference_id=REFERENCE, text_metrics=False)
        seqs = []
        for sv in verdict.sequences:
            st = sv.stats  # the forced path's per-sequence aggregates: what the decision's effects estimate
            seqs.append({"prompt_id": sv.prompt_id, "steps": st["forced_n"], "kl_mean": st["forced_kl_mean"],
                         "loss_mean": st["forced_loss_mean"], "kl_max_step": st["forced_kl_max"],
                         "same_top1": st["forced_same_top1"], "t_star": sv.t_star})
        worst_kl = max(seqs, key=lambda s: s["kl_mean"])
        worst_loss = max(seqs, key=lambda s: s["loss_mean"])
        variants[vid] = {
            "key": key, "change": [before, after], "description": case.description,
            "sequences": seqs,
            "max": {"kl": worst_kl["kl_mean"], "kl_prompt": worst_kl["prompt_id"],
                    "loss": worst_loss["loss_mean"], "loss_prompt": worst_loss["prompt_id"]},
            "case_cost": verdict.summary.get("precision_cost", {}),
            "rule": {"kl": round_up_1sig(factor * worst_kl["kl_mean"]),
                     "loss": round_up_1sig(factor * worst_loss["loss_mean"])},
        }
    return {
        "command": "python -m tools.measure_budgets " + " ".join(sys.argv[1:]),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - t0, 1),
        "rule": f"budget = {factor:g} x the largest per-sequence cost, rounded up to one significant digit",
        "factor": factor,
        "prompts": str(prompts_file.relative_to(REPO) if prompts_file.is_relative_to(REPO) else prompts_file),
        "n_prompts": len(prompts),
        "reference": {"case": REFERENCE, "suite": SUITE, "model": golden.meta.model,
                      "engine": {k: golden.meta.engine.get(k) for k in ("name", "version")},
                      "hardware": golden.meta.hardware, "sampling": golden.meta.sampling},
        "variants": variants,
        "budgets_in_force": {k: dataclasses.asdict(b) for k, b in BUDGETS.items()},
        "workdir": str(workdir),
    }


def table(report: dict) -> str:
    lines = [f"Per-sequence precision cost on {report['prompts']} ({report['n_prompts']} prompts), "
             f"forced along the eager fp32 reference {report['reference']['case']}:", "",
             "| variant | change | prompt | steps | mean KL | mean loss | same top-1 |",
             "|---|---|---|---|---|---|---|"]
    for vid, v in report["variants"].items():
        change = f"{v['key']} {v['change'][0]} -> {v['change'][1]}"
        for s in v["sequences"]:
            lines.append(f"| {vid} | {change} | {s['prompt_id']} | {s['steps']} | {s['kl_mean']:.3g} | "
                         f"{s['loss_mean']:.3g} | {s['same_top1']:.3f} |")
    lines += ["", f"Rule: {report['rule']}.", "",
              "| key | largest mean KL (prompt) | largest mean loss (prompt) | budget KL | budget loss | "
              "in force |", "|---|---|---|---|---|---|"]
    for v in report["variants"].values():
        m, r, now = v["max"], v["rule"], report["budgets_in_force"][v["key"]]
        lines.append(f"| {v['key']} | {m['kl']:.3g} ({m['kl_prompt']}) | {m['loss']:.3g} ({m['loss_prompt']}) | "
                     f"{r['kl']:g} | {r['loss']:g} | {now['kl']:g} / {now['loss']:g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.measure_budgets", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=REPO / "reports" / "budget-calibration.json",
                   help="where the measurements go (default: reports/budget-calibration.json)")
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="the calibration prompt set")
    p.add_argument("--workdir", type=Path, default=REPO / "reports" / "budget-calibration",
                   help="the goldens root of these runs (default: reports/budget-calibration)")
    p.add_argument("--factor", type=float, default=2.0, help="budget = factor x the largest cost (default 2)")
    args = p.parse_args(argv)
    report = measure(args.prompts.resolve(), args.workdir.resolve(), factor=args.factor)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(table(report))
    print(f"\nwritten: {args.json} ({report['seconds']:g} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
