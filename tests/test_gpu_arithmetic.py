"""On a real GPU: each Adam / AdamW configuration users run is replayed bit for bit, as the probe measures it.

The CPU tests (test_replay_arithmetic.py) hold the probe to stand-in devices; here the device is
CUDA itself. Each case builds param groups on the GPU as a user would and asks the training
side's measurement (replay_arithmetic.group_arithmetics): an Adam / AdamW on the fused, foreach
and capturable foreach paths must be matched by one of the emulations, bit for bit over the
probe's step counts (1 to 3, 9,999 and 10,000), odd length and subnormal gradients. Every case's
records go to the ``--gpu-report`` file (benchmarks/gpu.sh), exact or not.
"""

from __future__ import annotations

import pytest
import torch

from overlapckpt.train.consistency import replay_arithmetic

from gpu_support import report_to

pytestmark = pytest.mark.gpu

CASES = {
    "adamw-foreach-default": (torch.optim.AdamW, {}),
    "adamw-foreach-bf16": (torch.optim.AdamW, {"dtype": torch.bfloat16}),
    "adamw-foreach-fp16": (torch.optim.AdamW, {"dtype": torch.float16}),
    "adam-foreach-l2": (torch.optim.Adam, {"weight_decay": 0.01}),
    "adamw-foreach-amsgrad-maximize": (torch.optim.AdamW, {"amsgrad": True, "maximize": True}),
    "adamw-foreach-capturable": (torch.optim.AdamW, {"capturable": True}),
    "adam-foreach-capturable-l2-amsgrad": (torch.optim.Adam, {"capturable": True, "weight_decay": 0.01, "amsgrad": True}),
    "adamw-fused": (torch.optim.AdamW, {"fused": True}),
    "adam-fused-l2": (torch.optim.Adam, {"fused": True, "weight_decay": 0.01}),
    "adamw-fused-bf16-amsgrad": (torch.optim.AdamW, {"fused": True, "dtype": torch.bfloat16, "amsgrad": True}),
    "adamw-fused-betas-0.95": (torch.optim.AdamW, {"fused": True, "betas": (0.9, 0.95)}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_adam_configuration_is_replayed_bit_for_bit(request, monkeypatch, case):
    monkeypatch.setattr(replay_arithmetic, "_measured", {})  # measured here, not taken from an earlier case
    cls, options = CASES[case]
    options = dict(options)
    dtype = options.pop("dtype", torch.float32)
    params = [torch.nn.Parameter(torch.zeros(5, device="cuda", dtype=dtype))]
    optimizer = cls(params, lr=1e-3, **options)
    records, powers = replay_arithmetic.group_arithmetics(cls, optimizer.param_groups)
    (record,) = records
    report_to(request, f"arithmetic_{case}", {**record.to_json(), "power_tables": len(powers.tables)})
    assert record.exact, record.describe()
    assert record.arithmetic is not None, record.describe()  # an emulation, not the CPU's own kernel
