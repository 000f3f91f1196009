"""float32 operations rounded exactly as IEEE hardware rounds them, on the CPU: the pieces of the CUDA optimizer emulations.

CUDA's optimizer kernels compute in float32 with FMAs, IEEE division (``-prec-div``) and
IEEE square roots (``-prec-sqrt``); the CPU's torch kernels do not always round so (a
one-element divisor is taken as a multiply by its reciprocal, float32 ``sqrt`` was seen an
ulp off on 4.8e-11). Each function here takes float32 values and returns the float32
result rounded once from the exact one, by way of float64: a product of two float32 values
is exact in float64; a quotient or square root of float32 values, rounded to float64 and
then to float32, equals the exact one rounded once (53 >= 2 * 24 + 2). An FMA's sum is
rounded twice (float64, then float32), which differs from one rounding with probability
about 2^-29 per element. Used by ``fused_adam_math.py`` and ``foreach_adam_math.py``; the
tests hold both to exact rational arithmetic.
"""

from __future__ import annotations

import torch

# The dtypes CUDA's optimizer kernels compute in float32 (``opmath``), which the emulations model;
# float64 is computed in double there, as the CPU's own kernels compute it: not emulated.
EMULATED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fma(a, b, c) of float32 values: the product exact in float64, the sum rounded to float32."""
    return torch.addcmul(c.double(), a.double(), b.double()).float()


def div_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b of float32 values, correctly rounded to float32, as CUDA's IEEE division.

    Never by a one-element divisor: torch's CPU kernels divide by one as a multiply by its
    reciprocal (two roundings), so it goes in as a whole tensor.
    """
    if a.dim() == 0:
        return torch.tensor(a.item() / b.item(), dtype=torch.float32)
    return torch.div(a.double(), b.double().expand_as(a).contiguous()).float()


def sqrt_f32(a: torch.Tensor) -> torch.Tensor:
    """sqrt of float32 values correctly rounded, as CUDA's IEEE ``sqrtf``."""
    return a.double().sqrt().float()
