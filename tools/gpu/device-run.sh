#!/usr/bin/env bash
# The GPU lane on the device machine (one NVIDIA H200, no registry), in stages that fit
# its 10-minute calls. Run from the repository root of the working-tree copy there:
#
#   bash tools/gpu/device-run.sh collect            copy carried bundle files into $HOME/bundle
#   bash tools/gpu/device-run.sh install            + install.sh (verify, install, model prepare)
#   bash tools/gpu/device-run.sh goldens CASE...    diffcheck golden record --suite $SUITE CASE...
#   bash tools/gpu/device-run.sh calibrate [IDS]    diffcheck calibrate IDS (default J): floor replicas on the GPU
#   bash tools/gpu/device-run.sh compare [--replay full|partial] CASE...
#                                                   diffcheck compare CASE --json --html, each
#   bash tools/gpu/device-run.sh kernels [ARGS]     diffcheck kernels --device cuda for vLLM's own decode
#                                                   attention, stored in goldens/kernels/vllm-0.26/
#   bash tools/gpu/device-run.sh localize [--step T --around K] CASE...
#                                                   diffcheck localize CASE --json --html, each (captures stored as *.npz)
#   bash tools/gpu/device-run.sh speed [ARGS]       tools/gpu/speed.py (the speed table; full vs partial replay)
#   bash tools/gpu/device-run.sh profile [ARGS]     tools/gpu/profile_capture.py (vLLM's torch profiler, with and
#                                                   without logprobs; goldens/$SUITE/profile-capture/)
#
# SUITE is gpu-h200, or DIFFCHECK_GPU_SUITE (gpu-h200-tp on the 4-GPU machine).
#
# Several stages may be given in one call, separated by '--'. State lives in $HOME
# (the bundle, the install, the model, the goldens written so far), which survives
# while the machine stays warm between calls. Every call ends by packing what the
# suite wrote (goldens/$SUITE, reports, logs, engine logs) into $OUT/gpu-results.tar.gz,
# and the goldens are restored from $HOME at the start of the next call.
set -uo pipefail
REPO=$(pwd)
BUNDLE=$HOME/bundle
DEST=$HOME/dcgpu
STATE=$HOME/gpu-state            # goldens/ and logs carried between calls on the warm machine
OUT=${OUT:-/tmp/out}
SUITE=${DIFFCHECK_GPU_SUITE:-gpu-h200}
mkdir -p "$OUT" "$BUNDLE" "$STATE/logs"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off, in every process started from here (the cases set them too).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0

# The checkout first on the path: its diffcheck (and its fault modules) win over the
# bundled wheel's copy; the wheel's dist-info still provides the vLLM plugin entry point.
use_env() {
  # diffcheck_kernels is the checkout's kernels/ (the bundled wheel's copy would be older): a link first on the path
  mkdir -p "$STATE/shim" && ln -sfn "$REPO/kernels" "$STATE/shim/diffcheck_kernels"
  export PYTHONPATH="$STATE/shim:$REPO:$DEST/site"
  export DIFFCHECK_CACHE="$DEST/cache"
  export TMPDIR="$STATE/tmp"; mkdir -p "$TMPDIR"   # engine logs land here (collected below)
  DC="python3 -m diffcheck.cli"
}

restore_goldens() {
  if [ -d "$STATE/goldens" ]; then cp -a "$STATE/goldens/." "$REPO/goldens/"; fi
}

save_goldens() {  # this suite's data, kernel results and the ledger; never the scripts (restore would overwrite the running one)
  mkdir -p "$STATE/goldens/$SUITE" "$STATE/goldens/kernels"
  (cd "$REPO/goldens/$SUITE" && cp -a ./*.parquet ./*.npz MANIFEST.json speed*.json reports logs profile-capture "$STATE/goldens/$SUITE/" 2>/dev/null) || true
  cp -a "$REPO/goldens/kernels/." "$STATE/goldens/kernels/" 2>/dev/null || true
  cp -a "$REPO"/goldens/ledger* "$STATE/goldens/" 2>/dev/null || true
}

timed() {  # timed LABEL CMD...: run, log, record seconds and exit code
  local label=$1; shift
  local t0 t1 rc
  t0=$(date +%s%N)
  "$@" 2>&1 | tee -a "$STATE/logs/$label.log"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s%N)
  printf '%s\trc=%s\t%d ms\t%s\n' "$label" "$rc" $(( (t1 - t0) / 1000000 )) "$*" | tee -a "$STATE/logs/timings.tsv"
  return 0
}

stage() {
  local name=$1; shift
  case "$name" in
    collect)
      cp -f dist/gpu-bundle/* "$BUNDLE/" 2>/dev/null || true
      ls -la "$BUNDLE"
      ;;
    install)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$STATE/logs/gpu.txt"
      python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$STATE/logs/gpu.txt"
      timed install bash "$BUNDLE/install.sh" "$DEST"
      use_env
      python3 -c "import vllm, vllm.entrypoints.llm, vllm.v1.attention.backends.triton_attn, diffcheck.faults.gpu, diffcheck.cases.faults as s; print('vllm', vllm.__version__, 'seq-lens-copy in catalogue:', 'seq-lens-copy' in s._BY_NAME); from importlib.metadata import entry_points; print('plugins', [e.name for e in entry_points(group='vllm.general_plugins')])" 2>&1 | tee -a "$STATE/logs/gpu.txt"
      ;;
    goldens)
      use_env
      timed "golden-record" $DC golden record --suite "$SUITE" "$@"
      ;;
    calibrate)  # the floor: replicas of each reference (fresh engine, batch shapes 3 and 5) forced along its golden
      use_env
      local ids=("$@"); [ ${#ids[@]} -gt 0 ] || ids=(J)
      for c in "${ids[@]}"; do
        timed "calibrate-$c" $DC calibrate "$c" --suite "$SUITE"
      done
      ;;
    compare)
      use_env
      mkdir -p "goldens/$SUITE/reports" "goldens/$SUITE/logs"
      local flags=()
      while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do flags+=("$1" "$2"); shift 2; done   # e.g. --replay full
      for c in "$@"; do
        timed "compare-$c" $DC compare "$c" --suite "$SUITE" "${flags[@]+"${flags[@]}"}" \
          --json "goldens/$SUITE/reports/$c.json" --html "goldens/$SUITE/reports/$c.html"
      done
      ;;
    localize)  # diffcheck localize [--step T --around K] CASE...: in-graph taps under each case's CUDA graphs
      use_env
      mkdir -p "goldens/$SUITE/reports"
      local lflags=()
      while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do lflags+=("$1" "$2"); shift 2; done
      for c in "$@"; do
        timed "localize-$c" $DC localize "$c" --suite "$SUITE" "${lflags[@]+"${lflags[@]}"}" \
          --json "goldens/$SUITE/reports/$c.localize.json" --html "goldens/$SUITE/reports/$c.localize.html"
      done
      ;;
    kernels)  # vLLM's Triton unified attention and FA3 under CUDA graphs, with the seq-lens-copy fault; ARGS e.g. --suite quick
      use_env
      local kout=goldens/kernels/vllm-0.26
      mkdir -p "$kout"
      timed kernels $DC kernels --device cuda --kernels vllm-triton-unified,vllm-fa3 --out "$kout" \
        --json "$kout/cuda-h200.json" "$@"
      if [ -f "$kout/cuda-h200.json" ]; then   # store what ran, pass or fail; the log above has the verdict
        timed kernels-store $DC kernels --from-json "$kout/cuda-h200.json" --out "$kout" --update
      fi
      if python3 -c "import pytest" 2>/dev/null; then
        timed kernel-tests python3 -m pytest -q -p no:cacheprovider tests/test_vllm_kernels.py tests/test_kernels.py -m cuda
      fi
      ;;
    speed)
      use_env
      timed speed python3 tools/gpu/speed.py --suite "$SUITE" "$@"
      ;;
    profile)
      use_env
      timed profile python3 tools/gpu/profile_capture.py --suite "$SUITE" "$@"
      ;;
    *)
      echo "device-run.sh: unknown stage '$name' (collect, install, goldens, calibrate, compare, localize, kernels, speed, profile)" >&2
      return 2
      ;;
  esac
}

pack() {  # after every stage, so a call stopped at its time limit still returns what was done
  save_goldens
  mkdir -p "$STATE/logs/engine"
  cp -f "$STATE"/tmp/diffcheck-*.engine.log "$STATE/logs/engine/" 2>/dev/null || true
  tar -czf "$OUT/gpu-results.tar.gz.tmp" -C "$STATE" goldens logs && mv "$OUT/gpu-results.tar.gz.tmp" "$OUT/gpu-results.tar.gz"
}

restore_goldens
args=("$@")
i=0
while [ $i -lt ${#args[@]} ]; do
  name=${args[$i]}; i=$((i + 1)); rest=()
  while [ $i -lt ${#args[@]} ] && [ "${args[$i]}" != "--" ]; do rest+=("${args[$i]}"); i=$((i + 1)); done
  i=$((i + 1))
  stage "$name" "${rest[@]+"${rest[@]}"}"
  [ "$name" = collect ] || pack
done
ls -la "$OUT"
cat "$STATE/logs/timings.tsv" 2>/dev/null
