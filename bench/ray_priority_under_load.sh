#!/usr/bin/env bash
# The Ray matrix engine test beside two CPU-bound processes, with the local cluster's workers at
# the driver's priority (RAY_worker_niceness=0, what diffcheck sets) and at Ray's default (15).
# Each run is cut at 600 s. Not part of `make bench` (it loads the machine on purpose).
# Run: bash bench/ray_priority_under_load.sh
set -u
cd "$(dirname "$0")/.."
yes > /dev/null & H1=$!
yes > /dev/null & H2=$!
trap 'kill $H1 $H2 2>/dev/null' EXIT
for nice in 0 15; do
  echo "== RAY_worker_niceness=$nice, started $(date -u +%T)"
  RAY_worker_niceness=$nice timeout 600 .venv/bin/python -m pytest -q -p no:cacheprovider \
    "tests/test_matrix_engine.py::test_ray_matrix_survives_a_killed_worker_and_equals_the_sequential_run" \
    --durations=3 2>&1 | grep -E "s (call|setup) |passed|failed"
  echo "== exit ${PIPESTATUS[0]} (124: cut at 600 s), ended $(date -u +%T)"
done
