"""Applying what was read to the live objects: model and optimizer state dicts by their key layout, stateful objects, RNG states."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ..format.key_layout import TORCHTITAN, flat_param_groups, saved_group


def live_state_dicts(model: nn.Module, optimizers: list[torch.optim.Optimizer] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The model's state dict and the optimizers' (None without any), as ``get_state_dict`` names them (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizers is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizers)


def apply_state_dicts(
    model: nn.Module, optimizers: list[torch.optim.Optimizer] | None, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None
) -> None:
    """Set what ``live_state_dicts`` named, read back from a checkpoint."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if optimizers is None:
        model.load_state_dict(model_sd)
    else:
        set_state_dict(model, optimizers, model_state_dict=model_sd, optim_state_dict=cast(Any, optim_sd))


def named_as(key_layout: str, msd: dict[str, Any], osd: dict[str, Any] | None) -> dict[str, Any]:
    """The state dict to read a checkpoint of ``key_layout`` into, from ``get_state_dict``'s model and optimizer parts."""
    if key_layout != TORCHTITAN:
        return {"model": msd} if osd is None else {"model": msd, "optimizer": osd}
    if osd is None:
        return dict(msd)
    return {**msd, "optimizer": {"state": osd["state"], **flat_param_groups(osd["param_groups"])}}


def unnamed(key_layout: str, host: dict[str, Any], osd: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Invert :func:`named_as` on what was read: (model state dict, optimizer state dict by name)."""
    if key_layout != TORCHTITAN:
        return host["model"], host.get("optimizer")
    model_sd = {k: v for k, v in host.items() if k != "optimizer"}
    if osd is None:
        return model_sd, None
    flat = host["optimizer"]
    return model_sd, {"state": flat["state"], "param_groups": [saved_group(flat, live) for live in osd["param_groups"]]}


def restore_extra_state(extra: dict[str, Any], stateful: dict[str, Any]) -> None:
    saved = extra.get("stateful", {})
    for name, obj in stateful.items():
        obj.load_state_dict(saved[name])
    restore_rng(extra.get("rng", {}))


def restore_rng(rng: dict[str, Any]) -> None:
    """Set the RNG states a checkpoint saved (torch's CPU generator, and CUDA's on as many devices)."""
    if "torch_cpu" in rng:
        torch.set_rng_state(rng["torch_cpu"])
    cuda_states = rng.get("torch_cuda")
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
