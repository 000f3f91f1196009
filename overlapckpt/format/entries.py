"""The checkpoint's tensor entries and the nested DCP state dict they make, shared by every process.

The names are those of ``torch.distributed.checkpoint.state_dict.get_state_dict``:
``{"model": {fqn: tensor}, "optimizer": {"state": {fqn: {key: tensor}},
"param_groups": [...]}}``. A checkpoint written from these entries is therefore
an ordinary DCP checkpoint that the stock recipe (``get_state_dict``, ``dcp.load``,
``set_state_dict``) reads and reshards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointMismatchError
from .key_layout import GET_STATE_DICT, TORCHTITAN, flat_param_groups

ROLE_PARAM = "param"
ROLE_BUFFER = "buffer"
ROLE_OPTIM = "optim"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the checkpoint: where it lives in the DCP state dict and what it is."""

    key: str  # DCP's flattened key, e.g. "optimizer.state.fc.weight.exp_avg"
    path: tuple[str, ...]  # the same key as a path into the nested state dict
    role: str  # ROLE_PARAM, ROLE_BUFFER or ROLE_OPTIM
    param_fqn: str | None  # the parameter a param or optim entry belongs to
    dtype: torch.dtype
    shape: tuple[int, ...]  # of the local part this rank holds
    nbytes: int
    global_shape: tuple[int, ...] = ()  # of the whole tensor across ranks (= shape in one process)
    global_offset: tuple[int, ...] = ()  # of the local part inside the whole tensor

    @property
    def is_whole(self) -> bool:
        """The local part is the whole tensor (written as a plain tensor)."""
        return self.global_shape == self.shape


def build_state_dict(
    entries: list[TensorEntry],
    tensors: list[torch.Tensor],
    small_state: dict[str, Any],
    key_layout: str = GET_STATE_DICT,
    stateful: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Nest flat entries back into the state dict DCP saves, named as ``key_layout`` says (format/key_layout.py).

    ``stateful``: the stateful objects' states, saved as DCP items too in the torchtitan layout.
    """
    sd: dict[str, Any]
    if key_layout == TORCHTITAN:
        sd = {**(stateful or {}), "optimizer": {"state": {}, **flat_param_groups(small_state["param_groups"])}}
    else:
        sd = {"model": {}, "optimizer": {"state": {}, "param_groups": small_state["param_groups"]}}
    for entry, t in zip(entries, tensors):
        node = sd
        for part in entry.path[:-1]:
            node = node.setdefault(part, {})
        node[entry.path[-1]] = t
    for joined, value in small_state.get("small_optim", {}).items():
        fqn, k = joined.split("\x00", 1)
        sd["optimizer"]["state"].setdefault(fqn, {})[k] = value
    return sd


def flatten_tensors(state_dict: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """DCP's flattened key of every tensor leaf reached through nested dicts."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, dict):
            out.update(flatten_tensors(v, key + "."))
    return out


def check_shapes(expected: dict[str, tuple[int, ...]], target: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointMismatchError naming the first tensor whose shape differs."""
    for key, t in target.items():
        shape = expected.get(key)
        if shape is None:
            raise CheckpointMismatchError(
                f"tensor {key!r} of the objects being loaded is not in the checkpoint; load into the "
                "same model/optimizer architecture that was saved"
            )
        if tuple(shape) != tuple(t.shape):
            raise CheckpointMismatchError(
                f"tensor {key!r} has shape {tuple(shape)} in the checkpoint but {tuple(t.shape)} in the "
                "object being loaded; build the model with the configuration that was saved"
            )


def optimizer_state_by_index(by_name: dict[str, Any]) -> dict[str, Any]:
    """torch's own optimizer state dict (parameters numbered across the groups in order) from the by-name form."""
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for group in by_name.get("param_groups", []):
        numbered = []
        for name in group["params"]:
            if name in by_name.get("state", {}):
                state[index] = by_name["state"][name]
            numbered.append(index)
            index += 1
        groups.append({**group, "params": numbered})
    return {"state": state, "param_groups": groups}
