"""Applying what was read to the live objects: model and optimizer state dicts by their key layout, stateful objects, RNG states."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from ..format.key_layout import TORCHTITAN, flat_param_groups, saved_group
from ..optimizers import each_optimizer
from .param_lookup import optimizer_state_with_param_lists, param_lists_while_loading


def live_state_dicts(model: nn.Module, optimizers: list[torch.optim.Optimizer] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The model's state dict and the optimizers' (None without any), as ``get_state_dict`` names them (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizers is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizers)


def apply_state_dicts(model: nn.Module, optimizers: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None) -> None:
    """Set what ``live_state_dicts`` named, read back from a checkpoint.

    torch's optimizer loading looks each state value's parameter up in the groups' lists,
    a scan per value; the groups it reads hold :class:`~.param_lookup.ParamList`s, so the
    lookups are a set's and the load stays linear in the parameters.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if optimizers is None:
        model.load_state_dict(model_sd)
        return
    with param_lists_while_loading(each_optimizer(optimizers)):
        optim_sd = optimizer_state_with_param_lists(optim_sd)
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


def restore_extra_state(extra: dict[str, Any], stateful: dict[str, Any]) -> Callable[[], None]:
    """Load each stateful object's saved state, then the RNG states; returns what puts them back as they were.

    On a failure here the objects loaded before it are put back at once, and the error goes on.
    """
    saved = extra.get("stateful", {})
    loaded: list[tuple[Any, Any]] = []
    rng_before = torch.get_rng_state()

    def undo() -> None:
        for obj, before in reversed(loaded):
            obj.load_state_dict(before)
        torch.set_rng_state(rng_before)

    try:
        for name, obj in stateful.items():
            before = copy.deepcopy(obj.state_dict())
            obj.load_state_dict(saved[name])
            loaded.append((obj, before))
        restore_rng(extra.get("rng", {}))
    except BaseException:
        undo()
        raise
    return undo


def restore_rng(rng: dict[str, Any]) -> None:
    """Set the RNG states a checkpoint saved (torch's CPU generator, and CUDA's on as many devices)."""
    if "torch_cpu" in rng:
        torch.set_rng_state(rng["torch_cpu"])
    cuda_states = rng.get("torch_cuda")
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)


class LiveObjectsKept:
    """Undo what a failed load did to the optimizers: ``with LiveObjectsKept(optimizers): ...``.

    A load builds the optimizer's state first when it has none (``get_state_dict`` runs one
    zero-gradient step to create AdamW's moments and step counts), so a load that then fails
    (no checkpoint, a mismatch, a refused byte) must take that state away again: a run that
    catches the error and trains on must equal one that never tried. The parameters'
    gradients the creating step replaced are put back too. Stateful objects and the RNG
    states are applied before any tensor is read (``restore_extra_state``), and the load puts
    them back itself on a failure.
    """

    def __init__(self, optimizers: Any) -> None:
        self.optimizers = each_optimizer(optimizers)
        # Which optimizers had state, and every parameter's gradient, before the load touched them.
        self.had_state = [bool(o.state) for o in self.optimizers]
        self.grads = [(p, p.grad) for o in self.optimizers for g in o.param_groups for p in g["params"]]

    def __enter__(self) -> LiveObjectsKept:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            return
        for optimizer, had in zip(self.optimizers, self.had_state):
            if not had:
                optimizer.state.clear()
        for p, grad in self.grads:
            p.grad = grad
