"""CLI start-up: `diffcheck --help` wall time and what it imports.

Measures, each in fresh subprocesses so nothing is warm in-process:
- wall time of the venv's `diffcheck --help` console script (best and median of N runs);
- wall time of `python -c pass` with the same interpreter, the floor any Python CLI pays;
- which heavy modules (torch, vllm, pyarrow, numpy) `diffcheck --help` and
  `diffcheck compare --help` leave in ``sys.modules``: the lazy command loading
  promises none.

The target is <= 0.3 s wall for `diffcheck --help`; the script prints the numbers and
the verdict but never fails on time (timings belong in bench/, not in tests).
Run: ``.venv/bin/python bench/bench_cli.py [N]``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 0.3
HEAVY = ("torch", "vllm", "pyarrow", "numpy")

# Runs diffcheck's own entry point in a fresh interpreter and reports what it imported.
_PROBE = """
import contextlib, io, json, sys
from diffcheck.cli import main
argv = json.loads(sys.argv[1])
with contextlib.redirect_stdout(io.StringIO()):
    rc = main(argv)
heavy = json.loads(sys.argv[2])
print(json.dumps({"rc": rc, "heavy": sorted(m for m in heavy if m in sys.modules)}))
"""


def console_script() -> Path:
    """The venv's `diffcheck` script beside this interpreter (what a user runs), else PATH's."""
    here = Path(sys.executable).parent / "diffcheck"
    if here.exists():
        return here
    found = shutil.which("diffcheck")
    if found is None:
        raise SystemExit("bench_cli: no `diffcheck` console script (run `make install`)")
    return Path(found)


def wall_times(cmd: list[str], *, n: int) -> list[float]:
    """Wall seconds of `n` runs of `cmd`; one untimed run first so the page cache is warm."""
    subprocess.run(cmd, check=True, capture_output=True)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times


def heavy_imports(argv: list[str]) -> dict:
    """{"rc": exit code, "heavy": heavy modules imported} for `diffcheck <argv>` in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv), json.dumps(HEAVY)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(n: int = 10) -> dict:
    script = console_script()
    help_t = wall_times([str(script), "--help"], n=n)
    python_t = wall_times([sys.executable, "-c", "pass"], n=n)
    probes = {" ".join(argv): heavy_imports(argv) for argv in (["--help"], ["compare", "--help"])}
    result = {
        "runs": n,
        "help_best_s": min(help_t),
        "help_median_s": statistics.median(help_t),
        "python_best_s": min(python_t),
        "python_median_s": statistics.median(python_t),
        "target_s": TARGET_S,
        "heavy_imports": {cmd: p["heavy"] for cmd, p in probes.items()},
        "help_exit_codes": {cmd: p["rc"] for cmd, p in probes.items()},
    }
    result["meets_target"] = result["help_median_s"] <= TARGET_S
    print(f"diffcheck --help   best {result['help_best_s']:.3f} s  median {result['help_median_s']:.3f} s  "
          f"(N={n}; target <= {TARGET_S} s: {'met' if result['meets_target'] else 'MISSED'})")
    print(f"python -c pass     best {result['python_best_s']:.3f} s  median {result['python_median_s']:.3f} s  "
          f"(interpreter floor)")
    for cmd, heavy in result["heavy_imports"].items():
        print(f"diffcheck {cmd:14s} imports {', '.join(heavy) if heavy else 'none'} of {', '.join(HEAVY)}")
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
