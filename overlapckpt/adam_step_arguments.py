"""The arguments of replay's Adam emulations, as records: a group's hyperparameters and tensors, and each kernel's scalars.

``fused_adam_math.py`` and ``foreach_adam_math.py`` each take one param group's step as
two records: ``AdamHyperparameters`` (as the group holds them) and ``AdamGroupTensors``
(the tensor lists ``torch.optim``'s functional steps take). Each then updates one
parameter at a time by a pass that mirrors its CUDA kernel, and that pass has two roads
with one signature: the C loop (``cuda_adam_native.py``) and its torch twin. What they
take is the kernel's own scalars, already float32 values: ``FusedAdamScalars`` and
``ForeachAdamScalars``, the C functions' arguments field for field.

A module of its own because the emulations, the native wrapper and their callers
(``device_adam_step.py``, the tests, the benchmarks) all build or read these records, and
none of those should import another just for them. Shared by the training side and the
writer: imports neither.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamHyperparameters:
    """One Adam / AdamW param group's step hyperparameters, as the group holds them (the emulations cast them as the kernel does)."""

    lr: float | torch.Tensor  # the foreach emulation takes Python numbers: torch refuses a tensor lr there without capturable
    beta1: float | torch.Tensor
    beta2: float | torch.Tensor
    weight_decay: float
    eps: float
    maximize: bool
    decoupled_weight_decay: bool  # AdamW's ``param -= lr * wd * param``; else Adam's L2 term ``grad += wd * param``


@dataclass(frozen=True)
class AdamGroupTensors:
    """One param group's tensors for a step, index by index, as ``torch.optim``'s functional Adam takes them; updated in place."""

    params: Sequence[torch.Tensor]
    grads: Sequence[torch.Tensor]
    exp_avgs: Sequence[torch.Tensor]
    exp_avg_sqs: Sequence[torch.Tensor]
    max_exp_avg_sqs: Sequence[torch.Tensor] | None  # amsgrad's; None without it
    state_steps: Sequence[torch.Tensor]  # each parameter's step count, incremented by the step

    @property
    def amsgrad(self) -> bool:
        return self.max_exp_avg_sqs is not None

    def per_parameter(self) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
        """Each parameter's tensors as a kernel pass takes them (param, grad, exp_avg, exp_avg_sq (, max_exp_avg_sq)), and its step count."""
        for i, (param, grad, exp_avg, exp_avg_sq, step) in enumerate(
            zip(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.state_steps)
        ):
            yield [param, grad, exp_avg, exp_avg_sq] + ([self.max_exp_avg_sqs[i]] if self.max_exp_avg_sqs is not None else []), step


@dataclass(frozen=True)
class FusedAdamScalars:
    """The scalars of one tensor's pass of CUDA's fused Adam kernel: each float value is a float32 value already (the kernel's).

    The fields are ``overlapckpt_cuda_fused_adam_f32``'s scalar arguments, in its order (``csrc/cuda_adam.c``).
    """

    lr_times_weight_decay: float
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    step_size: float  # lr / bias_correction1
    bias_correction2_sqrt: float
    decoupled_weight_decay: bool
    l2_contracted: bool  # Adam's L2 term as one FMA; else the product rounded before the add
    maximize: bool
    # Whether the torch twin applies weight decay: the host's ``weight_decay != 0``, as it always decided (the C loop
    # decides from the float32 ``weight_decay``; the two differ only for a decay below float32's smallest subnormal).
    weight_decay_applies: bool


@dataclass(frozen=True)
class ForeachAdamScalars:
    """The scalars of one tensor's pass of CUDA's foreach Adam kernels: each float value is a float32 value already.

    The fields are ``overlapckpt_cuda_foreach_adam_f32``'s scalar arguments, in its order (``csrc/cuda_adam.c``), each
    cast once from the host's double.
    """

    weight_decay: float
    decay: float  # 1 - lr * weight_decay
    lerp_weight: float  # 1 - beta1
    beta2: float
    one_minus_beta2: float
    eps: float
    step_size: float  # -lr / bias_correction1 (capturable: the device's own float32 step size)
    bias_correction2_sqrt: float
    decoupled_weight_decay: bool
    maximize: bool
    capturable: bool  # the capturable path's update: the denominator divided by the step size
    # As FusedAdamScalars.weight_decay_applies: the host's ``weight_decay != 0``, which the torch twin decides by.
    weight_decay_applies: bool
