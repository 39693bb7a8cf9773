"""`diffcheck reduce` on every gibberish and degraded fault of a suite, and each reduced script run.

For each candidate the suite labels a gibberish or degraded fault (`expect`), in the suite's order:

1. ``diffcheck reduce ID --suite SUITE --out OUT/ID --json OUT/ID.json`` in a subprocess (the
   goldens are the suite's, as ``make golden`` recorded them);
2. the standalone script it wrote, in a fresh interpreter with no ``DIFFCHECK*`` variable and no
   PYTHONPATH: once as written (the candidate: exit 1 expected) and once with ``--candidate
   reference`` (exit 0 expected). The faults of the shipped suites act through diffcheck's vLLM
   plugin, which this venv has installed; a real bug would need vLLM alone. Each side's vLLM
   engine core runs in the side's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) to halve
   the imports on 2 cores.

Prints one Markdown table (the README's) and writes OUT/summary.json.
Run: ``.venv/bin/python bench/bench_reduce.py [--suite default] [--out reports/reduce] [IDS...]``
(after ``make golden``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAILING = ("gibberish fault", "degraded fault")


def _faults(suite_name: str, ids: list[str]) -> list[tuple[str, str]]:
    from diffcheck import cases
    from diffcheck.core.types import Verdict
    from diffcheck.workflows import selftest

    suite = cases.load_suite(suite_name)
    out = []
    for case in selftest.labelled_cases(suite, exclude_tags=()):
        label = {Verdict.GIBBERISH: FAILING[0], Verdict.DEGRADED: FAILING[1]}.get(case.expect.verdict)
        if label is not None and (not ids or case.id in ids):
            out.append((case.id, label))
    return out


def _script(script: Path, *args: str) -> tuple[int, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFCHECK", "PYTHONPATH"))}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), *args], cwd=script.parent, env=env, capture_output=True,
                          text=True)
    return proc.returncode, time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="default")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "reduce")
    parser.add_argument("ids", nargs="*")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for cid, label in _faults(args.suite, args.ids):
        doc_path = args.out / f"{cid}.json"
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "diffcheck.cli", "reduce", cid, "--suite", args.suite, "--out",
               str(args.out / cid), "--json", str(doc_path)]
        print("$ diffcheck", " ".join(cmd[3:]), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if not doc_path.exists():
            print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n")
            rows.append({"case": cid, "label": label, "error": f"exit {proc.returncode}", "seconds": seconds})
            continue
        doc = json.loads(doc_path.read_text())
        script = Path(doc["files"]["script"]).resolve()
        bug_rc, bug_s = _script(script)
        ref_rc, ref_s = _script(script, "--candidate", "reference")
        probes = doc["probes"]
        rows.append({
            "case": cid, "label": label, "exit": proc.returncode, "verdict": doc["verdict"],
            "final_verdict": doc["final_verdict"], "prompts": f"{doc['original_prompts']} -> {len(doc['prompts'])}",
            "max_tokens": f"{doc['original_max_tokens']} -> {doc['max_tokens']}", "onset": doc["onset"],
            "t_star": doc["t_star"], "delta": sorted(doc["config_delta"]), "dropped": doc["dropped"],
            "batch_1": doc.get("fails_alone"), "probes": len(probes), "from_ledger": sum(p["reused"] for p in probes),
            "bound": doc["bound"], "seconds": round(seconds, 1), "script_exit_candidate": bug_rc,
            "script_exit_reference": ref_rc, "script_seconds": round(bug_s + ref_s, 1)})
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n| case | label | verdict (reduced) | prompts | max_tokens | onset | delta kept | fails alone (batch 1) "
          "| probes (ledger) / bound | reduce s | script exit: candidate, reference |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | {r['label']} | {r['error']} | | | | | | | {r['seconds']:.0f} | |")
            continue
        print(f"| {r['case']} | {r['label']} | {r['verdict']} ({r['final_verdict']}) | {r['prompts']} | "
              f"{r['max_tokens']} | {r['onset']} | {', '.join(r['delta'])} | {r['batch_1']} | "
              f"{r['probes']} ({r['from_ledger']}) / {r['bound']} | {r['seconds']:.0f} | "
              f"{r['script_exit_candidate']}, {r['script_exit_reference']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
