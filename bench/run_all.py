"""Run every benchmark in bench/ and collect their results in reports/bench.json.

A benchmark is a ``bench/bench_*.py`` module with a ``main() -> dict``. Each one runs
in its own subprocess: an engine benchmark's vLLM processes and memory are gone
before the next starts, a crash in one does not lose the others, and no module
state leaks between them. The child writes its dict as JSON to a temporary file;
its own output goes straight to the terminal.

Results are machine- and load-specific, so they go to the git-ignored reports/
folder, one entry per benchmark with its own date; `bench/measured.py` turns them into
docs/measured.md.
Run: ``.venv/bin/python bench/run_all.py [NAME ...]`` (NAME: ``cli``, ``bench_cli``, ...;
default all). `make bench` runs it. Exit status 1 if any benchmark failed.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUT = ROOT / "reports" / "bench.json"

# Runs in the child: load the module by path (not as __main__, so vLLM's spawned
# processes never re-run it) and write main()'s dict as JSON.
_DRIVER = """
import importlib.util, json, sys
name, path, out = sys.argv[1:4]
sys.argv = [path]  # a main() that parses sys.argv sees no arguments: its defaults
spec = importlib.util.spec_from_file_location(name, path)
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module  # dataclasses look their module up while the class is built
spec.loader.exec_module(module)
result = module.main()
with open(out, "w") as f:
    json.dump(result, f, indent=1, default=str)
"""


@dataclass(frozen=True)
class Outcome:
    name: str
    ok: bool
    seconds: float
    result: dict | None
    error: str = ""


def discover(names: list[str] | None = None) -> list[Path]:
    """bench/bench_*.py, sorted; `names` (with or without the bench_ prefix) selects some."""
    found = sorted(BENCH.glob("bench_*.py"))
    if not names:
        return found
    wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in (Path(n).stem for n in names)}
    unknown = wanted - {p.stem for p in found}
    if unknown:
        raise SystemExit(f"run_all: no benchmark {', '.join(sorted(unknown))} "
                         f"(available: {', '.join(p.stem for p in found)})")
    return [p for p in found if p.stem in wanted]


def run_one(path: Path) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="diffcheck-bench-") as tmp:
        out = Path(tmp) / "result.json"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _DRIVER, path.stem, str(path), str(out)], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - t0
        if proc.stderr:
            sys.stderr.write(proc.stderr)
        if proc.returncode != 0 or not out.exists():
            tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
            return Outcome(path.stem, False, seconds, None,
                           f"exit {proc.returncode}: {tail[-1] if tail else 'no error output'}")
        return Outcome(path.stem, True, seconds, json.loads(out.read_text()))


def _scalars(result: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Flattened scalar entries of a nested result dict, for the one-screen summary."""
    rows = []
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += _scalars(value, prefix=f"{name}.")
        elif isinstance(value, (int, float, str, bool)) or value is None:
            rows.append((name, value))
        elif isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
            rows.append((name, "[" + ", ".join(_fmt(v) for v in value) + "]"))
    return rows


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    paths = discover(sys.argv[1:] if argv is None else argv)
    outcomes = []
    for path in paths:
        print(f"== {path.stem}", flush=True)
        outcomes.append(run_one(path))
    print("\n== summary")
    for o in outcomes:
        print(f"{o.name}: {'ok' if o.ok else 'FAILED'} in {o.seconds:.1f} s" + (f" ({o.error})" if o.error else ""))
        for key, value in _scalars(o.result or {}):
            print(f"  {key} = {_fmt(value)}")
    for o in outcomes:
        record(o.name, o.result, o.seconds, error=o.error)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0 if all(o.ok for o in outcomes) else 1


def record(name: str, result: dict | None, seconds: float, *, error: str = "") -> None:
    """Merge one benchmark's result into reports/bench.json (each entry keeps its own date),
    so a benchmark run alone (``python bench/bench_X.py``) lands there too."""
    report = json.loads(OUT.read_text()) if OUT.exists() else {"benchmarks": {}}
    report["host"] = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    report["benchmarks"][name] = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ok": result is not None and not error, "seconds": seconds, "result": result, "error": error}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    os.replace(tmp, OUT)  # a half-written report never replaces a whole one


if __name__ == "__main__":
    sys.exit(main())
