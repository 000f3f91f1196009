#!/usr/bin/env bash
# The GPU run on an H100 or H200, headline first, each part writing its results as it goes:
#   0. pre-flight (seconds): torch imports in isolated mode, CUDA is visible, a writer starts
#      from this source checkout and commits (benchmarks/preflight.py). It stops the run.
#      Beside it, the optional native helpers (csrc/) are built for this torch and Python, as
#      `make install` builds them (where no compiler exists the twins run) -> RESULTS_DIR/build.log;
#   1. the headline, within HEADLINE_BUDGET_S (about 4 minutes from the start): the stall per
#      checkpoint of the baseline, DCP's PROCESS async save with its overlapping DefaultStager,
#      torch_checkpointing's async saver (carried in peers/: `make peers`), overlapckpt window 1,
#      W=8 replay and W=8 stage, 3 checkpoints each, then the other methods in what is left
#      -> RESULTS_DIR/results.{json,md}. Its size is h200-lean (about 440 M parameters, 4.9 GiB of
#      fp32 AdamW state; it fits an H100's 80 GB); GPU_SH_BENCH_SIZE=h200 runs the 1.04 B-parameter
#      size on its own: `GPU_SH_BENCH_SIZE=h200 gpu.sh DIR bench`;
#   2. the correctness check: the CUDA defects the CPU tests found, on the device
#      (benchmarks/gpu_check.py) -> RESULTS_DIR/check.jsonl;
#   3. the pinning probe, then the GPU tests (pytest -m "gpu or device"), a per-test timeout,
#      one line per outcome as it comes -> RESULTS_DIR/tests/; then the torch extension's own
#      tests on this torch and Python -> RESULTS_DIR/tests/passes.log;
#   4. the hooks' host time at 3,000 state tensors on the GPU (benchmarks/hook_scaling.py
#      --schedules cuda), in what is left -> RESULTS_DIR/hook-scaling/.
# Every part after the headline is cut to what is left of TOTAL_BUDGET_S. Each part's start
# (seconds from the start) is in RESULTS_DIR/timeline.log.
# Uses the machine's own python3 and packages, from the source checkout, with no installs.
#
#   benchmarks/gpu.sh RESULTS_DIR [all|probe|bench] [--emulate]     (default: all)
#
# --emulate rehearses the whole flow on the CPU (the emulated device, a tiny benchmark):
# make test runs it, so a plumbing error shows there and not on the device.
# Exits 2 at once if the pre-flight fails or /dev/shm is too small for the benchmark (after
# trying to grow it), 1 if a check, a test or the benchmark failed, else 0. Whatever ran is
# under RESULTS_DIR, even when a later part fails or time runs out.
set -uo pipefail

usage="usage: benchmarks/gpu.sh RESULTS_DIR [all|probe|bench] [--emulate]"
out=${1:?$usage}
what=all
emulate=0
for arg in "${@:2}"; do
  case "$arg" in
    all | probe | bench) what=$arg ;;
    --emulate) emulate=1 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# Nothing installs on the device: pure-Python peers (torch_checkpointing) travel in peers/
# (`make peers`, then the device tool's carry=["peers"]).
[ -d peers ] && export PYTHONPATH=$PYTHONPATH:$(pwd)/peers
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
started=$(date +%s)
elapsed() { echo $(($(date +%s) - started)); }

TOTAL_BUDGET_S=${GPU_SH_BUDGET_S:-460}   # everything; the timeouts below add at most 20 s to it
PREFLIGHT_TIMEOUT_S=60
BUILD_TIMEOUT_S=90
PASSES_TESTS_TIMEOUT_S=60
HOOK_SCALING_TIMEOUT_S=120
CHECK_TIMEOUT_S=90
PINNING_TIMEOUT_S=40
TESTS_TIMEOUT_S=200
PER_TEST_TIMEOUT_S=60
MIN_BENCH_S=90              # less than this left: the benchmark would measure only the baseline
HEADLINE_BUDGET_S=${GPU_SH_HEADLINE_BUDGET_S:-200}  # the headline's share: done about 4 minutes after the start
HOOK_SCALING_RESERVE_S=60   # kept from the benchmark's budget for part 4 (two modes' rows)
BENCH_SIZE=${GPU_SH_BENCH_SIZE:-h200-lean}
# /dev/shm holds every host buffer (overlapckpt's slots, DCP's shared staging): at h200 the
# benchmark needs 32 GB (W=8 replay holds a 12.5 GB slot and a 14.6 GB gradient log, DCP's
# PROCESS staging 12.5 GB), at h200-lean 16 GB; the checks and tests need 8 GB at most (the
# writer-kill test's 4 GB slot). Checkpoints go to tmpfs too when it has room for every
# method's (CKPT_ON_SHM_GB free), so the figures measure the stall and not this machine's disk.
case "$BENCH_SIZE" in
  h200) BENCH_SHM_GB=32; CKPT_ON_SHM_GB=90 ;;
  *) BENCH_SHM_GB=16; CKPT_ON_SHM_GB=45 ;;
esac
TESTS_SHM_GB=8

emulate_flag=()
tests_select=()
# The most seconds a part may take: its own limit, or what is left of the budget.
capped() { local left=$((TOTAL_BUDGET_S - $(elapsed))); [ "$left" -lt "$1" ] && echo $((left > 5 ? left : 5)) || echo "$1"; }
if [ "$emulate" = 1 ]; then
  emulate_flag=(--emulate)
  export OVERLAPCKPT_TEST_DEVICE=emulated
  # The device tests run in make test in full; the rehearsal runs two, to prove the plumbing.
  tests_select=(-k "side_stream_without_host_sync or guard_catches")
  MIN_BENCH_S=10
fi

{
  date -u +"%Y-%m-%d %H:%M UTC"
  if [ "$emulate" = 1 ]; then
    echo "emulated device (a rehearsal on the CPU)"
  else
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current --format=csv
  fi
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "cores $(nproc); open files $(ulimit -n); locked memory $(ulimit -l)"; free -g; df -h /dev/shm /tmp
} >"$out/machine.txt" 2>&1

# 0. Pre-flight (seconds; it stops everything after it), with the native helpers built beside it.
mark() { echo "$1 $(elapsed)" >>"$out/timeline.log"; }
: >"$out/timeline.log"
mark preflight
# The native helpers, built as `make install` builds them, in parallel with the pre-flight: the
# benchmark and the tests then run the code a user's install runs. Not fatal: without a compiler
# the Python twins run, and say so.
timeout "$BUILD_TIMEOUT_S" "$py" -c '
from overlapckpt import cuda_adam_native
from overlapckpt.train.copying import native, tensor_passes
print("native helper:", native.build() or "not built (the Python twin runs)")
print("tensor passes:", tensor_passes.build() or "not built (the Python twins run)")
print("fused Adam replay:", cuda_adam_native.build() or "not built (its torch twin runs)")' >"$out/build.log" 2>&1 &
build_pid=$!
timeout "$PREFLIGHT_TIMEOUT_S" "$py" benchmarks/preflight.py "${emulate_flag[@]}" 2>&1 | tee "$out/preflight.log"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  wait "$build_pid"
  echo "gpu.sh: the pre-flight failed after $(elapsed) s (see $out/preflight.log); nothing else ran" >&2
  exit 2
fi
wait "$build_pid"
echo "native build: exit $? after $(elapsed) s: $(tr '\n' ' ' <"$out/build.log" | tail -c 300)"

shm_free_gb() { df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9; }
rc=0
if [ "$what" != probe ]; then
  # 1. The headline: the stall beside the strongest peers, before anything else. The baseline,
  # then the peers (DCP's PROCESS save with its overlapping DefaultStager, torch_checkpointing's
  # async saver), then overlapckpt window 1, W=8 replay and W=8 stage, then the rest in what is
  # left; --budget-s skips what would not end in time; results are written after every method.
  mark bench
  left=$((TOTAL_BUDGET_S - $(elapsed)))
  [ "$what" = all ] && left=$HEADLINE_BUDGET_S
  if [ "$emulate" = 0 ]; then
    # tmpfs does not check its size until a page is touched: grow it where we may (root), and
    # let DCP's PROCESS checkpointer pass ~600 storages as file descriptors.
    mount -o remount,size=110G /dev/shm 2>/dev/null || true
    ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
  fi
  if [ "$left" -lt "$MIN_BENCH_S" ]; then
    echo "benchmark: not run, ${left} s left of ${TOTAL_BUDGET_S} s (it needs ${MIN_BENCH_S}); run: benchmarks/gpu.sh $out bench" >&2
    rc=1
  elif [ "$emulate" = 0 ] && [ "$(shm_free_gb)" -lt "$BENCH_SHM_GB" ] 2>/dev/null; then
    echo "gpu.sh: /dev/shm has $(shm_free_gb) GB free after trying to grow it, and the $BENCH_SIZE benchmark needs" \
      "${BENCH_SHM_GB} GB (host buffers live there: W=8 replay holds a slot and a gradient log). Give the container more" \
      "(docker run --shm-size=64g, or as root: mount -o remount,size=64G /dev/shm), or run only the checks and tests:" \
      "benchmarks/gpu.sh $out probe" >&2
    exit 2
  else
    if [ "$emulate" = 1 ]; then
      size=(--size micro --device cpu --every 4 --checkpoints 1 --throughput-checkpoints 1 --warmup 2 --quiet-steps 2)
      methods=dcp_async_thread,torch_checkpointing_async,overlapckpt_w1
      ckdir=$out/bench-checkpoints
    else
      size=(--size "$BENCH_SIZE" --device cuda --every 10 --checkpoints 3 --throughput-checkpoints 3 --warmup 3 --windows 8)
      methods=dcp_async_process_overlap,torch_checkpointing_async,overlapckpt_w1,overlapckpt_w8_replay,overlapckpt_w8_stage
      methods=$methods,dcp_async_process,dcp_async_thread,dcp_save,torch_save
      ckdir=/tmp/overlapckpt-bench
      if [ "$(shm_free_gb)" -ge "$CKPT_ON_SHM_GB" ] 2>/dev/null; then
        ckdir=/dev/shm/overlapckpt-bench-ckpt
      fi
    fi
    timeout $((left + 20)) "$py" benchmarks/harness.py "${size[@]}" --methods "$methods" \
      --out "$out" --checkpoint-dir "$ckdir" --budget-s "$left" --timeout-s 120 >"$out/bench.log" 2>&1
    bench_rc=$?
    echo "benchmark: exit $bench_rc after $(elapsed) s ($BENCH_SIZE, checkpoints in $ckdir)"
    [ "$bench_rc" -ne 0 ] && rc=1
    rm -rf "$ckdir"
    cat "$out/results.md" 2>/dev/null
  fi
fi

if [ "$what" != bench ]; then
  # 2. The correctness check of the defects, on the device, after the headline.
  mark check
  timeout "$(capped "$CHECK_TIMEOUT_S")" "$py" benchmarks/gpu_check.py --out "$out/check.jsonl" "${emulate_flag[@]}" >"$out/check.log" 2>&1
  check_rc=$?
  echo "correctness check: exit $check_rc after $(elapsed) s: $(grep -c '"ok": true' "$out/check.jsonl" 2>/dev/null || echo 0) passed"
  [ "$check_rc" -ne 0 ] && rc=1

  # 3. The pinning probe (CUDA only), then the GPU tests, each outcome written as it ends.
  mark tests
  mkdir -p "$out/tests"
  if [ "$emulate" = 0 ]; then
    timeout "$(capped "$PINNING_TIMEOUT_S")" "$py" benchmarks/probe.py --out "$out/tests/pinning.json" >"$out/tests/pinning.log" 2>&1
    echo "pinning check: exit $? after $(elapsed) s: $(tail -1 "$out/tests/pinning.log")"
  fi
  if [ "$emulate" = 0 ] && [ "$(shm_free_gb)" -lt "$TESTS_SHM_GB" ] 2>/dev/null; then
    mount -o remount,size=110G /dev/shm 2>/dev/null || true
  fi
  # The replay arithmetic of every Adam / AdamW path first: seconds, and the exactness claim itself.
  timeout "$(capped "$TESTS_TIMEOUT_S")" "$py" -m pytest -q -m "gpu or device" tests/test_gpu_arithmetic.py tests/test_gpu.py tests/test_gpu_runtime.py "${tests_select[@]}" \
    --per-test-timeout-s "$PER_TEST_TIMEOUT_S" --results-jsonl "$out/tests/results.jsonl" --junitxml="$out/tests/gpu-tests.xml" \
    --gpu-report="$out/tests/gpu-report.json" -p no:cacheprovider >"$out/tests/gpu-tests.log" 2>&1
  tests_rc=$?
  echo "gpu tests: exit $tests_rc after $(elapsed) s: $(tail -1 "$out/tests/gpu-tests.log")"
  [ "$tests_rc" -ne 0 ] && rc=1

  # The torch extension's tests (tensor_passes.cpp and its Python twins, and the staleness check
  # on both) against this machine's torch and Python, which CI never has.
  timeout "$(capped "$PASSES_TESTS_TIMEOUT_S")" "$py" -m pytest -q tests/test_tensor_passes.py tests/test_live_identity.py \
    -p no:cacheprovider >"$out/tests/passes.log" 2>&1
  passes_rc=$?
  echo "extension tests: exit $passes_rc after $(elapsed) s: $(tail -1 "$out/tests/passes.log")"
  [ "$passes_rc" -ne 0 ] && rc=1
fi

if [ "$what" != bench ]; then
  # 4. The hooks' host time per step on the GPU (the copies are the GPU's; this is what the
  # training loop waits for), at 3,000 state tensors, in what is left: after the benchmark,
  # whose figures no earlier run has. The rehearsal runs one tiny row.
  mark hook_scaling
  if [ "$emulate" = 1 ]; then
    scaling=(--tensors 300 --modes w1 --schedules held --cycles 1)
  else
    scaling=(--tensors 3000 --modes stage,w1,replay --schedules cuda --cycles 7)
  fi
  # Without the extension built the hooks take the twins' road: measure that road, named in each row.
  grep -q "^tensor passes: not built" "$out/build.log" && scaling+=(--passes python)
  left=$((TOTAL_BUDGET_S - $(elapsed)))
  [ "$left" -gt "$HOOK_SCALING_TIMEOUT_S" ] && left=$HOOK_SCALING_TIMEOUT_S
  if [ "$left" -lt 20 ]; then
    echo "hook scaling: not run, ${left} s left; run: benchmarks/hook_scaling.py ${scaling[*]} --out $out/hook-scaling" >&2
  else
    timeout "$left" "$py" benchmarks/hook_scaling.py "${scaling[@]}" --out "$out/hook-scaling" >"$out/hook-scaling.log" 2>&1
    scaling_rc=$?
    echo "hook scaling: exit $scaling_rc after $(elapsed) s: $(grep -c '^goal at .*: met' "$out/hook-scaling.log") goal lines met"
    [ "$scaling_rc" -ne 0 ] && rc=1
  fi
fi
df -h /dev/shm >>"$out/machine.txt" 2>&1
echo "gpu.sh: done in $(elapsed) s, exit $rc"
exit $rc
