"""Outputs of `diffcheck reduce`: the standalone script, the Markdown bug report, the terminal
summary and the JSON (`workflows.reduce.ReduceResult`).

The script (`render_script`) imports only vLLM (and the standard library): it is what an
engine engineer attaches to a bug report, runnable without diffcheck.
"""

from __future__ import annotations

import json
import pprint
from typing import Any

THRESHOLD = 0.5  # nats: the script's "the bug shows" threshold (docs/reduce.md)
WINDOW = 3  # steps shown on each side of the first divergence

_SCRIPT = '''#!/usr/bin/env python3
"""Reproducer of diffcheck case {case} ({verdict} against reference {reference}), reduced by `diffcheck reduce`.

Runs the reference and the candidate vLLM configurations on the reduced prompt(s) with the
case's seeded sampling, each in a fresh process (a configuration's environment must be set
before vLLM starts), prints both texts and the per-step logprobs around the first divergence,
and exits 1 when the bug shows, 0 when it does not.

The bug shows when, on a step where both runs saw the same context (every step up to and
including the first divergence t*), the logprob of the reference run's token differs between
the two runs by more than THRESHOLD = {threshold} nats (a token missing from the other run's
top-{k} counts as beyond it). Two runs of one configuration differ by float rounding at most.

Needs only vLLM (and torch).{fault_note}

Usage:
  python {name}                        # reference vs candidate: exit 1 when the bug shows
  python {name} --candidate reference  # the reference against itself: exit 0 (a control)
  REDUCE_MODEL=/path/to/model python {name}   # another copy of the model
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

MODEL = os.environ.get("REDUCE_MODEL", {model!r})
CONFIGS = {configs}
SAMPLING = {sampling}
PROMPTS = {prompts}
THRESHOLD = {threshold}
WINDOW = {window}
ENV_PREFIXES = ("DIFFCHECK_FAULT",)  # cleared unless the configuration sets them


def run_side(name, out_path):
    """One configuration's generation, written as JSON to out_path (runs in its own process)."""
    from vllm import LLM, SamplingParams

    llm = LLM(**{{**CONFIGS[name]["llm"], "model": MODEL}})
    params = SamplingParams(**SAMPLING)
    outputs = llm.generate([{{"prompt_token_ids": p["prompt_token_ids"]}} for p in PROMPTS], params, use_tqdm=False)
    result = []
    for out in outputs:
        c = out.outputs[0]
        steps = [{{str(int(t)): float(lp.logprob) for t, lp in (step or {{}}).items()}} for step in (c.logprobs or [])]
        result.append({{"text": c.text, "tokens": [int(t) for t in c.token_ids], "steps": steps}})
    with open(out_path, "w") as f:
        json.dump(result, f)


def generate(name):
    env = {{k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIXES)}}
    env.update(CONFIGS[name]["env"])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, name + ".json")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--side", name, "--out", path], env=env)
        if proc.returncode != 0:
            sys.exit(f"the {{name}} configuration failed to run (exit {{proc.returncode}})")
        with open(path) as f:
            return json.load(f)


def first_divergence(a, b):
    n = min(len(a), len(b))
    for t in range(n):
        if a[t] != b[t]:
            return t
    return n if len(a) != len(b) else None


def compare(ref, cand):
    """(t*, the worst same-context logprob gap of the reference's token, the step of the first gap beyond THRESHOLD)."""
    t_star = first_divergence(ref["tokens"], cand["tokens"])
    last = min(len(ref["tokens"]) - 1, t_star if t_star is not None else len(ref["tokens"]) - 1)
    worst, first_bad = 0.0, None
    for t in range(0, last + 1):
        token = str(ref["tokens"][t])
        a = ref["steps"][t].get(token) if t < len(ref["steps"]) else None
        b = cand["steps"][t].get(token) if t < len(cand["steps"]) else None
        gap = float("inf") if a is None or b is None else abs(a - b)
        worst = max(worst, gap)
        if gap > THRESHOLD and first_bad is None:
            first_bad = t
    return t_star, worst, first_bad


def show_steps(ref, cand, center):
    lo, hi = max(0, center - WINDOW), center + WINDOW + 1
    print("    step  reference token (logprob)          candidate token (logprob)   candidate's logprob of the reference token")
    for t in range(lo, hi):
        if t >= len(ref["tokens"]) and t >= len(cand["tokens"]):
            break
        cells = []
        for side in (ref, cand):
            if t < len(side["tokens"]):
                tok = str(side["tokens"][t])
                cells.append("%8s (%8.3f)" % (tok, side["steps"][t].get(tok, float("nan"))))
            else:
                cells.append("%19s" % "(ended)")
        other = cand["steps"][t].get(str(ref["tokens"][t])) if t < len(ref["tokens"]) and t < len(cand["steps"]) else None
        mark = " <- t*" if t == center else ""
        print("    %4d  %-32s %-28s %s%s" % (t, cells[0], cells[1], "%.3f" % other if other is not None else "-", mark))


def main():
    parser = argparse.ArgumentParser(description="Reproducer of diffcheck case {case}.")
    parser.add_argument("--candidate", choices=sorted(CONFIGS), default="candidate",
                        help="the configuration compared with the reference (default: candidate)")
    parser.add_argument("--side", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        run_side(args.side, args.out)
        return 0
    ref, cand = generate("reference"), generate(args.candidate)
    shows = False
    for prompt, r, c in zip(PROMPTS, ref, cand):
        t_star, worst, first_bad = compare(r, c)
        bug = first_bad is not None
        shows = shows or bug
        print("prompt %s: first divergence t* = %s; worst same-context logprob gap %.3f nats (threshold %s): %s"
              % (prompt["id"], t_star, worst, THRESHOLD, "THE BUG SHOWS" if bug else "no bug"))
        print("  reference text: %r" % r["text"])
        print("  %s text: %r" % (args.candidate, c["text"]))
        center = first_bad if first_bad is not None else t_star
        if center is not None:
            show_steps(r, c, center)
    print("bug shows: exit 1" if shows else "no bug: exit 0")
    return 1 if shows else 0


if __name__ == "__main__":
    sys.exit(main())
'''


def render_script(result, *, name: str = "reduce.py") -> str:
    """The standalone reproducer of a `ReduceResult` (imports only vLLM and the standard library)."""
    spec = result.script
    fault = {k: v for k, v in spec["sides"]["candidate"]["env"].items() if k.startswith("DIFFCHECK_FAULT")}
    note = ""
    if fault:
        note = (f"\nThis case's candidate injects a fault through a vLLM plugin enabled by its environment\n"
                f"({', '.join(f'{k}={v}' for k, v in sorted(fault.items()))}): the fault plugin must be installed\n"
                "for it to act (it is diffcheck's vLLM general plugin, `pip install diffcheck`; the script\n"
                "itself never imports diffcheck). For a real bug there is no plugin: it is just vLLM.")
    prompts = [{"id": p.id, "text": p.text, "prompt_token_ids": spec["prompt_token_ids"].get(p.id, [])}
               for p in result.prompts]
    k = spec["sampling"].get("logprobs", 5)
    return _SCRIPT.format(case=result.case_id, verdict=result.verdict, reference=result.reference_id,
                          threshold=THRESHOLD, k=k, fault_note=note, name=name, model=spec["model"],
                          configs=pprint.pformat(spec["sides"], width=100, sort_dicts=True),
                          sampling=pprint.pformat(spec["sampling"], width=100, sort_dicts=True),
                          prompts=pprint.pformat(prompts, width=100, sort_dicts=False), window=WINDOW)


def _evidence(verdict) -> list[str]:
    bad = [s for s in verdict.sequences if s.verdict is verdict.verdict]
    lines = []
    for s in bad[:3]:
        lines.append(f"- prompt `{s.prompt_id}`: {s.verdict.name}, t* = {s.t_star}"
                     + (f", onset {s.onset}" if s.onset is not None else ""))
        lines += [f"  - {e}" for e in s.evidence[:4]]
    return lines


def probe_rows(result) -> list[tuple]:
    return [(p.n, p.stage, len(p.prompts), p.max_tokens, ", ".join(p.delta) or "none",
             "".join(f"{k}={v}" for k, v in p.engine.items()) or "", p.verdict,
             "yes" if p.still_fails else "no", "ledger" if p.reused else f"{p.seconds:.0f}s") for p in result.probes]


def summary_line(result) -> str:
    return (f"reduce {result.case_id}: {result.verdict} against {result.reference_id} with "
            f"{len(result.prompts)} of {result.original_prompts} prompts, {result.max_tokens} of "
            f"{result.original_max_tokens} tokens (onset {result.onset}, t* {result.t_star}), delta "
            f"{', '.join(result.kept) or 'none'}; {len(result.probes)} probes ({result.saved} from the ledger, "
            f"bound {result.bound}) in {result.seconds:.0f}s")


def render_markdown(result) -> str:
    v = result.versions
    delta = "\n".join(f"| `{k}` | `{a}` | `{b}` |" for k, (a, b) in result.config_delta.items()) or "| (none) | | |"
    rows = "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in probe_rows(result))
    hw = ", ".join(f"{k[3:]}: {val}" for k, val in v.items() if k.startswith("hw_")) or "unknown"
    prompts = "\n".join(f"- `{p.id}`: {p.text}" for p in result.prompts)
    files = "\n".join(f"- {what}: `{path}`" for what, path in result.files.items())
    return f"""# {result.case_id}: {result.verdict} against {result.reference_id} (reduced)

{summary_line(result)}.

## Versions

| | |
|---|---|
| vLLM | {v.get('vllm')} (commit {v.get('vllm_commit') or '-'}) |
| torch | {v.get('torch')} (CUDA {v.get('cuda') or 'none'}) |
| Python | {v.get('python')} |
| platform | {v.get('platform')} |
| hardware | {hw} |

## Configuration delta (reference → candidate)

| key | {result.reference_id} | {result.case_id} (reduced) |
|---|---|---|
{delta}

Dropped from the original delta (the failure does not need them): {', '.join(result.dropped) or 'none'}.
Batch: {result.batch_note}.

## Verdict

{result.final.verdict.name} (the original comparison: {result.original.verdict.name}, on
{result.original_prompts} prompts and {result.original_max_tokens} tokens). First divergence t* =
{result.t_star}, onset {result.onset}.

{chr(10).join(_evidence(result.final)) or '(no sequence evidence)'}

## Reduced prompts ({len(result.prompts)}), max_tokens {result.max_tokens}

{prompts}

## Probes

{len(result.probes)} probes in {result.seconds:.0f}s; {result.engine_probes} ran an engine, {result.saved} came
from the ledger; the cost bound 2·log2(prompts × steps) + delta keys is {result.bound}.

| # | stage | prompts | tokens | delta kept | engine | verdict | still fails | time |
|---|---|---|---|---|---|---|---|---|
{rows}

## Reproducer

`python reduce.py` exits 1 when the bug shows, 0 when it does not (`--candidate reference`: the
control, exit 0).

{files}

```python
{render_script(result)}```

Command: `{result.command}`
"""


def render_terminal(result, console) -> None:
    from rich.table import Table

    table = Table(title=f"reduce {result.case_id} vs {result.reference_id}")
    for col in ("#", "stage", "prompts", "tokens", "delta kept", "engine", "verdict", "still fails", "time"):
        table.add_column(col)
    for row in probe_rows(result):
        table.add_row(*(str(c) for c in row))
    console.print(table)
    console.print(summary_line(result), markup=False, highlight=False)
    console.print(f"batch: {result.batch_note}", markup=False, highlight=False)
    for what, path in result.files.items():
        console.print(f"{what}: {path}", markup=False, highlight=False)


def as_data(result) -> dict[str, Any]:
    return {
        "schema": "diffcheck.reduce", "suite": result.suite, "case": result.case_id,
        "reference": result.reference_id, "verdict": result.verdict, "final_verdict": result.final.verdict.name,
        "prompts": [p.id for p in result.prompts], "original_prompts": result.original_prompts,
        "max_tokens": result.max_tokens, "original_max_tokens": result.original_max_tokens,
        "onset": result.onset, "t_star": result.t_star, "kept": list(result.kept), "dropped": list(result.dropped),
        "config_delta": {k: list(v) for k, v in result.config_delta.items()}, "fails_alone": result.fails_alone,
        "probes": [{"n": p.n, "stage": p.stage, "case": p.case_id, "prompts": list(p.prompts),
                    "max_tokens": p.max_tokens, "delta": list(p.delta), "engine": p.engine, "verdict": p.verdict,
                    "still_fails": p.still_fails, "reused": p.reused, "seconds": round(p.seconds, 2)}
                   for p in result.probes],
        "bound": result.bound, "seconds": round(result.seconds, 2), "versions": result.versions,
        "files": result.files, "minimal_case": result.minimal.id,
    }


def render_json(result) -> str:
    return json.dumps(as_data(result), indent=2, default=str) + "\n"
