"""CUDA's foreach Adam / AdamW arithmetic on the CPU (foreach_adam_math.py), held to exact rational arithmetic.

The reference below is ``_multi_tensor_adam``'s kernels, one element at a time: each float32
operation rounded once from its exact value (subnormals included), each FMA rounded once,
the host's float64 scalars cast to float32, and a bfloat16 or float16 state rounded to its
dtype after every kernel. The emulation must equal it bit for bit; and it is not what the
CPU's own foreach kernels compute, which is why replay cannot use them for a GPU's steps.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from exact_float import f32, fma32

from overlapckpt.foreach_adam_math import step_like_cuda_foreach_adam

LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8


def _as(dtype: torch.dtype):
    def store(x: float) -> float:
        return float(torch.tensor(x, dtype=torch.float32).to(dtype).float())

    return store


def _reference(p: float, g: float, m: float, v: float, vmax: float | None, count: int, weight_decay: float,
               decoupled: bool, maximize: bool, dtype: torch.dtype) -> tuple[float, float, float, float | None]:
    st = _as(dtype)
    if maximize:
        g = -g
    if weight_decay != 0:
        if decoupled:
            p = st(f32(Fraction(p) * Fraction(f32(1 - LR * weight_decay))))
        else:
            g = st(fma32(f32(weight_decay), p, g))
    w = f32(1 - BETA1)
    difference = f32(Fraction(g) - Fraction(m))
    m = st(fma32(w, difference, m) if abs(w) < 0.5 else fma32(-difference, f32(1 - Fraction(w)), g))
    v = st(f32(Fraction(v) * Fraction(f32(BETA2))))
    v = st(fma32(f32(1 - BETA2), f32(Fraction(g) * Fraction(g)), v))
    peak = v if vmax is None else max(vmax, v)
    denominator = st(f32(math.sqrt(peak)))  # a float64 sqrt of a float32 value rounds to float32 as the exact one
    denominator = st(f32(Fraction(denominator) / Fraction(f32((1 - BETA2**count) ** 0.5))))
    denominator = st(f32(Fraction(denominator) + Fraction(f32(EPS))))
    quotient = f32(Fraction(m) / Fraction(denominator))
    p = st(fma32(f32((LR / (1 - BETA1**count)) * -1), quotient, p))
    return p, m, v, (None if vmax is None else peak)


def _state(elements: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    start = (torch.randn(elements, generator=generator) * torch.logspace(-3, 1, elements)).to(dtype)
    # float16 holds nothing below 6e-8: smaller gradients would leave v at 0 and divide by an eps that rounds to 0
    # (inf, as on the device), which exact arithmetic cannot compare.
    smallest = -1 if dtype == torch.float16 else -6
    grads = [(torch.randn(elements, generator=generator) * torch.logspace(smallest, 0, elements)).to(dtype) for _ in range(3)]
    if dtype == torch.float32:
        grads[0][:3] = torch.tensor([1e-40, -3e-39, 0.0])  # subnormal gradients, and an exact zero
    return start, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "weight_decay, decoupled, maximize, amsgrad",
    [(0.01, True, False, False), (0.01, False, False, False), (0.0, True, True, False), (0.01, True, False, True)],
    ids=["adamw", "adam-l2", "maximize", "amsgrad"],
)
def test_the_emulation_is_cudas_foreach_kernels_with_one_rounding_per_operation(dtype, weight_decay, decoupled, maximize, amsgrad):
    elements = 67  # odd: no vector width divides it
    start, grads = _state(elements, seed=1, dtype=dtype)
    param, exp_avg, exp_avg_sq = start.clone(), torch.zeros(elements, dtype=dtype), torch.zeros(elements, dtype=dtype)
    max_sq = torch.zeros(elements, dtype=dtype) if amsgrad else None
    step = torch.zeros(())
    reference = [(float(p), 0.0, 0.0, 0.0 if amsgrad else None) for p in start.float()]
    for count, g in enumerate(grads, start=1):
        step_like_cuda_foreach_adam(
            [param], [g], [exp_avg], [exp_avg_sq], None if max_sq is None else [max_sq], [step], lr=LR, beta1=BETA1, beta2=BETA2,
            weight_decay=weight_decay, eps=EPS, maximize=maximize, decoupled_weight_decay=decoupled,
        )
        reference = [
            _reference(p, float(gi), m, v, vmax, count, weight_decay, decoupled, maximize, dtype)
            for (p, m, v, vmax), gi in zip(reference, g.float())
        ]
    assert float(step) == 3.0
    columns = [(param, 0), (exp_avg, 1), (exp_avg_sq, 2)] + ([(max_sq, 3)] if max_sq is not None else [])
    for got, column in columns:
        expected = torch.tensor([r[column] for r in reference], dtype=torch.float32).to(dtype)
        assert torch.equal(got, expected), (column, (got != expected).nonzero()[:5].flatten().tolist())


def test_the_cpus_own_foreach_kernels_round_otherwise():
    """Why replay cannot step a GPU's foreach AdamW with the CPU's kernels: the CPU does not contract addcmul, addcdiv
    and lerp into FMAs, so thousands of elements come back an ulp or more apart after 3 steps."""
    start, grads = _state(4096, seed=2, dtype=torch.float32)
    param, exp_avg, exp_avg_sq, step = start.clone(), torch.zeros(4096), torch.zeros(4096), torch.zeros(())
    cpu_param = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.AdamW([cpu_param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=0.01, foreach=True)
    for g in grads:
        step_like_cuda_foreach_adam([param], [g], [exp_avg], [exp_avg_sq], None, [step], lr=LR, beta1=BETA1, beta2=BETA2,
                                    weight_decay=0.01, eps=EPS, maximize=False, decoupled_weight_decay=True)
        cpu_param.grad = g.clone()
        optimizer.step()
    differing = int((optimizer.state[cpu_param]["exp_avg_sq"] != exp_avg_sq).sum())
    assert 0 < differing < 4096


def test_a_strided_tensor_steps_as_its_contiguous_copy():
    start, grads = _state(64, seed=3, dtype=torch.float32)
    results = []
    for strided in (False, True):
        param = start.view(8, 8).t().contiguous().t() if strided else start.view(8, 8).clone()
        assert param.is_contiguous() != strided
        exp_avg, exp_avg_sq, step = torch.zeros_like(param), torch.zeros_like(param), torch.zeros(())
        for g in grads:
            step_like_cuda_foreach_adam([param], [g.view(8, 8)], [exp_avg], [exp_avg_sq], None, [step], lr=LR, beta1=BETA1,
                                        beta2=BETA2, weight_decay=0.01, eps=EPS, maximize=False, decoupled_weight_decay=True)
        results.append((param.clone(), exp_avg.clone(), exp_avg_sq.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_double_state_is_refused_by_name():
    double = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="in double, not as emulated here"):
        step_like_cuda_foreach_adam([double], [double], [double], [double], None, [torch.zeros(())], lr=LR, beta1=BETA1,
                                    beta2=BETA2, weight_decay=0.0, eps=EPS, maximize=False, decoupled_weight_decay=True)
