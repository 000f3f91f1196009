"""What a run settles at construction, on every rank alike: its id, and the root's lease."""

from __future__ import annotations

from ...errors import RootLeaseError
from ...format.lease import RootLease
from ...format.storage import CheckpointStore
from .distributed import DistributedRun, broadcast_from_rank_0
from .lineage import new_run_id


def agreed_run_id(distributed: DistributedRun | None) -> str:
    """A new run id; in a distributed run, rank 0's, so every rank's manifest section names one run."""
    run_id = new_run_id()
    if distributed is not None:
        run_id = str(broadcast_from_rank_0(run_id, distributed.group))
    return run_id


def take_root_lease(store: CheckpointStore, run_id: str, distributed: DistributedRun | None) -> RootLease | None:
    """Rank 0 takes the root's lease (the held lease, on rank 0 only); in a distributed run every rank raises if it could not."""
    lease = RootLease(store, run_id)
    if distributed is None:
        lease.acquire()
        return lease
    refusal: str | None = None
    if distributed.scope.rank == 0:
        try:
            lease.acquire()
        except RootLeaseError as e:
            refusal = str(e)
    refusal = broadcast_from_rank_0(refusal, distributed.group)
    if refusal is not None:
        raise RootLeaseError(refusal)
    return lease if distributed.scope.rank == 0 else None
