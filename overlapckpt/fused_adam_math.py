"""CUDA's fused Adam / AdamW update, computed on the CPU: replay's arithmetic for a run whose fused optimizer steps on a GPU.

Replay rolls state forward on the CPU with the training's own optimizer class and flags
(``writer/replay.py``). For ``fused=True`` that runs torch's CPU fused kernel, which rounds
differently from its CUDA fused kernel. The CUDA kernel (torch 2.11's, read from
``aten/src/ATen/native/cuda/fused_adam_utils.cuh`` and seen on an H200) first casts lr,
betas, weight decay and eps to float32, then computes the moments with FMAs::

    m = fma(b1, m, fma(-b1, g, g))            # (1 - b1) * g as g - b1 * g, one rounding
    v = fma(b2, v, fma(-b2, g * g, g * g))

so its effective ``1 - beta2`` is ``1 - float32(0.999) = 0.00099998713``, where the CPU
kernel uses ``float32(1 - 0.999) = 0.001``: every replayed step's g² term differs by a
relative 1.3e-5 (about 100 ulps), and ``1 - beta1`` by 2.4e-7. Measured on an H200: after
3 replayed steps, exp_avg_sq 1.25e-5 from the GPU's own state with the CPU kernel.

``step_like_cuda_fused_adam`` computes that formula on the CPU: each float32 operation as
float32 (every input and the one rounding of each result), each FMA exactly in float64 and
rounded once (a product of two float32 values is exact in float64, and ``g - b1 * g`` is
too; the outer sum is rounded twice, float64 then float32, which differs from one rounding
with probability about 2^-29 per element). Bias corrections are float32 ``pow`` as the
kernel's ``pow_`` of float32 values. CUDA's ``powf`` may differ from the CPU's by an ulp or
two (a relative 1e-7 of an lr-sized update), so replay takes the device's own powers from a
table the training side computes on the device (``beta_powers.py``).

Contiguous float32 tensors go through one pass of C (``cuda_adam_native.py``,
``csrc/cuda_adam.c``); the torch operations here are its twin, held by the tests to the
same exact reference, for other tensors and where no C compiler exists.

Which arithmetic a run's CUDA kernel uses is not assumed from the torch version: the
training side measures it per param group on its device
(``train/consistency/replay_arithmetic.py``), comparing real fused steps on the device with
each CPU candidate, and the replay log names the one that matched.

Shared by the training side (the measurement) and the writer (the replay): imports neither.
"""

from __future__ import annotations

import torch

from . import cuda_adam_native
from .adam_step_arguments import AdamGroupTensors, AdamHyperparameters, FusedAdamScalars
from .beta_powers import BetaPowerTables
from .float32_math import EMULATED_DTYPES, div_f32, fma_f32, sqrt_f32

# The replay log's names for these arithmetics; None in the log means the CPU's own fused kernel.
CUDA_FP32_FMA = "cuda-fp32-fma"
# The same, but Adam's L2 term (``grad += param * weight_decay``) rounded before the add, as a
# kernel compiled without contracting it into an FMA computes it. On an H200 (torch 2.11) fused
# AdamW matched CUDA_FP32_FMA bit for bit, and fused Adam with weight decay differed from it in
# 146 of 12,288 elements: the measurement tries both (AdamW never reaches that line).
CUDA_FP32_FMA_L2_ROUNDED = "cuda-fp32-fma-l2-rounded"
ARITHMETICS = (CUDA_FP32_FMA, CUDA_FP32_FMA_L2_ROUNDED)


def torch_fused_adam_class(cls: type) -> type | None:
    """The ``torch.optim`` class (AdamW or Adam) whose own ``step()`` an optimizer of ``cls`` runs, or None: not of that
    family, or a subclass that defines its own ``step()`` (which replay must run as it is, not emulate)."""
    for base in (torch.optim.AdamW, torch.optim.Adam):
        if issubclass(cls, base):
            overridden = any("step" in c.__dict__ for c in cls.__mro__ if c is not base and issubclass(c, base))
            return None if overridden else base
    return None


def decouples_weight_decay(group: dict, cls: type) -> bool:
    """Whether a param group of ``cls`` decays weights as AdamW (``param -= lr * wd * param``), not as Adam's L2 term.

    The group's own flag where torch has it (Adam's ``decoupled_weight_decay``), else the class.
    """
    return bool(group.get("decoupled_weight_decay", issubclass(cls, torch.optim.AdamW)))


def _f32(value: float | torch.Tensor) -> torch.Tensor:
    """A hyperparameter as the kernel holds it: one float32 value (0-dim, on the CPU)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device="cpu", dtype=torch.float32).reshape(())
    return torch.tensor(value, dtype=torch.float32)


# Elements per pass: the float64 temporaries of one chunk stay a few tens of MB, whatever the tensor.
_CHUNK_ELEMENTS = 1 << 20


def _times_one_minus(beta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """fma(-beta, x, x), the kernel's ``(1 - beta) * x``: for beta in [0.5, 1], ``1 - beta`` is exact in float32
    (Sterbenz), so it is one float32 multiply, rounded once; else exact in float64 and rounded once."""
    if 0.5 <= float(beta) <= 1.0:
        return x * (1 - beta)
    return fma_f32(-beta, x, x)


def _flat(t: torch.Tensor) -> torch.Tensor | None:
    return t.detach().view(-1) if t.is_contiguous() else None


def step_like_cuda_fused_adam(
    tensors: AdamGroupTensors,
    hyperparameters: AdamHyperparameters,
    *,
    arithmetic: str = CUDA_FP32_FMA,
    powers: BetaPowerTables | None = None,
) -> None:
    """One step of CUDA's fused Adam (AdamW with ``decoupled_weight_decay``) on CPU tensors, in place.

    As ``torch.optim``'s fused path: each step count is incremented first, then the kernel's update.
    ``arithmetic`` is one of ``ARITHMETICS``; every tensor's dtype one of ``EMULATED_DTYPES``. The
    bias corrections' powers are the device's where ``powers`` holds them (``beta_powers.py``), else
    the CPU's float32 ``pow``. Each
    tensor is computed in chunks of ``_CHUNK_ELEMENTS`` (elementwise: the chunks are independent).
    """
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"fused arithmetic {arithmetic!r} is not one of {ARITHMETICS}")
    h = hyperparameters
    lr_f, b1, b2, wd, eps_f = _f32(h.lr), _f32(h.beta1), _f32(h.beta2), _f32(h.weight_decay), _f32(h.eps)
    lr_wd = lr_f * wd  # `lr * weight_decay * param`: the first product in float32
    for held, step in tensors.per_parameter():
        if any(t.dtype not in EMULATED_DTYPES for t in held):
            raise ValueError(f"CUDA's fused Adam computes {[t.dtype for t in held]} in double, not as emulated here; "
                             "step such tensors with the optimizer itself")
        step.add_(1)
        step_size, bias_correction2_sqrt = _bias_corrections(lr_f, b1, b2, step, powers)
        scalars = FusedAdamScalars(
            lr_times_weight_decay=float(lr_wd), beta1=float(b1), beta2=float(b2), weight_decay=float(wd), eps=float(eps_f),
            step_size=float(step_size), bias_correction2_sqrt=float(bias_correction2_sqrt),
            decoupled_weight_decay=h.decoupled_weight_decay, l2_contracted=arithmetic == CUDA_FP32_FMA, maximize=h.maximize,
            weight_decay_applies=h.weight_decay != 0,
        )
        if not cuda_adam_native.fused_step_float32(held, tensors.amsgrad, scalars):  # one pass in C (csrc/cuda_adam.c)
            fused_step_in_torch(held, tensors.amsgrad, scalars)


def _bias_corrections(
    lr: torch.Tensor, beta1: torch.Tensor, beta2: torch.Tensor, step: torch.Tensor, powers: BetaPowerTables | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``step_size`` (``lr / (1 - beta1^t)``) and ``sqrt(1 - beta2^t)`` at the (incremented) step count, float32."""
    one = torch.ones((), dtype=torch.float32)
    step_count = _f32(step)
    # pow of float32 values, as the kernel's pow_: the device's own where the table holds it
    # (CUDA's powf may round a step count's power an ulp apart from the CPU's).
    power = powers.power if powers is not None else torch.pow
    bias_correction1 = one - power(beta1, step_count)
    bias_correction2_sqrt = sqrt_f32(one - power(beta2, step_count))
    return div_f32(lr, bias_correction1), bias_correction2_sqrt


def fused_step_in_torch(tensors: list[torch.Tensor], has_max: bool, scalars: FusedAdamScalars) -> None:
    """One tensor's update in place, as ``cuda_adam_native.fused_step_float32`` makes it in C: its twin in torch operations.

    ``tensors`` are param, grad, exp_avg, exp_avg_sq (, max_exp_avg_sq with ``has_max``), of any
    ``EMULATED_DTYPES`` and any strides; each computed in float32 as the kernel does.
    """
    lr_wd = _f32(scalars.lr_times_weight_decay)
    b1, b2 = _f32(scalars.beta1), _f32(scalars.beta2)
    wd, eps_f = _f32(scalars.weight_decay), _f32(scalars.eps)
    step_size, bias_correction2_sqrt = _f32(scalars.step_size), _f32(scalars.bias_correction2_sqrt)
    param, grad = tensors[0], tensors[1]
    flats = [_flat(t) for t in tensors]
    if any(f is None for f in flats):  # a strided view: one pass over the whole tensor, copied back
        views: list[torch.Tensor] = [t.detach().reshape(-1) for t in tensors]
        chunks = [(0, param.numel())]
    else:
        views = [f for f in flats if f is not None]
        chunks = [(s, min(s + _CHUNK_ELEMENTS, param.numel())) for s in range(0, param.numel(), _CHUNK_ELEMENTS)]
    for begin, end in chunks:
        p, g, m, v = (views[k][begin:end].float() for k in range(4))
        if scalars.maximize:
            g = -g
        if scalars.weight_decay_applies:
            if scalars.decoupled_weight_decay:
                p = fma_f32(-lr_wd, p, p)  # param -= (lr * wd) * param, contracted
            elif scalars.l2_contracted:
                g = fma_f32(p, wd, g)  # grad += param * wd, contracted
            else:
                g = g + p * wd  # grad += param * wd, the product rounded first
        m = fma_f32(b1, m, _times_one_minus(b1, g))
        gg = g * g
        v = fma_f32(b2, v, _times_one_minus(b2, gg))
        if has_max:
            held = views[4][begin:end].float()
            peak = torch.where(held < v, v, held)  # std::max(max_exp_avg_sq, exp_avg_sq)
            denom = div_f32(sqrt_f32(peak), bias_correction2_sqrt) + eps_f
        else:
            denom = div_f32(sqrt_f32(v), bias_correction2_sqrt) + eps_f
        p = p - div_f32(step_size * m, denom)
        with torch.no_grad():
            views[0][begin:end].copy_(p)
            views[2][begin:end].copy_(m)
            views[3][begin:end].copy_(v)
            if has_max:
                views[4][begin:end].copy_(peak)
    if any(f is None for f in flats):
        with torch.no_grad():
            for t, flat in zip(tensors, views):
                if t is not grad:
                    t.copy_(flat.view(t.shape))
