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

from overlapckpt import cuda_adam_native
from overlapckpt.adam_step_arguments import AdamGroupTensors, AdamHyperparameters
from overlapckpt.beta_powers import BetaPowerTables, table_length
from overlapckpt.foreach_adam_math import step_like_cuda_foreach_adam

from tensor_roads import ROADS, take_cuda_adam_road

LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8


@pytest.fixture(autouse=True, params=ROADS)
def road(request, monkeypatch):
    """Every test on both roads: the C loop (csrc/cuda_adam.c, contiguous float32) and its torch twin."""
    return take_cuda_adam_road(request.param, monkeypatch)


def _as(dtype: torch.dtype):
    def store(x: float) -> float:
        return float(torch.tensor(x, dtype=torch.float32).to(dtype).float())

    return store


def _cpu_power(beta: float, count: int) -> float:
    """float32 pow on the CPU: the powers the emulation takes where no device table is given."""
    return float(torch.tensor(beta, dtype=torch.float32).pow(torch.tensor(float(count))))


def _reference(p: float, g: float, m: float, v: float, vmax: float | None, count: int, weight_decay: float,
               decoupled: bool, maximize: bool, dtype: torch.dtype, capturable: bool = False,
               power=_cpu_power) -> tuple[float, float, float, float | None]:
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
    if capturable:  # _foreach_pow(beta, steps), sub_(1), neg_, div_(lr), reciprocal_, sqrt_: float32 on the device
        bias_correction1 = f32(Fraction(power(BETA1, count)) - 1)
        bias_correction2 = -f32(Fraction(power(BETA2, count)) - 1)
        step_size = f32(1 / Fraction(f32(Fraction(bias_correction1) / Fraction(f32(LR)))))
        bias_correction2_sqrt = f32(math.sqrt(bias_correction2))
    else:  # the host's float64 values, cast to float32
        step_size = f32((LR / (1 - BETA1**count)) * -1)
        bias_correction2_sqrt = f32((1 - BETA2**count) ** 0.5)
    denominator = st(f32(math.sqrt(peak)))  # a float64 sqrt of a float32 value rounds to float32 as the exact one
    denominator = st(f32(Fraction(denominator) / Fraction(bias_correction2_sqrt)))
    denominator = st(f32(Fraction(denominator) + Fraction(f32(EPS))))
    if capturable:
        denominator = st(f32(Fraction(denominator) / Fraction(step_size)))
    quotient = f32(Fraction(m) / Fraction(denominator))
    if capturable:
        p = st(f32(Fraction(p) + Fraction(quotient)))
    else:
        p = st(fma32(step_size, quotient, p))
    return p, m, v, (None if vmax is None else peak)


def _state(elements: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    start = (torch.randn(elements, generator=generator) * torch.logspace(-3, 1, elements)).to(dtype)
    # float16 holds nothing below 6e-8: smaller gradients would leave v at 0 and divide by an eps that rounds to 0
    # (inf, as on the device), which exact arithmetic cannot compare.
    smallest = -1 if dtype == torch.float16 else -6
    grads = [torch.randn(elements, generator=generator) for _ in range(3)]
    if dtype == torch.float16:  # and no normal draw near 0 either: |g| >= 0.01 keeps (1 - beta2) g^2 above 6e-8
        grads = [g.sign() * g.abs().clamp(min=0.1) for g in grads]
    grads = [(g * torch.logspace(smallest, 0, elements)).to(dtype) for g in grads]
    if dtype == torch.float32:
        grads[0][:3] = torch.tensor([1e-40, -3e-39, 0.0])  # subnormal gradients, and an exact zero
    return start, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "weight_decay, decoupled, maximize, amsgrad, capturable",
    [(0.01, True, False, False, False), (0.01, False, False, False, False), (0.0, True, True, False, False),
     (0.01, True, False, True, False), (0.01, True, False, False, True), (0.01, False, True, True, True)],
    ids=["adamw", "adam-l2", "maximize", "amsgrad", "capturable", "capturable-adam-l2-maximize-amsgrad"],
)
def test_the_emulation_is_cudas_foreach_kernels_with_one_rounding_per_operation(dtype, weight_decay, decoupled, maximize, amsgrad,
                                                                               capturable):
    elements = 67  # odd: no vector width divides it
    start, grads = _state(elements, seed=1, dtype=dtype)
    param, exp_avg, exp_avg_sq = start.clone(), torch.zeros(elements, dtype=dtype), torch.zeros(elements, dtype=dtype)
    max_sq = torch.zeros(elements, dtype=dtype) if amsgrad else None
    step = torch.zeros(())
    reference = [(float(p), 0.0, 0.0, 0.0 if amsgrad else None) for p in start.float()]
    for count, g in enumerate(grads, start=1):
        step_like_cuda_foreach_adam(
            AdamGroupTensors([param], [g], [exp_avg], [exp_avg_sq], None if max_sq is None else [max_sq], [step]),
            AdamHyperparameters(
                lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=weight_decay, eps=EPS, maximize=maximize, decoupled_weight_decay=decoupled,
            ),
            capturable=capturable,
        )
        reference = [
            _reference(p, float(gi), m, v, vmax, count, weight_decay, decoupled, maximize, dtype, capturable)
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
        step_like_cuda_foreach_adam(
            AdamGroupTensors([param], [g], [exp_avg], [exp_avg_sq], None, [step]),
            AdamHyperparameters(lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=0.01, eps=EPS, maximize=False, decoupled_weight_decay=True),
        )
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
            step_like_cuda_foreach_adam(
                AdamGroupTensors([param], [g.view(8, 8)], [exp_avg], [exp_avg_sq], None, [step]),
                AdamHyperparameters(
                    lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=0.01, eps=EPS, maximize=False, decoupled_weight_decay=True,
                ),
            )
        results.append((param.clone(), exp_avg.clone(), exp_avg_sq.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_double_state_is_refused_by_name():
    double = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="in double, not as emulated here"):
        step_like_cuda_foreach_adam(
            AdamGroupTensors([double], [double], [double], [double], None, [torch.zeros(())]),
            AdamHyperparameters(lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=0.0, eps=EPS, maximize=False, decoupled_weight_decay=True),
        )


@pytest.mark.parametrize("decoupled, maximize, amsgrad, weight_decay, betas", [
    (True, False, False, 0.01, (0.9, 0.999)), (False, True, True, 0.01, (0.9, 0.999)), (True, True, True, 0.0, (0.9, 0.999)),
    (False, False, False, 0.1, (0.3, 0.45)),  # 1 - beta1 above one half: lerp's other formula
])
def test_the_c_loop_and_its_torch_twin_agree_bit_for_bit(monkeypatch, road, decoupled, maximize, amsgrad, weight_decay, betas):
    """Tens of thousands of elements over many decades, with subnormals, zeros, infinities and NaNs: the C pass and the
    torch twin give the same bits (the reference above holds each on a few dozen)."""
    if road == "python":
        pytest.skip("compares the two roads: run once, on the native one")
    generator = torch.Generator().manual_seed(7)
    n = 40_001
    start = torch.randn(n, generator=generator) * torch.logspace(-30, 30, n)
    grads = [torch.randn(n, generator=generator) * torch.logspace(-42, 20, n) for _ in range(3)]
    grads[0][:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-45])
    states = []
    for native in ("1", "0"):
        monkeypatch.setenv("OVERLAPCKPT_NATIVE", native)
        state = [start.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(())]
        for g in grads:
            step_like_cuda_foreach_adam(
                AdamGroupTensors([state[0]], [g], [state[1]], [state[2]], [state[3]] if amsgrad else None, [state[4]]),
                AdamHyperparameters(
                    lr=LR, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=EPS, maximize=maximize,
                    decoupled_weight_decay=decoupled,
                ),
            )
        states.append(state)
    for c_pass, twin in zip(*states):
        # Bit for bit, -0.0 apart from 0.0; a NaN's sign and payload are the hardware's (CUDA writes its own canonical
        # one), so NaNs are compared by place.
        assert torch.equal(c_pass.isnan(), twin.isnan())
        zero = torch.zeros(())
        assert torch.equal(torch.where(c_pass.isnan(), zero, c_pass).view(torch.int32), torch.where(twin.isnan(), zero, twin).view(torch.int32))


def test_capturable_bias_corrections_take_the_devices_powers_from_its_table():
    """A device whose powf rounds beta^t an ulp above the CPU's: with that device's table, the emulation is its arithmetic
    (the reference with the same powers), and without it, not."""
    def device_power(beta: float, count: int) -> float:
        cpu = torch.tensor(_cpu_power(beta, count), dtype=torch.float32)
        return float(torch.nextafter(cpu, torch.tensor(2.0)))

    powers = BetaPowerTables()
    for beta in (BETA1, BETA2):
        powers.add(beta, torch.tensor([device_power(beta, k) for k in range(1, table_length(beta) + 1)], dtype=torch.float32))
    start, grads = _state(67, seed=4, dtype=torch.float32)
    results = {}
    for table in (powers, None):
        param, exp_avg, exp_avg_sq, step = start.clone(), torch.zeros(67), torch.zeros(67), torch.zeros(())
        for g in grads:
            step_like_cuda_foreach_adam(
                AdamGroupTensors([param], [g], [exp_avg], [exp_avg_sq], None, [step]),
                AdamHyperparameters(
                    lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=0.01, eps=EPS, maximize=False, decoupled_weight_decay=True,
                ),
                capturable=True, powers=table,
            )
        results[table is None] = param
    reference = [(float(p), 0.0, 0.0, None) for p in start]
    for count, g in enumerate(grads, start=1):
        reference = [_reference(p, float(gi), m, v, None, count, 0.01, True, False, torch.float32, True, device_power)
                     for (p, m, v, _), gi in zip(reference, g)]
    assert torch.equal(results[False], torch.tensor([r[0] for r in reference], dtype=torch.float32))
    assert not torch.equal(results[False], results[True])


def test_a_power_table_holds_the_devices_values_and_the_cpus_past_its_end():
    for beta in (0.9, 0.999):  # out to where beta^k is below 2^-26, and no further than a step past it
        n = table_length(beta)
        beta32 = float(torch.tensor(beta, dtype=torch.float32))
        assert beta32 ** (n - 1) < 2**-26 <= beta32 ** (n - 3)
    assert table_length(1.0) == 0 and table_length(0.0) == 0
    values = torch.arange(1, 174, dtype=torch.float32)  # not powers at all: only where they come from is checked
    powers = BetaPowerTables()
    powers.add(0.9, values)
    beta = torch.tensor(0.9, dtype=torch.float32)
    assert torch.equal(powers.power(beta, torch.tensor(5.0)), torch.tensor(5.0))
    assert torch.equal(powers.power(beta, torch.tensor(174.0)), beta.pow(torch.tensor(174.0)))  # past the table
    assert torch.equal(powers.power(torch.tensor(0.8), torch.tensor(5.0)), torch.tensor(0.8).pow(torch.tensor(5.0)))  # no table
    assert BetaPowerTables(powers.tables).power(beta, torch.tensor(173.0)) == 173.0  # as the replay log carries it


@pytest.mark.parametrize("path", ["fused", "foreach"])
def test_a_large_tensor_split_across_the_writers_threads_gives_the_same_bits(monkeypatch, road, path):
    """The C pass splits a large tensor into chunks on the writer's threads; elementwise, so the bits are one call's."""
    if road == "python":
        pytest.skip("the split is the C pass's")
    from overlapckpt.fused_adam_math import step_like_cuda_fused_adam

    step_like = step_like_cuda_fused_adam if path == "fused" else step_like_cuda_foreach_adam
    monkeypatch.setattr(cuda_adam_native, "PARALLEL_MIN_ELEMENTS", 1000)
    generator = torch.Generator().manual_seed(11)
    n = 10_007  # three threads: chunks of 3,392 aligned to 64 elements, the last one short
    start = torch.randn(n, generator=generator)
    grads = [torch.randn(n, generator=generator) * torch.logspace(-8, 0, n) for _ in range(3)]
    states = []
    for threads in (1, 3):
        monkeypatch.setattr(cuda_adam_native, "_threads", lambda threads=threads: threads)
        state = [start.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(())]
        for g in grads:
            step_like(
                AdamGroupTensors([state[0]], [g], [state[1]], [state[2]], [state[3]], [state[4]]),
                AdamHyperparameters(
                    lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=0.01, eps=EPS, maximize=False, decoupled_weight_decay=True,
                ),
            )
        states.append(state)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(*states))
    assert not torch.equal(states[0][0], start)  # the C pass ran: the parameters moved
