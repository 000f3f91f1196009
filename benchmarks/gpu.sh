#!/usr/bin/env bash
# The GPU checks on one H200, in under 8 minutes, in two parts that each write their own results:
#   1. probe (about 3.5 minutes): a pinning check (benchmarks/probe.py), then the GPU tests
#      (tests/test_gpu.py, tests/test_gpu_runtime.py) -> RESULTS_DIR/probe/;
#   2. bench: the h200-size benchmark (about 1.04 B parameters, 12.5 GB of fp32 AdamW
#      state, bf16 autocast, fused AdamW), in what is left of the 460 s -> RESULTS_DIR/.
# Uses the machine's own python3 and packages, from the source checkout, with no installs.
#
#   benchmarks/gpu.sh RESULTS_DIR [all|probe|bench]      (default: all)
#
# Writes RESULTS_DIR/machine.txt; the probe writes probe/pinning.json, probe/pinning.log,
# probe/gpu-tests.log, probe/gpu-tests.xml, probe/gpu-report.json (replay-vs-twin errors,
# copy figures); the benchmark writes bench.log, results.json, results.md, timeline.png.
# Exits 2 at once if /dev/shm is too small for what was asked (after trying to grow it),
# 1 if the GPU tests or the benchmark failed, else 0.
set -uo pipefail

usage="usage: benchmarks/gpu.sh RESULTS_DIR [all|probe|bench]"
out=${1:?$usage}
what=${2:-all}
case "$what" in all | probe | bench) ;; *) echo "$usage" >&2; exit 2 ;; esac
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
started=$(date +%s)
elapsed() { echo $(($(date +%s) - started)); }

TOTAL_BUDGET_S=460          # probe + benchmark; the timeouts below add at most 20 s to it
PINNING_TIMEOUT_S=40
TESTS_TIMEOUT_S=170
MIN_BENCH_S=90              # less than this left: the benchmark would measure only the baseline
# /dev/shm holds every host buffer (overlapckpt's slots, DCP's shared staging). The probe
# needs 8 GB at most at once (the writer-kill test's 4 GB slot, the probe's 2 GiB buffer).
# The benchmark needs 32 GB: W=8 replay holds a 12.5 GB slot and a 14.6 GB gradient log,
# and DCP's PROCESS staging 12.5 GB, a second copy while the previous upload finishes.
PROBE_SHM_GB=8
BENCH_SHM_GB=32

# tmpfs does not check its size until a page is touched: grow it where we may (root), and
# let DCP's PROCESS checkpointer pass ~600 storages as file descriptors.
mount -o remount,size=110G /dev/shm 2>/dev/null || true
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
shm_free_gb=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
shm_free_gb=${shm_free_gb:-0}
need_gb=$BENCH_SHM_GB
[ "$what" = probe ] && need_gb=$PROBE_SHM_GB
if [ "$shm_free_gb" -lt "$need_gb" ]; then
  echo "gpu.sh: /dev/shm has ${shm_free_gb} GB free after trying to grow it, and '$what' needs ${need_gb} GB" \
    "(host buffers live there; the benchmark's W=8 replay alone holds 27 GB). Give the container more" \
    "(docker run --shm-size=64g, or as root: mount -o remount,size=64G /dev/shm), or run only the probe," \
    "which needs ${PROBE_SHM_GB} GB: benchmarks/gpu.sh $out probe" >&2
  exit 2
fi

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current --format=csv
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "cores $(nproc); open files $(ulimit -n); locked memory $(ulimit -l)"; free -g; df -h /dev/shm /tmp
} >"$out/machine.txt" 2>&1

rc=0
if [ "$what" != bench ]; then
  # 1. The probe. The pinning check first: quick, and its figures stand even if a test hangs.
  mkdir -p "$out/probe"
  timeout "$PINNING_TIMEOUT_S" "$py" benchmarks/probe.py --out "$out/probe/pinning.json" >"$out/probe/pinning.log" 2>&1
  echo "pinning check: exit $? after $(elapsed) s: $(tail -1 "$out/probe/pinning.log")"
  timeout "$TESTS_TIMEOUT_S" "$py" -m pytest -q -m gpu tests/test_gpu.py tests/test_gpu_runtime.py \
    --junitxml="$out/probe/gpu-tests.xml" --gpu-report="$out/probe/gpu-report.json" -p no:cacheprovider \
    >"$out/probe/gpu-tests.log" 2>&1
  tests_rc=$?
  echo "gpu tests: exit $tests_rc after $(elapsed) s: $(tail -1 "$out/probe/gpu-tests.log")"
  [ "$tests_rc" -ne 0 ] && rc=1
fi

if [ "$what" != probe ]; then
  # 2. The benchmark. Checkpoints go to tmpfs when it has room for them beside the host
  # buffers (about 65 GB in the widest replay window), so the figures measure the
  # device-to-host stall and not this machine's disk. The methods the targets are judged
  # on run first, right after the baseline: DCP's PROCESS async save, then W=8 replay and
  # stage; --budget-s skips what would not end in time, and results are written after
  # every method.
  left=$((TOTAL_BUDGET_S - $(elapsed)))
  if [ "$left" -lt "$MIN_BENCH_S" ]; then
    echo "benchmark: not run, ${left} s left of ${TOTAL_BUDGET_S} s (it needs ${MIN_BENCH_S}); run: benchmarks/gpu.sh $out bench" >&2
    rc=1
  else
    ckdir=/tmp/overlapckpt-bench
    if [ "$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -ge 90 ] 2>/dev/null; then
      ckdir=/dev/shm/overlapckpt-bench-ckpt
    fi
    methods=dcp_async_process,overlapckpt_w8_replay,overlapckpt_w8_stage,overlapckpt_w1,overlapckpt_w4_stage
    methods=$methods,overlapckpt_w4_replay,dcp_async_process_overlap,dcp_async_thread,dcp_save,torch_save
    timeout $((left + 20)) "$py" benchmarks/harness.py --size h200 --device cuda --every 10 --checkpoints 2 \
      --throughput-checkpoints 2 --warmup 3 --windows 4,8 --methods "$methods" \
      --out "$out" --checkpoint-dir "$ckdir" --budget-s "$left" --timeout-s 120 >"$out/bench.log" 2>&1
    bench_rc=$?
    echo "benchmark: exit $bench_rc after $(elapsed) s (checkpoints in $ckdir)"
    [ "$bench_rc" -ne 0 ] && rc=1
    rm -rf "$ckdir"
    cat "$out/results.md" 2>/dev/null
  fi
fi
df -h /dev/shm >>"$out/machine.txt" 2>&1
exit $rc
