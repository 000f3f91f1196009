"""The training side of a distributed run: the checkpointing group, agreed settings, the writers' rendezvous.

Everything here runs once, in the Checkpointer's constructor, on every rank of the
group (like ``dcp.save``, it is called by every rank); it may use collectives of
the training process group. The hooks never do.

* The settings must be the same on every rank: they are gathered and compared, and
  a mismatch raises ``ConfigError`` on every rank, naming the setting and each
  rank's value.
* Training rank 0 hosts a TCPStore for the writers; its port is broadcast, and each
  rank's writer joins the writers' gloo group through it (``writer/group.py``).
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ConfigError
from ...format.peers import NodeLayout, node_key
from ...protocol import WriterGroupSpec, new_store_key
from ..copying.layout import CheckpointScope


@dataclass
class DistributedRun:
    """This rank's place in the checkpointing group, and what its writer needs to join the others."""

    scope: CheckpointScope
    group: Any  # the training ProcessGroup
    writer_spec: WriterGroupSpec
    store: Any  # the writers' TCPStore, hosted (and kept alive) by rank 0; None elsewhere


def is_distributed(process_group: Any) -> bool:
    """Whether this Checkpointer checkpoints together with other ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ConfigError(
                "process_group was passed but torch.distributed is not initialized; call "
                "torch.distributed.init_process_group() first, or drop process_group"
            )
        return False
    return dist.get_world_size(process_group) > 1


def mesh_shape_of(model: nn.Module, world_size: int) -> tuple[int, ...]:
    """The device mesh the model's DTensors live on (FSDP2, HSDP), or one dimension of the world."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return tuple(int(s) for s in mesh.shape)
    return (world_size,)


def agree_on_settings(settings: dict[str, Any], group: Any) -> None:
    """Raise ConfigError on every rank unless every rank passed the same settings."""
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, settings, group=group)
    differing = []
    for key in settings:
        values = [g.get(key) for g in gathered]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            differing.append(f"{key} ({per_rank})")
    if differing:
        raise ConfigError(
            f"the Checkpointer settings differ across ranks: {'; '.join(differing)}; construct the Checkpointer "
            "with the same settings on every rank"
        )


def set_up_distributed(
    model: nn.Module,
    process_group: Any,
    settings: dict[str, Any],
    collective_timeout_s: float,
    agreement_timeout_s: float,
    replaced_when_dead: bool,
) -> DistributedRun:
    """Agree on settings and set up the writers' rendezvous (collective: every rank calls it)."""
    group = process_group if process_group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    agree_on_settings(settings, group)
    store, port, host = None, 0, ""
    if rank == 0:
        reused = job_store_address()
        if reused is not None:
            host, port = reused  # the job's own store: the writers connect to it, no listener of ours
        else:
            # No TCPStore to reuse (a file:// or custom rendezvous): rank 0 hosts one. It
            # listens on every interface (TCPStore cannot bind one); see docs/security.md.
            host = _reachable_address()
            from datetime import timedelta

            store = dist.TCPStore(
                host, 0, world_size=None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=collective_timeout_s)
            )
            port = int(store.port)
    # A prefix for the writers' keys, and the key that seals their values (the prefix is
    # no secret to the store's other clients, the key is): shared over the training group only.
    host, port, key_prefix, store_key = broadcast_from_rank_0((host, port, secrets.token_hex(16), new_store_key()), group)
    spec = WriterGroupSpec(
        store_host=str(host),
        store_port=int(port),
        rank=rank,
        world_size=world,
        timeout_s=collective_timeout_s,
        agreement_timeout_s=agreement_timeout_s,
        mesh_shape=mesh_shape_of(model, world),
        key_prefix=str(key_prefix),
        store_key=bytes(store_key),
        replaced_when_dead=replaced_when_dead,
        # The writers' rounds go through each node's leader (writer/node_tree.py); the local
        # tier's replicas use the same nodes (builder.py).
        round_nodes=NodeLayout.from_keys(node_keys_of(group)).node_of_rank,
    )
    scope = CheckpointScope(rank=rank, world_size=world, plain_holders=plain_holders(model, group))
    return DistributedRun(scope=scope, group=group, writer_spec=spec, store=store)


def node_keys_of(group: Any) -> list[str]:
    """Each rank's node (host name and network namespace, ``format/peers.py``), by rank (collective: construction only)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, node_key(), group=group)
    return [str(h) for h in gathered]


def plain_holders(model: nn.Module, group: Any) -> dict[str, tuple[int, ...]]:
    """The plain (non-DTensor) model tensors that only some ranks hold, and which (a collective).

    With pipeline parallelism each rank holds its stages' layers: they are no replicas of
    the other ranks', so their owner is among the ranks that hold them. In DDP and FSDP
    every rank holds every plain tensor, and the result is empty.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    ours = sorted(k for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor) and getattr(v, "device_mesh", None) is None)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, ours, group=group)
    holders: dict[str, list[int]] = {}
    for r, keys in enumerate(gathered):
        for k in keys:
            holders.setdefault(k, []).append(r)
    world = len(gathered)
    return {k: tuple(ranks) for k, ranks in holders.items() if len(ranks) < world}


def broadcast_from_rank_0(value: Any, group: Any) -> Any:
    """Rank 0's ``value`` on every rank of ``group`` (a collective: construction only, never a hook)."""
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(cast(dist.ProcessGroup, group), 0), group=group)
    return box[0]


def job_store_address() -> tuple[str, int] | None:
    """(host, port) of the job's own TCPStore (torchrun's, or env:// rendezvous), if it has one.

    The writers then join the job's store as clients under a random prefix, as DCP's
    ``DCP_USE_PREFIX_STORE`` does, instead of rank 0 opening a listener of its own.
    """
    try:
        store: Any = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    host = str(store.host)
    if host in ("", "0.0.0.0", "::"):
        host = _reachable_address()
    return host, int(store.port)


def _reachable_address() -> str:
    """An address of this host (rank 0, which hosts the writers' store) that the other ranks can reach.

    The interface this host would use to reach the rendezvous address (torchrun's
    MASTER_ADDR) faces the other ranks; a UDP socket's connect picks it without
    sending anything. Without MASTER_ADDR (one-node runs), the loopback address.
    """
    target = os.environ.get("MASTER_ADDR")
    if not target or target in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, int(os.environ.get("MASTER_PORT", "29500"))))
            return str(s.getsockname()[0])
    except OSError:
        return target
