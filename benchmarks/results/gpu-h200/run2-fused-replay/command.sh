#!/usr/bin/env bash
# Device call 2: the fused-replay fix on the GPU, the measured arithmetic, hook scaling rows with progress.
export PYTHONPATH=. PYTHONUNBUFFERED=1
o=${OUT:?}; s=$(date +%s)
(timeout 60 python3 -c 'from overlapckpt.train.copying import native, tensor_passes; print(native.build()); print(tensor_passes.build())' >"$o/build.log" 2>&1; echo "build rc $? at $(( $(date +%s) - s )) s" >>"$o/build.log") &
timeout 30 python3 -c '
import logging, torch
logging.basicConfig(level=logging.INFO)
from overlapckpt.train.consistency import fused_arithmetic as f
for cls in (torch.optim.AdamW, torch.optim.Adam):
    print(cls.__name__, "->", f.measure(cls, torch.device("cuda")))
' >"$o/arith.log" 2>&1
echo "arith rc $? at $(( $(date +%s) - s )) s"; cat "$o/arith.log"
timeout 100 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_runtime.py -m "gpu or device" -k "fused or batchnorm or replay" \
  --per-test-timeout-s 40 --results-jsonl "$o/results.jsonl" --gpu-report="$o/gpu-report.json" -p no:cacheprovider >"$o/gpu-tests.log" 2>&1
echo "tests rc $? at $(( $(date +%s) - s )) s: $(tail -1 "$o/gpu-tests.log")"
wait; cat "$o/build.log"
timeout 50 python3 benchmarks/hook_scaling.py --tensors 3000 --modes w1,replay,stage --schedules cuda --cycles 7 --out /tmp/hs3000 >"$o/hs3000.log" 2>&1
echo "hs3000 rc $? at $(( $(date +%s) - s )) s"; grep -E "^\|.*cuda" "$o/hs3000.log"
timeout 70 python3 -c "
import faulthandler, sys, runpy
faulthandler.dump_traceback_later(30, repeat=True, file=open('$o/traceback.txt', 'w'))
sys.argv = ['hook_scaling.py', '--one', '30000', 'w1', 'cuda', '--cycles', '7']
runpy.run_path('benchmarks/hook_scaling.py', run_name='__main__')
" >"$o/hs30000.log" 2>&1
echo "hs30000 rc $? at $(( $(date +%s) - s )) s"; tail -c 1500 "$o/hs30000.log"
