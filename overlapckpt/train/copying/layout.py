"""Turn a live model and its optimizer into named tensor entries (the training side of ``format/entries.py``).

The names are those of ``torch.distributed.checkpoint.state_dict.get_state_dict``:
``{"model": {fqn: tensor}, "optimizer": {"state": {fqn: {key: tensor}},
"param_groups": [...]}}``. A checkpoint written from these entries is therefore
an ordinary DCP checkpoint that the stock recipe (``get_state_dict``, ``dcp.load``,
``set_state_dict``) reads and reshards.

Tensor entries are the live tensors themselves (parameters, buffers, optimizer
state), captured by reference once per layout; everything else (``param_groups``,
non-tensor optimizer state) is *small state*, deep-copied at the version it belongs
to.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from ...format.entries import ROLE_BUFFER, ROLE_OPTIM, ROLE_PARAM, TensorEntry
from ...format.key_layout import GET_STATE_DICT, model_path
from .live_identity import LiveIdentity, new_generation
from .ownership import OwnershipUnit, TensorPlacement, local_tensor, owned_units, placement_of


@dataclass(frozen=True)
class CheckpointScope:
    """This process's place in the group that checkpoints together."""

    rank: int = 0
    world_size: int = 1
    # Plain (non-DTensor) tensors that only some ranks hold (pipeline stages): FQN -> those ranks.
    # Every other plain tensor is a replica on every rank (DDP).
    plain_holders: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False, hash=False)


@dataclass
class StateLayout:
    """The tensor entries of one model + optimizer, with references to the live tensors."""

    entries: list[TensorEntry]  # the entries this rank copies and writes (its share)
    live_tensors: list[torch.Tensor]  # their local tensors
    param_fqns: list[str]  # the optimized parameters this rank owns, in optimizer order
    params: list[torch.Tensor]  # those live parameters (whose .grad replay logs), aligned with param_fqns
    param_locals: list[torch.Tensor]  # their local parts (shapes of what is logged)
    group_param_fqns: list[list[str]]  # param_groups[i]["params"] as FQNs, every rank's
    # Every tensor of the checkpoint across all ranks: DCP key -> global shape (the writers check coverage).
    global_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Non-tensor leaves of optimizer.state, as (fqn, key) pairs read at capture time.
    small_optim_keys: list[tuple[str, str]] = field(default_factory=list)
    # This layout's generation (new_generation()): the key its plans, views and routes are cached under.
    fingerprint: int = 0
    identity: LiveIdentity | None = None  # what it was built from: PlanCache rebuilds it when that no longer matches
    shape_signature: tuple[int, int] = (0, 0)  # optimizer_shape_signature() when built

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)  # once per layout: its entries never change


def optimizer_shape_signature(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(state entries, parameters optimized): one dict length per parameter.

    It moves when the optimizer creates state for a parameter (one unfrozen, or stepped
    for the first time: its entries add to the count), when a hook adds a state entry
    lazily, or when it gains a param group: what a layout built earlier lacks.
    """
    # optimizer.state is a defaultdict: reading state[p] anywhere adds an empty entry, which
    # adds no entries to the count, so it restarts no window. Counted in C, in one pass: it
    # runs at every step of a replay window, over every parameter.
    return sum(map(len, optimizer.state.values())), sum(len(g["params"]) for g in optimizer.param_groups)


# A tensor entry this rank may checkpoint: (entry, its local tensor, the key of its ownership unit, its placement).
_Candidate = tuple[TensorEntry, torch.Tensor, str, TensorPlacement]


def _param_fqns(model: nn.Module) -> dict[int, str]:
    """Parameter id -> the canonical FQN ``get_state_dict`` gives it (no ``module.``, ``_orig_mod.``)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    # named_parameters() lists a shared (tied) parameter once, under its first name,
    # which is also the name get_state_dict gives its optimizer state.
    out = {}
    for name, p in model.named_parameters():
        fqns = _get_fqns(model, name)
        out[id(p)] = next(iter(fqns)) if len(fqns) == 1 else name
    return out


def build_layout(
    model: nn.Module, optimizer: torch.optim.Optimizer, scope: CheckpointScope = CheckpointScope(), key_layout: str = GET_STATE_DICT
) -> StateLayout:
    """Describe every tensor this rank checkpoints, in a deterministic order.

    Order: model entries in ``state_dict`` order, then optimizer state per parameter
    in optimizer order, each parameter's keys sorted. The optimizer state must exist
    (after the first ``optimizer.step()``); an empty state would make
    ``get_state_dict`` run a zero-gradient step, which changes Adam's step count.
    In a distributed run only this rank's share is kept (``ownership.py``).
    """
    fqn_by_id = _param_fqns(model)
    # A parameter no optimizer updates (left out of it, a frozen module excluded) never
    # changes: it travels with the buffers, in the last group, and replay carries it as is.
    optimized = {fqn_by_id[id(p)] for group in optimizer.param_groups for p in group["params"]}
    candidates = _model_candidates(model, fqn_by_id, optimized, scope, key_layout)

    group_fqns: list[list[str]] = []
    small_keys: list[tuple[str, str]] = []
    param_by_fqn: dict[str, torch.Tensor] = {}
    param_order: list[str] = []
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            fqn = fqn_by_id[id(p)]
            names.append(fqn)
            param_by_fqn[fqn] = p
            param_order.append(fqn)
            for k in sorted(optimizer.state.get(p, {}).keys(), key=str):
                v = optimizer.state[p][k]
                if isinstance(v, torch.Tensor):
                    local = local_tensor(v)
                    placement = placement_of(v, scope.rank, scope.world_size, scope.plain_holders.get(fqn))
                    entry = _entry(("optimizer", "state", fqn, str(k)), ROLE_OPTIM, fqn, local, placement)
                    candidates.append((entry, local, fqn, placement))
                else:
                    small_keys.append((fqn, k))
        group_fqns.append(names)

    owned = _owned_units(candidates)
    kept = [(e, t) for e, t, unit, _ in candidates if unit in owned]
    owned_params = [f for f in param_order if f in owned]
    return StateLayout(
        entries=[e for e, _ in kept],
        live_tensors=[t for _, t in kept],
        param_fqns=owned_params,
        params=[param_by_fqn[f] for f in owned_params],
        param_locals=[local_tensor(param_by_fqn[f]) for f in owned_params],
        group_param_fqns=group_fqns,
        global_shapes={e.key: e.global_shape for e, _, _, _ in candidates},
        small_optim_keys=[(f, k) for f, k in small_keys if f in owned],
        fingerprint=new_generation(),
        identity=LiveIdentity.capture(model, optimizer),
        shape_signature=optimizer_shape_signature(optimizer),
    )


def _model_candidates(
    model: nn.Module, fqn_by_id: dict[int, str], optimized: set[str], scope: CheckpointScope, key_layout: str
) -> list[_Candidate]:
    """The model's tensor entries in ``state_dict`` order, each its own unit (its FQN)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    param_ptrs = {local_tensor(p).data_ptr() for p in model.parameters()}
    param_names = set(fqn_by_id.values())
    candidates: list[_Candidate] = []
    for fqn, t in get_model_state_dict(model).items():
        if not isinstance(t, torch.Tensor):
            continue
        local = local_tensor(t)
        role = ROLE_PARAM if local.data_ptr() in param_ptrs and fqn in param_names else ROLE_BUFFER
        placement = placement_of(t, scope.rank, scope.world_size, scope.plain_holders.get(fqn))
        entry = _entry(model_path(key_layout, fqn), role, fqn if role == ROLE_PARAM and fqn in optimized else None, local, placement)
        candidates.append((entry, local, fqn, placement))
    return candidates


def _owned_units(candidates: list[_Candidate]) -> set[str]:
    """The units (parameters with their optimizer state, buffers) this rank keeps (``ownership.py``)."""
    # A unit takes the placement of its first tensor: the parameter itself (model entries
    # come first), not a CPU step counter of its optimizer state, which every rank holds.
    unit_bytes: dict[str, int] = {}
    unit_placement: dict[str, TensorPlacement] = {}
    for entry, _, unit, placement in candidates:
        unit_bytes[unit] = unit_bytes.get(unit, 0) + entry.nbytes
        unit_placement.setdefault(unit, placement)
    buffer_units = {unit for entry, _, unit, _ in candidates if entry.role == ROLE_BUFFER}
    return owned_units(
        [
            OwnershipUnit(u, unit_bytes[u], unit_placement[u].replica_index, unit_placement[u].replica_count, u in buffer_units)
            for u in unit_bytes
        ]
    )


def _entry(
    path: tuple[str, ...], role: str, param_fqn: str | None, t: torch.Tensor, placement: TensorPlacement
) -> TensorEntry:
    return TensorEntry(
        key=".".join(path),
        path=path,
        role=role,
        param_fqn=param_fqn,
        dtype=t.dtype,
        shape=tuple(t.shape),
        nbytes=t.numel() * t.element_size(),
        global_shape=placement.global_shape,
        global_offset=placement.global_offset,
    )
