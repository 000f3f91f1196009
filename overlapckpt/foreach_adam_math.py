"""CUDA's foreach Adam / AdamW step, computed on the CPU: the arithmetic replay needs for the optimizer CUDA runs by default.

``torch.optim.AdamW`` on CUDA takes the foreach path (``torch/optim/adam.py``,
``_multi_tensor_adam``, non-capturable): a sequence of ``torch._foreach_*`` kernels. Replayed
with the CPU's foreach kernels, an H200 run came back bit-identical in 92.29% of parameters
and 90.84% of ``exp_avg_sq`` (``benchmarks/results/gpu-h200/``), because the two devices round
differently. CUDA's foreach functors (``ATen/native/cuda/ForeachFunctors.cuh``) compute in
float32 (``opmath``) with every scalar cast to float32, and nvcc contracts
``self + s * op(a, b)`` and ``lerp`` into FMAs:

==========================================  =============================================
``_foreach_mul_(p, 1 - lr * wd)`` (AdamW)   ``p = rn(p * f32(1 - lr*wd))``
``_foreach_add(g, p, alpha=wd)`` (Adam L2)  ``g = fma(f32(wd), p, g)``
``_foreach_lerp_(m, g, 1 - beta1)``         ``m = fma(w, rn(g - m), m)`` for ``w < 0.5``, else
                                            ``m = fma(-rn(g - m), rn(1 - w), g)``
``_foreach_mul_(v, beta2)``                 ``v = rn(v * f32(beta2))``
``_foreach_addcmul_(v, g, g, 1 - beta2)``   ``v = fma(f32(1 - beta2), rn(g * g), v)``
``_foreach_maximum_`` (amsgrad)             ``max(vmax, v)``
``_foreach_sqrt``                           ``rn(sqrt(v))`` (IEEE ``sqrtf``)
``_foreach_div_(d, sqrt(bc2))``             ``d = rn(d / f32(sqrt(bc2)))`` (IEEE division)
``_foreach_add_(d, eps)``                   ``d = rn(d + f32(eps))``
``_foreach_addcdiv_(p, m, d, -lr / bc1)``   ``p = fma(f32(-lr / bc1), rn(m / d), p)``
==========================================  =============================================

The bias corrections are the host's float64 values (``1 - beta ** step``), cast to float32
as scalars: exact at every step count, unlike the fused kernel's float32 ``pow``. With
``capturable=True`` they are computed on the device from the step tensors instead
(``_foreach_pow``, ``sub_``, ``div_``, ``reciprocal_``, ``sqrt_``), the update divides the
denominator by the step size and adds ``m / d``: the powers are then the device's
(``beta_powers.py``) and the rest float32 operations, each rounded once. Each
kernel stores its result in the tensor's dtype, so a bfloat16 or float16 state is rounded to
it after every kernel, temporaries (``sqrt(v)``) included.

Contiguous float32 tensors go through one pass of C (``cuda_adam_native.py``,
``csrc/cuda_adam.c``); the torch operations here are its twin, for other tensors (bfloat16,
float16, strided) and where no C compiler exists: the tests hold both to the same reference.

Each float32 operation here is float32 (IEEE on the CPU), a square root and a division are
taken in float64 and rounded once (exact for float32 operands), and an FMA is exact in
float64 and rounded once (the sum rounded twice, float64 then float32, which differs from
one rounding with probability about 2^-29 per element). The tests hold it to exact rational
arithmetic element by element. Which arithmetic a device uses is measured on it per param
group (``train/consistency/replay_arithmetic.py``); this module is one of the candidates
that measurement compares against.

Shared by the training side and the writer: imports neither.
"""

from __future__ import annotations

import torch

from . import cuda_adam_native
from .adam_step_arguments import AdamGroupTensors, AdamHyperparameters, ForeachAdamScalars
from .beta_powers import BetaPowerTables
from .float32_math import EMULATED_DTYPES, div_f32, fma_f32, sqrt_f32

CUDA_FOREACH_FP32_FMA = "cuda-foreach-fp32-fma"
# The capturable path's (bias corrections on the device, from the step tensors).
CUDA_FOREACH_CAPTURABLE_FP32_FMA = "cuda-foreach-capturable-fp32-fma"
_CHUNK_ELEMENTS = 1 << 20


def _scalar(value: float) -> torch.Tensor:
    """A host scalar as the kernel holds it: ``static_cast<float>`` of the double, one rounding."""
    return torch.tensor(float(value), dtype=torch.float64).float()


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ATen's ``lerp`` (``Lerp.h``) of float32 values with a float32 weight, as nvcc contracts it."""
    difference = end - start
    if abs(float(weight)) < 0.5:
        return fma_f32(weight.expand_as(difference), difference, start)
    return fma_f32(-difference, (1 - weight).expand_as(difference), end)


def _capturable_bias_corrections(
    step: torch.Tensor, lr: float, beta1: float, beta2: float, powers: BetaPowerTables | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The capturable path's ``step_size`` (``-lr / (1 - beta1^t)``, by its own route) and ``sqrt(1 - beta2^t)``, float32.

    ``_foreach_pow(beta, steps)``, then ``sub_(1)``, ``neg_``, ``div_(lr)``, ``reciprocal_`` and
    ``sqrt_``: each a float32 operation on the device, rounded once.
    """
    count = step.detach().to(torch.float32).reshape(())
    power = powers.power if powers is not None else torch.pow
    bias_correction1 = power(_scalar(beta1), count) - 1  # beta1^t - 1 < 0: the step size comes out as -lr / (1 - beta1^t)
    bias_correction2 = -(power(_scalar(beta2), count) - 1)
    bias_correction1 = div_f32(bias_correction1, _scalar(lr))
    step_size = div_f32(torch.ones((), dtype=torch.float32), bias_correction1)
    return step_size, sqrt_f32(bias_correction2)


def _host_bias_corrections(step: torch.Tensor, lr: float, beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-capturable path's ``step_size`` (``-lr / (1 - beta1^t)``) and ``sqrt(1 - beta2^t)``: the host's float64, cast once."""
    count = float(step)
    step_size = _scalar((lr / (1 - beta1**count)) * -1)  # host float64, then the scalar's cast
    bias_correction2_sqrt = _scalar((1 - beta2**count) ** 0.5)
    return step_size, bias_correction2_sqrt


def step_like_cuda_foreach_adam(
    tensors: AdamGroupTensors,
    hyperparameters: AdamHyperparameters,
    *,
    capturable: bool = False,
    powers: BetaPowerTables | None = None,
) -> None:
    """One step of CUDA's foreach Adam (AdamW with ``decoupled_weight_decay``) on CPU tensors, in place.

    As ``_multi_tensor_adam``: each step count is incremented first. Hyperparameters are Python
    numbers (the non-capturable path refuses tensors there). ``capturable`` computes the bias
    corrections as that path does, on the device from the step tensors: their powers are the
    device's where ``powers`` holds them (``beta_powers.py``), else the CPU's float32 ``pow``.
    Every tensor's dtype is one of ``EMULATED_DTYPES``; each is computed in chunks (elementwise).
    """
    h = hyperparameters
    lr, beta1, beta2 = float(h.lr), float(h.beta1), float(h.beta2)  # Python numbers, as the path takes them
    wd = _scalar(h.weight_decay)
    decay = _scalar(1 - lr * h.weight_decay)
    weight = _scalar(1 - beta1)
    b2 = _scalar(beta2)
    one_minus_b2 = _scalar(1 - beta2)
    eps_f = _scalar(h.eps)
    for held, step in tensors.per_parameter():
        if any(t.dtype not in EMULATED_DTYPES for t in held):
            raise ValueError(f"CUDA's foreach Adam computes {[t.dtype for t in held]} in double, not as emulated here; "
                             "step such tensors with the optimizer itself")
        step.add_(1)
        if capturable:
            step_size, bias_correction2_sqrt = _capturable_bias_corrections(step, lr, beta1, beta2, powers)
        else:
            step_size, bias_correction2_sqrt = _host_bias_corrections(step, lr, beta1, beta2)
        scalars = ForeachAdamScalars(
            weight_decay=float(wd), decay=float(decay), lerp_weight=float(weight), beta2=float(b2),
            one_minus_beta2=float(one_minus_b2), eps=float(eps_f), step_size=float(step_size),
            bias_correction2_sqrt=float(bias_correction2_sqrt), decoupled_weight_decay=h.decoupled_weight_decay,
            maximize=h.maximize, capturable=capturable, weight_decay_applies=h.weight_decay != 0,
        )
        if not cuda_adam_native.foreach_step_float32(held, tensors.amsgrad, scalars):  # one pass in C (csrc/cuda_adam.c)
            foreach_step_in_torch(held, tensors.amsgrad, scalars)


def foreach_step_in_torch(tensors: list[torch.Tensor], has_max: bool, scalars: ForeachAdamScalars) -> None:
    """One tensor's foreach update in place, as ``cuda_adam_native.foreach_step_float32`` makes it in C: its twin in torch operations.

    ``tensors`` are param, grad, exp_avg, exp_avg_sq (, max_exp_avg_sq with ``has_max``), of any
    ``EMULATED_DTYPES`` and any strides; each kernel of the table above in turn, its result stored in the tensor's dtype.
    """
    wd, decay, weight = _scalar(scalars.weight_decay), _scalar(scalars.decay), _scalar(scalars.lerp_weight)
    b2, one_minus_b2, eps_f = _scalar(scalars.beta2), _scalar(scalars.one_minus_beta2), _scalar(scalars.eps)
    step_size, bias_correction2_sqrt = _scalar(scalars.step_size), _scalar(scalars.bias_correction2_sqrt)
    param, grad, exp_avg, exp_avg_sq = tensors[:4]
    dtype = param.dtype
    views = [t.detach().reshape(-1) for t in tensors]
    for begin in range(0, param.numel(), _CHUNK_ELEMENTS):
        end = min(begin + _CHUNK_ELEMENTS, param.numel())

        def stored(x: torch.Tensor, like: torch.Tensor = param) -> torch.Tensor:
            # Each kernel writes its result in the tensor's own dtype.
            return x.to(like.dtype).float()

        p, g, m, v = (views[k][begin:end].float() for k in range(4))
        if scalars.maximize:
            g = stored(-g, grad)
        if scalars.weight_decay_applies:
            if scalars.decoupled_weight_decay:
                p = stored(p * decay)
            else:
                g = stored(fma_f32(wd.expand_as(p), p, g), grad)
        m = stored(_lerp(m, g, weight), exp_avg)
        v = stored(v * b2, exp_avg_sq)
        v = stored(fma_f32(one_minus_b2.expand_as(g), g * g, v), exp_avg_sq)  # g * g: the functor's float32, not stored
        if has_max:
            peak = torch.maximum(views[4][begin:end].float(), v)
            denominator = stored(sqrt_f32(peak), exp_avg_sq)
        else:
            denominator = stored(sqrt_f32(v), exp_avg_sq)
        denominator = stored(div_f32(denominator, bias_correction2_sqrt), exp_avg_sq)
        denominator = stored(denominator + eps_f, exp_avg_sq)
        if scalars.capturable:
            denominator = stored(div_f32(denominator, step_size), exp_avg_sq)  # _foreach_div_(denominators, step_size)
            p = p + div_f32(m, denominator)  # addcdiv with value 1: fma(1, m / d, p) is one rounding of the sum
        else:
            p = fma_f32(step_size.expand_as(p), div_f32(m, denominator), p)  # m / d: the functor's float32, not stored
        with torch.no_grad():
            views[0][begin:end].copy_(p.to(dtype))
            views[2][begin:end].copy_(m)
            views[3][begin:end].copy_(v)
            if has_max:
                views[4][begin:end].copy_(peak)
    with torch.no_grad():
        for t, flat in zip(tensors, views):
            if t is not grad and flat.data_ptr() != t.data_ptr():  # reshape copied a strided view: write it back
                t.copy_(flat.view(t.shape))
