"""TorchTitan: ``OverlapCheckpointManager``, a checkpoint manager that checkpoints without stopping training.

Selected by the job's config, in place of TorchTitan's ``CheckpointManager``::

    from overlapckpt.titan import OverlapCheckpointManager
    config.checkpoint = OverlapCheckpointManager.Config(enable=True, interval=500, window=1)

Where it sits in the trainer's loop (torchtitan 0.3, ``Trainer.train_step``/``train``):

* ``__init__`` (the trainer's set-up): builds the ``Checkpointer`` on the model parts
  (several, with pipeline stages, are one merged view) and the ``OptimizersContainer``
  (hooked on its own ``step()``, which fires its pre-hooks, MoE load balancing among
  them, after our fence; its state read from the optimizers inside). ``train_state``,
  ``lr_scheduler``, ``dataloader`` and any other ``states`` are stateful objects,
  captured at each boundary, and the RNG states with them (the stock manager saves none).
* ``load(step)`` at the start of ``train()``: restores the newest checkpoint (or
  ``load_step``'s), verified, with the steps a load takes to create optimizer state
  not counted. A directory without overlapckpt's manifest (one TorchTitan's own manager
  wrote) is read only when ``read_stock_checkpoints=True`` (through the same allowlists,
  unverified: it has no checksums), and never in a signed folder or one that holds
  overlapckpt checkpoints, where a missing manifest means a deleted one.
* ``maybe_wait_for_staging()``, right before ``optimizers.step()``: ``before_update()``,
  the fence of the copies started after the previous step.
* ``save(step, last_step)``, at the end of every step: ``step()``, the boundary, and a
  request on the first step (if enabled) and the last one; the ``interval`` is the
  Checkpointer's own schedule (``every``), so that a replay window opens early enough for
  ``step-N`` to hold step N. The last step also waits until the checkpoint is durable.
* ``maybe_wait_for_saving()``: ``wait()``. ``close()``: finishes what is in flight.

The checkpoints are in TorchTitan's layout (``format/key_layout.py``): ``step-N``
directories, model FQNs at the top level, ``optimizer.state.*`` and flat
``optimizer.param_groups.*``, ``lr_scheduler``, ``dataloader`` and ``train_state`` as
DCP items, so TorchTitan's stock ``CheckpointManager`` loads them; they also hold
overlapckpt's manifest (checksums, the ledger, the stateful objects as JSON, the RNG
states), which is what this manager restores from.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, CorruptCheckpointError, SignatureError
from ..format.key_layout import TORCHTITAN
from ..format.manifest import MANIFEST_NAME
from ..format.storage import CheckpointStore
from . import commit_line, require
from .titan_dataloader import DataloaderState
from .titan_model_parts import merged_model_parts
from .titan_stock import read_stock_checkpoint

_titan_base = require("titan")
BaseCheckpointManager = _titan_base.BaseCheckpointManager
_titan_log = importlib.import_module("torchtitan.tools.logging").logger

log = logging.getLogger("overlapckpt.titan")

MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE = "model", "optimizer", "lr_scheduler", "dataloader", "train_state"
# Options of TorchTitan's Config this manager does not implement, with what to do instead.
_NOT_IMPLEMENTED = {
    "last_save_in_hf": "export Hugging Face safetensors from a checkpoint with TorchTitan's own CheckpointManager",
    "initial_load_in_hf": "convert the Hugging Face weights to a DCP checkpoint first, and pass it as initial_load_path",
    "create_seed_checkpoint": "create the seed checkpoint with TorchTitan's own CheckpointManager",
}


class OverlapCheckpointManager(BaseCheckpointManager):  # type: ignore[misc, valid-type]
    """TorchTitan's checkpoint manager contract, fulfilled by overlapckpt's ``Checkpointer``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[name-defined]
        window: int | str = 1
        """Optimizer steps the device-to-host copy is spread over (1: exact at the step), or 'auto'."""

        consistency: str = "replay"
        """With window > 1: 'replay' (rolled forward on the CPU, no GPU memory) or 'stage' (exact, GPU memory)."""

        max_inflight: int | str = "auto"
        """Checkpoints in flight at once; each holds one host copy of this rank's state ('auto': one in a distributed run)."""

        writer_threads: int | None = None
        """The writer process's threads (None: a quarter of the cores, 1 to 4)."""

        save_on_signal: list[str] = field(default_factory=list)
        """Signals (e.g. ['SIGTERM']) on which every rank agrees on one step, checkpoints it and exits."""

        signal_grace_s: float | None = None
        """Seconds from the signal to the commit (None: 25 s, inside torchrun's 30 s before SIGKILL)."""

        storage_options: dict[str, Any] = field(default_factory=dict)
        """fsspec options for a remote folder (endpoint_url, key, secret, ...)."""

        local_interval: int | None = None
        """Also checkpoint into a node-local tier every N steps (None: none); resume takes the newer verified tier."""

        local_keep_latest_k: int = 2
        """Local-tier checkpoints kept."""

        local_folder: str | None = None
        """The local tier's directory (None: /dev/shm/overlapckpt-<job>-<hash>, named after the folder)."""

        local_replicas: int = 1
        """Across nodes: partner ranks on other nodes that also hold each rank's local-tier shard."""

        local_replica_mib_per_s: float = 256.0
        """The most each writer sends to its partners per second."""

        read_stock_checkpoints: bool = False
        """Resume from a checkpoint TorchTitan's own CheckpointManager wrote (no manifest: unverified), in a folder
        that holds no overlapckpt checkpoints and with no signing key. A checkpoint named by initial_load_path is
        an explicit choice already."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            for name, instead in _NOT_IMPLEMENTED.items():
                if getattr(self, name):
                    raise ConfigError(f"checkpoint.{name}=True is not implemented by OverlapCheckpointManager; {instead}")
            for name in self.save_on_signal:
                if not isinstance(getattr(signal, str(name), None), signal.Signals):
                    raise ConfigError(f"checkpoint.save_on_signal names {name!r}, which is no signal; use names such as 'SIGTERM'")

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        from ..checkpointer import Checkpointer

        self.enable = config.enable
        self.save_future: Future[None] | None = None
        if not self.enable:
            return
        self.config = config
        self.folder = _join(base_folder, config.folder)
        self.interval = config.interval
        self.load_only = config.load_only
        self._model = merged_model_parts(model_parts)
        self._optimizers = optimizers
        self._stateful = _saved_states(states, lr_schedulers, dataloader, config.exclude_from_loading)
        self._warned_step_mismatch = False
        self.ckpt = Checkpointer(
            self._model,
            optimizers,  # an OptimizersContainer: hooked on its step, state read from inside (optimizers.py)
            self.folder,
            window=config.window,
            every=None if config.load_only else config.interval,  # step-N holds step N, replay windows included
            keep=config.keep_latest_k or None,
            stateful=self._stateful,
            storage_options=dict(config.storage_options),
            consistency=config.consistency,
            max_inflight=config.max_inflight,
            writer_threads=config.writer_threads,
            save_on_signal=tuple(getattr(signal, str(s)) for s in config.save_on_signal),
            signal_grace_s=config.signal_grace_s,
            key_layout=TORCHTITAN,
            local_every=None if config.load_only else config.local_interval,
            local_keep=config.local_keep_latest_k,
            local_dir=config.local_folder if config.local_interval is not None else None,
            local_replicas=config.local_replicas,
            replica_mib_per_s=config.local_replica_mib_per_s,
            on_commit=lambda figures: _titan_log.info(commit_line(figures)),  # TorchTitan's own log, as its saves
        )
        log.info("overlapckpt checkpoints to %s, window %s", self.folder, config.window)
        if config.last_save_model_only:
            log.info(
                "checkpoint.last_save_model_only: the last step's checkpoint holds the whole state here (export a "
                "model-only checkpoint in export_dtype with TorchTitan's own CheckpointManager)"
            )

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit; close() was the trainer's to call
            pass

    # ---- the hooks BaseCheckpointManager dispatches to -------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        due = self._due(curr_step, last_step)
        if due:
            if self.ckpt.step_count != curr_step and not self._warned_step_mismatch:
                self._warned_step_mismatch = True
                log.warning(
                    "the trainer is at step %d but %d optimizer steps were taken since the restored checkpoint: "
                    "checkpoint directories are named by optimizer steps (step-%d)",
                    curr_step, self.ckpt.step_count, self.ckpt.step_count,
                )
            if curr_step % self.interval != 0:
                # The first step or the last one: not on the interval's schedule, which the Checkpointer
                # runs itself (every=interval: a replay window opens early, so that step-N holds step N).
                self.ckpt.request()
                self.save_future = Future()  # a marker: maybe_wait_for_saving dispatches to _wait_for_saving only if set
        self.ckpt.step()  # every step: the boundary of the stateful objects and RNG states
        if last_step:
            self._wait_for_saving()  # durable before the trainer exits, as the stock manager's synchronous save
        return due

    def _due(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        return last_step or curr_step % self.interval == 0 or (curr_step == 1 and self.config.enable_first_step_checkpoint)

    def _maybe_wait_for_staging(self) -> None:
        self.ckpt.before_update()

    def _wait_for_saving(self) -> None:
        self.ckpt.wait()
        self.save_future = None

    def _close(self) -> None:
        ckpt = getattr(self, "ckpt", None)
        if ckpt is not None:
            del self.ckpt  # once: __del__ calls close() again
            ckpt.close()

    def _load(self, step: int = -1) -> bool:
        from ..restore.pipeline import load

        if step == -1 and self._local_tier_holds_any():
            return self._load_newest_tier()
        name = self._checkpoint_to_load(step)
        if name is None:
            return self._initial_load()
        directory = _join(self.folder, name)
        stateful, optimizer = self._load_targets()
        ours = _is_ours(self.ckpt.store, name)
        if not ours:
            self._check_stock_allowed(name, directory)
        with self.ckpt.steps_not_counted():  # a load may step the optimizers once to create their state
            if ours:
                info = load(
                    directory, self._model, optimizer, stateful, storage_options=dict(self.config.storage_options),
                    process_group=self.ckpt.process_group,
                )
                self.ckpt.continued_from(info)
                log.info("restored %s", directory)
                return True
            read_stock_checkpoint(self.ckpt.store, name, self._model, optimizer, stateful, self.ckpt.process_group)
        version = _step_of(name)
        self.ckpt.continued_from(version)
        log.info("restored %s, written by TorchTitan's own manager (no manifest: not verified)", directory)
        return True

    def _load_targets(self) -> tuple[dict[str, Any], Any]:
        """The stateful objects and the optimizers a resume loads into, less ``exclude_from_loading``."""
        excluded = set(self.config.exclude_from_loading)
        stateful = {k: v for k, v in self._stateful.items() if k not in excluded}
        return stateful, None if OPTIMIZER in excluded else self._optimizers

    def _local_tier_holds_any(self) -> bool:
        """Whether some node's local tier holds a checkpoint (every rank gets the same answer: a replaced node's tier is empty)."""
        local_dir = self.ckpt.local_dir
        holds = local_dir is not None and os.path.isdir(local_dir) and bool(CheckpointStore(local_dir).committed_names())
        group = self.ckpt.process_group
        if local_dir is None or group is None:
            return holds
        import torch.distributed as dist

        flag = torch.tensor([int(holds)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def _load_newest_tier(self) -> bool:
        """Resume from the newest verified of this node's local tier and the folder (``restore/tiers.py``)."""
        from ..restore.pipeline import LoadTargets

        stateful, optimizer = self._load_targets()
        # Across nodes a replaced node's ranks get the files through the writers (restore/tiers.py).
        info = self.ckpt.restore(into=LoadTargets(self._model, optimizer, stateful))
        log.info("restored %s", info.path)
        return True

    def _check_stock_allowed(self, name: str, directory: str) -> None:
        """Refuse a directory without a manifest unless reading TorchTitan's own checkpoints was chosen, and it is safe.

        Deleting a signed checkpoint's manifest used to make this manager read it as a stock
        checkpoint, with no checks: tampered shards loaded.
        """
        if self.ckpt.signed:
            raise SignatureError(
                f"{directory} has no {MANIFEST_NAME}, and a signing key is set: an unsigned checkpoint is refused in a "
                "signed folder (its manifest may have been deleted). Resume from a signed checkpoint (checkpoint.load_step)"
            )
        ours = [n for n in self.ckpt.store.committed_names() if _is_ours(self.ckpt.store, n)]
        if ours:
            raise CorruptCheckpointError(
                f"{directory} has no {MANIFEST_NAME}, while this folder holds overlapckpt checkpoints ({', '.join(ours[-3:])}): "
                "its manifest was deleted, or it was copied in. It is refused; resume from one of those "
                "(checkpoint.load_step), or name a TorchTitan checkpoint explicitly with checkpoint.initial_load_path"
            )
        if not self.config.read_stock_checkpoints:
            raise ConfigError(
                f"{directory} has no {MANIFEST_NAME}: TorchTitan's own CheckpointManager wrote it, so it has no checksums. "
                "Set checkpoint.read_stock_checkpoints=True to resume from it unverified"
            )

    def _checkpoint_to_load(self, step: int) -> str | None:
        """The directory to resume from: ``step``'s, or the newest committed one; None when the folder has none."""
        names = self.ckpt.store.committed_names()
        if step != -1:
            matching = [n for n in names if _step_of(n) == step]
            if not matching:
                raise ConfigError(
                    f"checkpoint.load_step={step}, but {self.folder} has no committed checkpoint of that step; it has "
                    f"{[_step_of(n) for n in names]}"
                )
            return matching[-1]
        return names[-1] if names else None

    def _initial_load(self) -> bool:
        """A fresh folder: the initial checkpoint, if one is configured (model only, unless configured otherwise)."""
        path = self.config.initial_load_path
        if not path:
            log.info("no checkpoint under %s: a fresh start", self.folder)
            return False
        from ..format.storage import CheckpointStore

        parent, name = path.rstrip("/").rsplit("/", 1)
        store = CheckpointStore(parent or "/", dict(self.config.storage_options))
        if not store.is_committed(name):
            raise ConfigError(f"checkpoint.initial_load_path={path!r} is not a DCP checkpoint directory (it has no .metadata)")
        ours = _is_ours(store, name)
        if not ours and self.ckpt.signed:
            raise SignatureError(
                f"checkpoint.initial_load_path={path!r} has no {MANIFEST_NAME}, and a signing key is set: an unsigned "
                "checkpoint is refused; unset OVERLAPCKPT_SIGNING_KEY to load a TorchTitan checkpoint unverified"
            )
        model_only = self.config.initial_load_model_only
        optimizers, stateful = (None, {}) if model_only else (self._optimizers, self._stateful)
        with self.ckpt.steps_not_counted():
            if ours:  # one of overlapckpt's: verified (checksums, and the signature with a key)
                from ..restore.pipeline import load

                load(
                    path, self._model, optimizers, stateful, storage_options=dict(self.config.storage_options),
                    per_rank_state="restore" if stateful else "skip", process_group=self.ckpt.process_group,
                )
            else:
                read_stock_checkpoint(store, name, self._model, optimizers, stateful, self.ckpt.process_group)
        log.info("loaded the initial checkpoint %s (%s)", path, "model only" if model_only else "whole state")
        return True


def _saved_states(states: dict[str, Any], lr_schedulers: Any, dataloader: Any, exclude_from_loading: list[str]) -> dict[str, Any]:
    """The stateful objects each checkpoint holds besides model and optimizer; ``exclude_from_loading`` must name saved ones."""
    stateful = {
        **{k: v for k, v in states.items() if k not in (MODEL, OPTIMIZER)},
        LR_SCHEDULER: lr_schedulers,
        **({} if dataloader is None else {DATALOADER: DataloaderState(dataloader)}),
    }
    for name in exclude_from_loading:
        if name not in stateful and name != OPTIMIZER:
            raise ConfigError(
                f"checkpoint.exclude_from_loading names {name!r}, which is not saved; the saved states are "
                f"{sorted([OPTIMIZER, *stateful])}"
            )
    return stateful


def _is_ours(store: Any, name: str) -> bool:
    return bool(store.fs.exists(store._join(name, MANIFEST_NAME)))


def _step_of(name: str) -> int:
    from ..format.manifest import step_of_name

    step = step_of_name(name)
    if step is None:
        raise ConfigError(f"{name!r} is not a checkpoint directory name (step-N)")
    return step


def _join(base: str, folder: str) -> str:
    if "://" in folder or os.path.isabs(folder) or not base:
        return folder
    return base.rstrip("/") + "/" + folder
