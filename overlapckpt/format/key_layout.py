"""How a checkpoint's state is named inside DCP: the key layout, shared by the training side, the writer and ``load``.

``get_state_dict`` (the default) is the layout of torch's own recipe
(``torch.distributed.checkpoint.state_dict.get_state_dict``)::

    model.<fqn>                      the model's tensors
    optimizer.state.<fqn>.<key>      the optimizer's state, by parameter name
    optimizer.param_groups           one item: the groups, parameters by name
    step-000000100/                  the directory (9 digits at least)

``torchtitan`` is the layout of TorchTitan's ``CheckpointManager``, so that its stock
manager loads an overlapckpt checkpoint (and ``overlapckpt.titan`` loads its)::

    <fqn>                            the model's tensors, at the top level
    optimizer.state.<fqn>.<key>      as above
    optimizer.param_groups.<fqn>.<key>   one item per parameter and hyperparameter
    <name>.<key>                     each stateful object's state_dict() (lr_scheduler,
                                     dataloader, train_state), as DCP items too
    step-100/                        the directory (the step, unpadded)

In both, the manifest also holds every stateful object's state as tagged JSON (never
pickle): that copy is the one overlapckpt restores.
"""

from __future__ import annotations

from typing import Any

GET_STATE_DICT = "get_state_dict"
TORCHTITAN = "torchtitan"
KEY_LAYOUTS = (GET_STATE_DICT, TORCHTITAN)
_GROUP_KEYS_NOT_SAVED = ("params", "param_names")  # TorchTitan's flat form drops both


def model_path(key_layout: str, fqn: str) -> tuple[str, ...]:
    """Where a model tensor sits in the nested state dict DCP saves."""
    return (fqn,) if key_layout == TORCHTITAN else ("model", fqn)


def flat_param_groups(param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``param_groups`` (parameters by name) as TorchTitan's flat items: ``param_groups.<fqn>.<key>``."""
    flat: dict[str, Any] = {}
    for group in param_groups:
        for fqn in group["params"]:
            for key, value in group.items():
                if key not in _GROUP_KEYS_NOT_SAVED:
                    flat[f"param_groups.{fqn}.{key}"] = value
    return flat


def saved_group(flat: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """Invert :func:`flat_param_groups` for one live group (parameters by name): its saved hyperparameters, read at its first name."""
    names = live["params"]
    if not names:
        return dict(live)
    return {**live, **{k: flat[f"param_groups.{names[0]}.{k}"] for k in live if k not in _GROUP_KEYS_NOT_SAVED}}
