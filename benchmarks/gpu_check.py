"""The GPU run's one-minute correctness check: the CUDA defects the CPU tests found, confirmed on the device.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out RESULTS_DIR/check.jsonl [--emulate]

Each check trains a small model with a Checkpointer through the real device seam
(``CudaDevice``; with ``--emulate``, the emulated device with torch's CUDA placement, which
is how ``make test`` rehearses this script) and compares the result with what it must be.
One JSON line per check is appended to ``--out`` as it ends, so a run cut short keeps the
checks before the cut. Exits 1 if any check failed. The CPU tests that specify each
behaviour are named in each check's docstring.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), os.path.join(os.path.dirname(_HERE), "tests")]

from overlapckpt import load  # noqa: E402
from overlapckpt.hostbuf import SharedHostBuffer  # noqa: E402
from overlapckpt.seams import Checkpointer, engine_of  # noqa: E402
from overlapckpt.train.copying.emulated_device import EmulatedDevice, torch_cuda_placement  # noqa: E402
from overlapckpt.train.copying.stream_copier import StreamCopier  # noqa: E402

from gpu_support import flat_state, mismatches  # noqa: E402  (the GPU tests' own comparisons)


class Target:
    """The device the checks run on, and how each check builds its copier."""

    def __init__(self, emulate: bool) -> None:
        self.emulate = emulate
        self.device = torch.device("cpu" if emulate else "cuda")

    def copier(self, opt: torch.optim.Optimizer, schedule: str = "async") -> StreamCopier:
        if self.emulate:
            return StreamCopier(EmulatedDevice(schedule, clone_is_cheap=True, host_resident=torch_cuda_placement(opt)))
        from overlapckpt.train.copying.cuda_device import CudaDevice

        return StreamCopier(CudaDevice(self.device))

    def synchronize(self) -> None:
        if not self.emulate:
            torch.cuda.synchronize()


def _model(target: Target, width: int, depth: int, bias: bool = True, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    with torch.device(target.device):
        return nn.Sequential(*[nn.Linear(width, width, bias=bias) for _ in range(depth)])


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def check_step_counters(target: Target, root: str) -> dict[str, Any]:
    """Defect 1 (tests/test_transfer.py): AdamW's host-resident step counters inside a packed copy."""

    def make():
        model = _model(target, 64, 3)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    model, opt = make()
    x = torch.randn(16, 64, device=target.device)
    _step(model, opt, x)  # the state exists for load()'s target too
    with Checkpointer(model, opt, root, copier=target.copier(opt)) as ckpt:
        for _ in range(4):
            _step(model, opt, x)
        ckpt.request()
        expected = flat_state(model, opt)
        _step(model, opt, x)
        (info,) = ckpt.wait(timeout_s=120)
    fresh, fresh_opt = make()
    _step(fresh, fresh_opt, x)
    load(root, fresh, fresh_opt, step=info.step)
    bad = sorted(mismatches(flat_state(fresh, fresh_opt), expected))
    # Where the live step counter is: on the host for a non-fused AdamW on CUDA, the case this checks.
    on_host = opt.state[model[0].bias]["step"].device.type == "cpu"
    return {"ok": not bad, "differ": bad, "step_counter_on_host": on_host}


def check_replay_clone_memory(target: Target, root: str) -> dict[str, Any]:
    """Defect 2 (tests/test_transfer.py): replay holds one step's gradient clones, not the window's."""
    width = 1024 if not target.emulate else 256
    layer_bytes = width * width * 4

    def make():
        model = _model(target, width, 4, bias=False)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=not target.emulate, foreach=target.emulate or None)

    model, opt = make()
    # Eager on the emulated device: every copy has landed by the next poll, so the figure is
    # the clones' lifetime, not a loaded CPU's worker speed (on CUDA the DMA is that fast).
    copier = target.copier(opt, schedule="eager")
    x = torch.randn(8, width, device=target.device)
    with Checkpointer(model, opt, root, window=4, consistency="replay", copier=copier) as ckpt:
        _step(model, opt, x)
        ckpt.request()
        ckpt.step()
        target.synchronize()
        copier.device.reset_peak()
        held = copier.device.memory_allocated()
        for _ in range(3):
            _step(model, opt, x)
            ckpt.step()
        target.synchronize()
        peak = copier.device.max_memory_allocated() - held
        ckpt.wait(timeout_s=120)
    # On CUDA the loop's own gradients (4 layers) are device memory too; one layer of slack
    # for activations and workspace. One step's clones are 3 layers (step 4 logs groups 0..2);
    # held until the window landed they were 1 + 2 + 3 = 6.
    gradients = 0 if target.emulate else 4 * layer_bytes
    allowed = 3 * layer_bytes + gradients + layer_bytes
    return {"ok": peak <= allowed, "window_peak_bytes": peak, "allowed_bytes": allowed,
            "held_until_window_landed_bytes": 6 * layer_bytes + gradients}


def check_stage_region(target: Target, root: str) -> dict[str, Any]:
    """Defects 3 and 4 (tests/test_staging.py): one staging region, allocated once, outside the checkpoints."""

    def make():
        model = _model(target, 256, 4, bias=False)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    model, opt = make()
    x = torch.randn(8, 256, device=target.device)
    regions = set()
    with Checkpointer(model, opt, root, window=4, consistency="stage", every=2, max_inflight=2, copier=target.copier(opt)) as ckpt:
        for _ in range(12):
            _step(model, opt, x)
            ckpt.step()
            region = engine_of(ckpt).parts.staging.region
            if region is not None:
                regions.add(region.data_ptr())
        infos = ckpt.wait(timeout_s=120)
    return {"ok": len(regions) == 1 and len(infos) >= 2, "regions_seen": len(regions), "committed": [i.step for i in infos]}


def check_unowned_parameter(target: Target, root: str) -> dict[str, Any]:
    """Defect 6 (tests/test_multistep.py): a parameter no optimizer owns, under W=3 replay."""
    model = _model(target, 64, 2)
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "1.bias"], lr=1e-2, foreach=True)
    x = torch.randn(8, 64, device=target.device)
    frozen = model[1].bias.detach().cpu().clone()
    with Checkpointer(model, opt, root, window=3, consistency="replay", copier=target.copier(opt)) as ckpt:
        for s in range(1, 7):
            _step(model, opt, x)
            if s == 2:
                ckpt.request()
            ckpt.step()
        (info,) = ckpt.wait(timeout_s=120)
    fresh = _model(target, 64, 2, seed=3)
    fresh_opt = torch.optim.AdamW([p for n, p in fresh.named_parameters() if n != "1.bias"], lr=1e-2, foreach=True)
    _step(fresh, fresh_opt, x)
    load(root, fresh, fresh_opt, step=info.step)
    return {"ok": info.step == 4 and torch.equal(fresh[1].bias.detach().cpu(), frozen), "step": info.step}


def check_training_stream(target: Target, root: str) -> dict[str, Any]:
    """Defect 10 (tests/test_transfer.py): a request() outside the loop's stream context waits for that stream."""

    def make():
        model = _model(target, 512 if not target.emulate else 64, 2)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

    model, opt = make()
    x = torch.randn(8, model[0].in_features, device=target.device)
    _step(model, opt, x)
    copier = target.copier(opt, schedule="held")
    training = copier.device.new_stream()
    with Checkpointer(model, opt, root, copier=copier) as ckpt:
        with copier.device.stream_context(training):
            _step(model, opt, x)
            weight = model[0].weight.detach()
            # A write still queued on the training stream when request() comes (an update kernel, here).
            if target.emulate:
                training.enqueue(lambda: weight.add_(1.0))
            else:
                torch.cuda._sleep(int(0.05 * 1.98e9))  # ~50 ms ahead of the write on that stream
                weight.add_(1.0)
        ckpt.request()
        (info,) = ckpt.wait(timeout_s=120)
        target.synchronize()
        expected = model[0].weight.detach().cpu().clone()
    fresh, fresh_opt = make()
    _step(fresh, fresh_opt, x)
    load(root, fresh, fresh_opt, step=info.step)
    return {"ok": torch.equal(fresh[0].weight.detach().cpu(), expected)}


def check_unreleased_buffer(target: Target, root: str) -> dict[str, Any]:
    """Defect 9 (tests/test_buffers.py): a host buffer dropped without release() is unregistered."""
    copier = target.copier(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    buffer = SharedHostBuffer(1 << 24, pin=copier.device)
    address = buffer.tensor.data_ptr()
    del buffer
    gc.collect()
    if target.emulate:
        return {"ok": address not in copier.device.registered}
    error = int(torch.cuda.cudart().cudaHostUnregister(address))  # 713: not registered, as it must be
    return {"ok": error != 0, "unregister_again_error": error}


CHECKS: dict[str, Callable[[Target, str], dict[str, Any]]] = {
    "step_counters": check_step_counters,
    "replay_clone_memory": check_replay_clone_memory,
    "stage_region": check_stage_region,
    "unowned_parameter": check_unowned_parameter,
    "training_stream": check_training_stream,
    "unreleased_buffer": check_unreleased_buffer,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON-lines file to append each check's result to")
    parser.add_argument("--emulate", action="store_true", help="run on the emulated device (the CPU rehearsal)")
    parser.add_argument("--only", default=None, help="comma-separated check names")
    args = parser.parse_args(argv)
    target = Target(args.emulate)
    names = args.only.split(",") if args.only else list(CHECKS)
    failed = 0
    for name in names:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as root:
            try:
                result = CHECKS[name](target, root)
            except Exception as e:  # a check that raises is a failed check, and the next one still runs
                result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
        result = {"check": name, **result, "seconds": round(time.perf_counter() - started, 2)}
        failed += not result["ok"]
        with open(args.out, "a") as f:
            f.write(json.dumps(result, default=str) + "\n")
        print(f"gpu_check: {name}: {'ok' if result['ok'] else 'FAILED'} ({result['seconds']} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
