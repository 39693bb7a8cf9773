"""``python -m kernels``: run the kernel suite with torch and numpy alone.

For machines without the diffcheck CLI's dependencies (a bare GPU box): runs
the suite, prints the summary table, optionally writes the results as JSON
(``diffcheck kernels --from-json`` stores and compares them later). Exit 0
when every case passes and both broken builders are caught for every kernel
that ran; 1 otherwise; 2 on a usage error.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--suite", choices=("full", "quick"), default="full", help="case grid (quick: CI-sized)")
    parser.add_argument("--kernels", default="",
                        help="comma-separated subset (torch-sdpa,vllm-cpu-attn,triton-paged,vllm-triton-unified,vllm-fa3)")
    parser.add_argument("--json", dest="json_path", default="", help="write the results here")
    args = parser.parse_args(argv)

    from diffcheck_kernels.results import overall_ok, write_json
    from diffcheck_kernels.suite import CONFIGS, run_suite
    from diffcheck_kernels.table import format_plain, verdict_line

    names = tuple(k for k in args.kernels.split(",") if k) or None
    start = time.perf_counter()
    try:
        result = run_suite(args.device, CONFIGS[args.suite], kernels=names,
                           progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))  # fmt: skip
    except ValueError as exc:
        print(f"python -m kernels: error: {exc}", file=sys.stderr)
        return 2
    print(format_plain(result))
    print(f"{verdict_line(result)} ({time.perf_counter() - start:.1f} s, {result.env.get('device_name', '')})")
    if args.json_path:
        print(f"results: {write_json(result, args.json_path)}")
    return 0 if overall_ok(result) else 1


if __name__ == "__main__":
    sys.exit(main())
