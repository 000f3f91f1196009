"""The Checkpointer's settings: one frozen record, grouped by concern, checked in one place.

``Checkpointer.__init__`` turns its keywords into a ``CheckpointerSettings`` and hands it
to the builder (``builder.py``). Adding an option touches the record, its check in
``checked()``, and the one unit that uses it. In a distributed run the ranks agree on
``agreed()``: the record as ``dataclasses.asdict`` gives it, less the fields a rank may
hold on its own (storage credentials), so every setting that changes what is written
is compared, named per rank when it differs.

The live objects (model, optimizer, stateful objects, process group, callbacks) are no
settings: they are checked here too, by the functions below the record.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ConfigError, UnsupportedOptimizerError
from .format.extra_state import encode
from .format.key_layout import GET_STATE_DICT, KEY_LAYOUTS
from .format.storage import CheckpointStore
from .format.tiers import root_identity, tiers_for
from .optimizers import REPLAYABLE_OPTIMIZERS, describe_optimizer, update_rule_class
from .protocol import EXPORT_FORMATS

AUTO_WINDOW = "auto"
DEFAULT_MAX_WINDOW = 8  # window="auto" chooses at most this window
AUTO_INFLIGHT = "auto"  # max_inflight="auto": the slot count follows the state's size (train/copying/slots.py)
DEFAULT_LOCAL_KEEP = 2  # local-tier checkpoints kept: a few, as the tier is node memory
DEFAULT_LOCAL_REPLICAS = 1  # partner ranks on other nodes holding a copy of each local-tier shard
# A writer's replica traffic: 256 MiB/s is 2 Gb/s of a node's front-end link per rank sending,
# a 256 MiB shard a second, well inside a local_every=10 cadence of multi-second steps.
DEFAULT_REPLICA_MIB_PER_S = 256.0
DEFAULT_MAX_WRITER_RESTARTS = 3  # dead writers replaced per hour before the next death is raised
CONSISTENCY_MODES = ("replay", "stage")
# Fields each rank may hold on its own: not compared across ranks (the values may be credentials).
_PER_RANK = "per_rank"


@dataclass(frozen=True)
class StorageSettings:
    """Where checkpoints go and how they are named."""

    path: str
    storage_options: dict[str, Any] = field(default_factory=dict, metadata={_PER_RANK: True})
    store_class: type[CheckpointStore] = CheckpointStore
    key_layout: str = GET_STATE_DICT
    lease: bool = True  # take the root's lease at construction


@dataclass(frozen=True)
class OverlapSettings:
    """How the device-to-host copy is spread over steps (``window``, in optimizer steps), and kept consistent."""

    window: int | str = 1
    consistency: str = "replay"
    max_window: int = DEFAULT_MAX_WINDOW
    stage_budget_bytes: int | None = None


@dataclass(frozen=True)
class CadenceSettings:
    """When checkpoints are taken, how many are kept, how many may be in flight."""

    every: int | None = None
    keep: int | None = None
    # "auto": two slots (double buffering) for a small state in one process, else one (train/copying/slots.py).
    max_inflight: int | str = AUTO_INFLIGHT


@dataclass(frozen=True)
class TierSettings:
    """The node-local tier: a checkpoint every ``local_every`` steps into ``local_dir``, ``local_keep`` kept."""

    local_every: int | None = None  # None: no local tier
    local_keep: int = DEFAULT_LOCAL_KEEP
    # None: format.tiers.default_local_dir(path). Each node's own: nodes may mount their tmpfs or NVMe apart.
    local_dir: str | None = field(default=None, metadata={_PER_RANK: True})
    # Across nodes: each rank's shard is also held by this many ranks of other nodes (format/peers.py).
    local_replicas: int = DEFAULT_LOCAL_REPLICAS
    # Each writer sends its replicas at most this fast, so a copy never takes the network in a burst.
    replica_mib_per_s: float = DEFAULT_REPLICA_MIB_PER_S

    @property
    def enabled(self) -> bool:
        return self.local_every is not None

    def tiers_for(self, every: int | None, scheduled_version: int | None, on_request: bool) -> tuple[str, ...]:
        """The tiers a snapshot goes to (``format/tiers.py``'s routing, for this run's tiers)."""
        return tiers_for(self.enabled, every, scheduled_version, on_request)


@dataclass(frozen=True)
class WriterSettings:
    """The writer process, and what it writes besides DCP's files."""

    max_writer_restarts: int = DEFAULT_MAX_WRITER_RESTARTS
    writer_threads: int | None = None
    exit_timeout_s: float = 60.0
    export_formats: tuple[str, ...] = ()


@dataclass(frozen=True)
class DistributedSettings:
    """Bounds of the writers' group in a distributed run."""

    collective_timeout_s: float = 300.0
    agreement_timeout_s: float = 120.0


@dataclass(frozen=True)
class PreemptionSettings:
    """Checkpoint and exit on a signal."""

    save_on_signal: tuple[int, ...] = ()
    signal_grace_s: float | None = None


@dataclass(frozen=True)
class CheckpointerSettings:
    """Every setting of one Checkpointer."""

    storage: StorageSettings
    overlap: OverlapSettings = field(default_factory=OverlapSettings)
    cadence: CadenceSettings = field(default_factory=CadenceSettings)
    tier: TierSettings = field(default_factory=TierSettings)
    writer: WriterSettings = field(default_factory=WriterSettings)
    distributed: DistributedSettings = field(default_factory=DistributedSettings)
    preemption: PreemptionSettings = field(default_factory=PreemptionSettings)
    stateful_names: tuple[str, ...] = ()  # the stateful objects' names (the objects are no settings)

    def checked(self) -> CheckpointerSettings:
        """This record, or ConfigError naming the first invalid value and the fix."""
        w, c, wr, d, st = self.overlap, self.cadence, self.writer, self.distributed, self.storage
        if w.window != AUTO_WINDOW:
            check_positive_int("window", w.window, "the number of optimizer steps the copy is spread over, or 'auto'", allow_none=False)
        check_positive_int("max_window", w.max_window, "the widest window window='auto' may choose", allow_none=False)
        check_positive_int("every", c.every, "checkpoint after every N-th optimizer step, or None")
        check_positive_int("keep", c.keep, "the number of newest committed checkpoints to keep, or None")
        self._check_tier()
        check_positive_int(
            "writer_threads", wr.writer_threads, "the writer process's threads (replay kernels, one shard file each), or None for the default"
        )
        if isinstance(wr.max_writer_restarts, bool) or not isinstance(wr.max_writer_restarts, int) or wr.max_writer_restarts < 0:
            raise ConfigError(
                f"max_writer_restarts={wr.max_writer_restarts!r} is invalid; pass an integer >= 0 (0: a dead writer is raised at once)"
            )
        if c.max_inflight != AUTO_INFLIGHT:
            check_positive_int(
                "max_inflight", c.max_inflight,
                f"snapshots in flight at once, each costing one state of host memory; or {AUTO_INFLIGHT!r}", allow_none=False,
            )
        if st.key_layout not in KEY_LAYOUTS:
            raise ConfigError(
                f"key_layout={st.key_layout!r} is invalid; use {KEY_LAYOUTS[0]!r} (torch's get_state_dict names) or "
                f"{KEY_LAYOUTS[1]!r} (TorchTitan's CheckpointManager names)"
            )
        if w.consistency not in CONSISTENCY_MODES:
            raise ConfigError(f"consistency={w.consistency!r} is invalid; use 'replay' or 'stage'")
        budget = w.stage_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ConfigError(f"stage_budget_bytes={budget!r} is invalid; pass a byte count >= 0 or None")
        if not (isinstance(st.store_class, type) and issubclass(st.store_class, CheckpointStore)):
            raise ConfigError(f"store_class={st.store_class!r} is invalid; pass CheckpointStore or a subclass of it")
        if st.store_class.__module__ == "__main__":
            raise ConfigError(
                f"store_class {st.store_class.__qualname__} is defined in __main__, which the writer process cannot "
                "import; define it in an importable module"
            )
        for name, value in (("collective_timeout_s", d.collective_timeout_s), ("agreement_timeout_s", d.agreement_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name}={value!r} is invalid; pass a number of seconds > 0")
        _check_export_formats(wr.export_formats, st.path)
        return self

    def _check_tier(self) -> None:
        t = self.tier
        check_positive_int("local_every", t.local_every, "checkpoint into the node-local tier after every N-th optimizer step, or None")
        check_positive_int("local_keep", t.local_keep, "the number of newest local-tier checkpoints to keep", allow_none=False)
        if isinstance(t.local_replicas, bool) or not isinstance(t.local_replicas, int) or t.local_replicas < 0:
            raise ConfigError(
                f"local_replicas={t.local_replicas!r} is invalid; pass the number of other nodes that hold a copy of each "
                "rank's local-tier shard (0 for none, 1 by default)"
            )
        rate = t.replica_mib_per_s
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ConfigError(f"replica_mib_per_s={rate!r} is invalid; pass the most MiB per second each writer may send to its partners, > 0")
        if t.local_dir is None:
            return
        if not isinstance(t.local_dir, (str, os.PathLike)) or not os.fspath(t.local_dir):
            raise ConfigError(f"local_dir={t.local_dir!r} is invalid; pass a directory on this node (tmpfs or local NVMe), or None")
        if "://" in os.fspath(t.local_dir):
            raise ConfigError(
                f"local_dir={t.local_dir!r} is a URL; the local tier is a directory on this node (tmpfs or local NVMe): "
                "pass a local path, and put the URL in path="
            )
        if t.local_every is None:
            raise ConfigError(f"local_dir={t.local_dir!r} is set but local_every is None; pass local_every=N to write the local tier")
        # realpath: a local_dir that is a symlink to the root is the root (its retention would delete root checkpoints).
        real_local = root_identity(t.local_dir)
        if real_local == root_identity(self.storage.path):
            raise ConfigError(
                f"local_dir={t.local_dir!r} is the root itself (both are {real_local!r}); pass a separate directory on this node"
            )

    def agreed(self) -> dict[str, Any]:
        """What the ranks of a distributed run must have in common: ``asdict`` less each rank's own fields.

        Keyed by the Checkpointer's keyword names (unique across the groups), as a mismatch names them.
        """
        out: dict[str, Any] = {}
        for group in dataclasses.fields(self):
            value = getattr(self, group.name)
            if not dataclasses.is_dataclass(value):
                out[group.name] = value
                continue
            for f in dataclasses.fields(value):
                if not f.metadata.get(_PER_RANK):
                    item = getattr(value, f.name)
                    out[f.name] = f"{item.__module__}.{item.__qualname__}" if isinstance(item, type) else item
        return out


def check_positive_int(name: str, value: Any, meaning: str, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is invalid; pass an integer >= 1 ({meaning})")


def check_path(path: Any) -> str:
    """The checkpoint root as a string, or ConfigError (``path=123`` was a raw TypeError)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(f"path={path!r} is invalid; pass the checkpoint root, a directory path or a URL such as s3://bucket/prefix")
    return os.fspath(path)


def _check_export_formats(formats: Any, path: str) -> None:
    """Framework files written next to DCP's: known formats and a local root (the framework reads files)."""
    if isinstance(formats, str) or not all(f in EXPORT_FORMATS for f in formats):
        raise ConfigError(f"export_formats={formats!r} is invalid; pass a tuple of {EXPORT_FORMATS}, or ()")
    if formats and "://" in path and not path.startswith("file://"):
        raise ConfigError(f"export_formats={formats!r} writes files a framework reads from a local directory; {path!r} is not one")


def check_export_is_one_process(formats: tuple[str, ...], process_group: Any) -> None:
    """Framework files need the whole state in one writer: refused in a distributed run."""
    import torch.distributed as dist

    if formats and dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        raise ConfigError(f"export_formats={formats!r} is for one process: a rank's writer holds only its share of the state")


def check_model(model: Any) -> None:
    from torch import nn

    if not isinstance(model, nn.Module):
        raise ConfigError(f"model is a {type(model).__name__}; pass a torch.nn.Module")
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise ConfigError(
            f"the model's {on_meta[:3]}{' ...' if len(on_meta) > 3 else ''} are on the meta device (no data to "
            "checkpoint): materialize the model first (model.to_empty(device=...) and initialize or load its "
            "weights), then build the Checkpointer"
        )


def check_optimizer_matches_model(model: Any, optimizer: Any, given_to: str = "Checkpointer") -> None:
    """Raise ConfigError when the optimizer updates tensors that are not ``model``'s parameters.

    An optimizer built over another instance of the same model (a second ``build_model()``)
    looks alike by shapes; without this check torch's ``set_state_dict`` fails with a bare
    ``KeyError: 0``, after it has begun changing the live objects.
    """
    model_params = {id(p) for p in model.parameters()}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) not in model_params:
                raise ConfigError(
                    f"optimizer.param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is not a "
                    f"parameter of the model passed to {given_to}; build the optimizer from "
                    "model.parameters() of that same model"
                )


def check_stateful(stateful: Any) -> dict[str, Any]:
    if not isinstance(stateful, dict):
        raise ConfigError(f"stateful={stateful!r} is invalid; pass a dict mapping names to objects with state_dict()/load_state_dict()")
    for name, obj in stateful.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"stateful key {name!r} is invalid; use a non-empty string name")
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise ConfigError(
                    f"stateful[{name!r}] is a {type(obj).__name__} without {method}(); pass an object that "
                    "implements the Stateful protocol (state_dict() and load_state_dict())"
                )
        encode(obj.state_dict(), f"stateful[{name!r}].state_dict()")
    return dict(stateful)


def check_optimizer_for_mode(optimizer: torch.optim.Optimizer, window: int | str, consistency: str) -> None:
    may_replay = window == AUTO_WINDOW or window > 1  # type: ignore[operator]
    if not (may_replay and consistency == "replay"):
        return
    rule = update_rule_class(optimizer)
    if rule is None:
        raise UnsupportedOptimizerError(
            f"{describe_optimizer(optimizer)} cannot be replayed: replay steps one optimizer class over the state, and these "
            "differ. Use window=1, or window>1 or 'auto' with consistency='stage'"
        )
    if rule.__name__ not in REPLAYABLE_OPTIMIZERS:
        raise UnsupportedOptimizerError(
            f"{rule.__module__}.{rule.__qualname__} cannot be replayed: replay needs an "
            "elementwise, per-tensor update rule (SGD, Adam, AdamW, Adagrad, RMSprop, ...). Use window=1, "
            "or window>1 or 'auto' with consistency='stage'"
        )
