"""Lightning: ``OverlapCheckpoint``, a ``Checkpoint`` callback that checkpoints without stopping training.

Where it sits in Lightning's loop (pytorch-lightning 2.6, ``lightning.pytorch`` alike):

* ``setup``: refuses strategies that bypass torch's step hooks, and wraps the
  strategy's ``CheckpointIO`` so that ``trainer.fit(ckpt_path=<our directory>)``
  reads an overlapckpt checkpoint; every other path goes to the wrapped one.
* ``on_train_start`` (after Lightning restored a resumed run): builds the
  ``Checkpointer`` on the LightningModule and the torch optimizer inside
  ``trainer.optimizers[0]``, continuing the resumed version, and restores the RNG states.
* ``on_before_optimizer_step`` (inside Lightning's closure, after backward and
  clipping): ``ckpt.before_update()``, the fence right before the update.
* ``on_train_batch_end``: ``ckpt.step()``, the iteration boundary, where the rest of
  Lightning's checkpoint is captured (loops, callbacks, LR schedulers, precision
  plugin, datamodule), then each commit's figures go to ``trainer.loggers``.
* ``on_train_end``: waits for the checkpoints in flight and closes.

The model's parameters and buffers and the optimizer's state are copied in the
background like any overlapckpt checkpoint; the rest is Lightning's own
``dump_checkpoint`` without the tensors, JSON in the manifest, never pickle.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from ..errors import CheckpointNotFoundError, ConfigError
from ..restore import CheckpointContents, optimizer_state_by_index, read_checkpoint
from ..restore.apply import restore_rng
from ..restore.tiers import RestoreReport, RestoreScope, Source, from_newest_tier
from ..user_log import say_resumed
from . import AdapterSettings, commit_line, finish, metric_figures, require

_pl = require("lightning")
ModelCheckpoint = _pl.callbacks.ModelCheckpoint
CheckpointIO = _pl.plugins.io.CheckpointIO
# Lightning's warning when fit(ckpt_path="last") finds nothing: on a first run with this callback that is
# expected, and its hint (save_last=True) is wrong for it; the callback logs its own line instead.
_NO_LAST_WARNING = r'.*ckpt_path="last"\) is set, but there is no last checkpoint available.*'

log = logging.getLogger("overlapckpt.lightning")
STATE_NAME = "lightning"  # the stateful object under which Lightning's own checkpoint is kept
# Keys of Lightning's checkpoint dict that are not restored by fit(ckpt_path=...): the tensors
# (ours), and the hyperparameters (restored by the module's constructor).
_NOT_KEPT = ("state_dict", "optimizer_states", "hyper_parameters", "hparams_name", "datamodule_hyper_parameters")


class _LightningState:
    """Lightning's checkpoint, less its tensors, as a stateful object: captured at each boundary."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        return {k: v for k, v in checkpoint.items() if k not in _NOT_KEPT}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Never called: a resume goes through Lightning's own restore (_OverlapCheckpointIO).
        raise ConfigError("resume a Lightning run with trainer.fit(model, ckpt_path=<checkpoint directory or root>)")


class _OverlapCheckpointIO(CheckpointIO):  # type: ignore[misc, valid-type]
    """Reads overlapckpt checkpoints for Lightning's resume; hands everything else to the wrapped CheckpointIO."""

    def __init__(self, inner: Any, callback: OverlapCheckpoint) -> None:
        super().__init__()
        self.inner = inner
        self.callback = callback

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if not self.callback.holds(path):
            return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return self.callback._read_for_resume(str(path))


class OverlapCheckpoint(ModelCheckpoint):  # type: ignore[misc, valid-type]
    """Checkpoint a Lightning run in the background; resume with ``trainer.fit(model, ckpt_path="last")``.

    ``ckpt_path="last"``, Lightning's own idiom, resumes the newest verified checkpoint of
    ``dirpath`` (and of the node-local tier), and starts fresh on the first run, when there
    is none: the same line serves the first run and every restart. (Lightning resolves
    "last" through its ``ModelCheckpoint`` callbacks, so this callback is one that saves no
    ``.ckpt`` file of its own.) ``ckpt_path=<one checkpoint directory>`` resumes that one.

    Args:
        dirpath: the checkpoint root (a local directory or an fsspec URL such as s3://bucket/prefix).
        every_n_train_steps: checkpoint after every N-th optimizer step (Lightning's ``global_step``),
            or None to checkpoint only when ``request()`` is called.
        window: as for ``Checkpointer``.
        consistency: as for ``Checkpointer``.
        keep: as for ``Checkpointer``.
        save_on_train_end: checkpoint the final state when training ends (unless it is just checkpointed).
        local_every_n_train_steps: also checkpoint into the node-local tier every N optimizer steps
            (``Checkpointer``'s ``local_every``; ``local_keep`` and ``local_dir`` go in the options).
            ``fit(ckpt_path=dirpath)`` then resumes from the newest verified of the two tiers.
        **checkpointer_options: any other ``Checkpointer`` argument (storage_options, signing_key, ...).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        every_n_train_steps: int | None = None,
        window: int | str = 1,
        consistency: str = "replay",
        keep: int | None = None,
        save_on_train_end: bool = True,
        local_every_n_train_steps: int | None = None,
        **checkpointer_options: Any,
    ) -> None:
        # A ModelCheckpoint that saves nothing itself (no top-k, no last.ckpt): Lightning asks it for "last".
        super().__init__(dirpath=None, save_top_k=0, save_last=False)
        self.settings = AdapterSettings.checked(
            "OverlapCheckpoint", "dirpath", dirpath, (), every=every_n_train_steps, window=window, consistency=consistency,
            keep=keep, save_on_train_end=save_on_train_end, options=checkpointer_options, local_every=local_every_n_train_steps,
        )
        self.dirpath = self.settings.root
        self.ckpt: Any = None  # the Checkpointer, from on_train_start to on_train_end
        self._resumed: tuple[CheckpointContents, RestoreReport] | None = None
        # The resume's figures (Checkpointer.restore_figures: its source and times); the loggers get restore_s too.
        self.restore_figures: dict[str, Any] | None = None
        self._figures: list[dict[str, Any]] = []

    @property
    def state_key(self) -> str:
        return "OverlapCheckpoint"  # one per Trainer: a resume into another dirpath finds its state

    # ---- Lightning's hooks ---------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        kind = type(strategy).__name__
        if "DeepSpeed" in kind:
            raise ConfigError(
                f"OverlapCheckpoint cannot hook {kind}: DeepSpeed steps its own optimizer and bypasses torch's step "
                "hooks. Use strategy='ddp' (or 'auto'), or DeepSpeed's own checkpointing"
            )
        if kind == "FSDPStrategy":
            raise ConfigError(
                "OverlapCheckpoint does not support FSDPStrategy (FSDP1's flat parameters); use "
                "ModelParallelStrategy (FSDP2, fully_shard) or 'ddp'"
            )
        if not isinstance(strategy.checkpoint_io, _OverlapCheckpointIO):
            strategy.checkpoint_io = _OverlapCheckpointIO(strategy.checkpoint_io, self)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from ..checkpointer import Checkpointer

        if len(trainer.optimizers) != 1:
            raise ConfigError(
                f"OverlapCheckpoint checkpoints one optimizer; configure_optimizers returned {len(trainer.optimizers)}. "
                "Combine the parameter groups into one optimizer"
            )
        # Under DDP torch.distributed is initialized here: the Checkpointer checkpoints with every rank.
        self.ckpt = Checkpointer(
            pl_module,
            trainer.optimizers[0],  # a LightningOptimizer or a torch optimizer: the torch one is hooked
            self.dirpath,
            stateful={STATE_NAME: _LightningState(trainer)},
            on_commit=self._on_commit,
            **self.settings.checkpointer_kwargs(),
        )
        resumed, self._resumed = self._resumed, None
        if resumed is not None:
            contents, report = resumed
            self.ckpt.continued_from(contents.info, report)
            self.restore_figures = self.ckpt.restore_figures
            say_resumed(contents.info.path, contents.info.step, report.source, report.choose_s + report.read_s)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        pass  # ModelCheckpoint's .ckpt saves: this callback checkpoints on its own schedule

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        pass

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """What ``fit(ckpt_path="last")`` resumes: this root when it or the local tier holds a checkpoint, else none.

        The root, not one directory: reading it (``_read_for_resume``) takes the newest
        verified of the two tiers, falling back past a refused one.
        """
        import torch.distributed as dist

        from ..restore.locate import anything_to_restore

        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        storage_options = self.settings.options.get("storage_options")
        if anything_to_restore(self.dirpath, self.settings.local_dir(), storage_options, group):
            return {self.dirpath}
        log.info("no checkpoint under %s yet: fit(ckpt_path=\"last\") starts fresh", self.dirpath)
        warnings.filterwarnings("ignore", message=_NO_LAST_WARNING)
        return set()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.ckpt is not None:
            self.ckpt.before_update()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.ckpt is None:
            return
        self.ckpt.step()
        self._log_figures(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.ckpt is None:
            return
        try:
            finish(self.ckpt, self.settings.save_on_train_end)
        finally:
            self.ckpt = None
        self._log_figures(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            ckpt.__exit__(type(exception), exception, None)  # commits what is complete, never raises

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.ckpt is not None:  # training stopped without on_train_end (an interrupt)
            ckpt, self.ckpt = self.ckpt, None
            ckpt.close()

    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": self.dirpath}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # where checkpoints go is this run's setting, not the resumed one's

    # ---- checkpoints ---------------------------------------------------------------

    def request(self) -> None:
        """Checkpoint the state of the last completed optimizer step (as ``Checkpointer.request``)."""
        if self.ckpt is None:
            raise ConfigError("OverlapCheckpoint.request() is for the training loop, between on_train_start and on_train_end")
        self.ckpt.request()

    def holds(self, path: Any) -> bool:
        """Whether ``path`` is one of our checkpoints, or a root holding them, rather than a Lightning .ckpt file."""
        from ..restore.locate import holds_checkpoints

        text = str(path).rstrip("/")
        if text.endswith(".ckpt"):
            return False
        if text == self.dirpath.rstrip("/"):
            return True  # this callback's root: its checkpoints may be in the local tier only
        try:
            return holds_checkpoints(text, self.settings.options.get("storage_options"))
        except (OSError, ConfigError):  # CheckpointReadError is an OSError
            return False

    def _read_for_resume(self, path: str) -> dict[str, Any]:
        """Lightning's checkpoint dict from one of ours: tensors from the shards, the rest from the manifest."""
        import torch.distributed as dist

        from ..restore.locate import anything_to_restore

        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else 0
        storage_options = self.settings.options.get("storage_options")

        def read(source: Source) -> CheckpointContents:
            return read_checkpoint(
                source.url, storage_options=storage_options if source.is_root else None,
                signing_key=self.settings.options.get("signing_key"), rank=rank,
            )

        # The root itself (fit(ckpt_path="last") or dirpath): the newest verified of the local tier and the root.
        at_root = path.rstrip("/") == self.dirpath.rstrip("/")
        if at_root and not anything_to_restore(path, self.settings.local_dir(), storage_options, dist.group.WORLD if distributed else None):
            raise CheckpointNotFoundError(
                f"fit(ckpt_path={path!r}): no checkpoint under it yet; pass ckpt_path=\"last\", which resumes the newest "
                "checkpoint and starts fresh when there is none (a first run)"
            )
        report = RestoreReport()
        scope = RestoreScope(path, None, storage_options, dist.group.WORLD if distributed else None, dist.get_world_size() if distributed else 1)
        contents = from_newest_tier(scope, self.settings.local_dir() if at_root else None, read, report=report)
        if STATE_NAME not in contents.stateful:
            raise ConfigError(
                f"{contents.info.path} was not written by OverlapCheckpoint (it holds no Lightning state); restore it "
                "with overlapckpt.load(path, model, optimizer) instead"
            )
        if contents.optimizer is None:
            raise ConfigError(f"{contents.info.path} holds no optimizer state, which fit(ckpt_path=...) needs")
        checkpoint = dict(contents.stateful[STATE_NAME])
        checkpoint["state_dict"] = contents.model
        checkpoint["optimizer_states"] = [optimizer_state_by_index(contents.optimizer)]
        # The RNG states were captured at the end of the batch, before the next epoch's data
        # loader iterator drew its seed; Lightning's resume builds that iterator after this
        # restore and before on_train_start, so they are set here, as Lightning restores the rest.
        restore_rng(contents.rng)
        self._resumed = contents, report  # its version is taken up in on_train_start, its figures with the next commit
        log.info("reading %s for Lightning's resume", contents.info.path)
        return checkpoint

    def _on_commit(self, figures: dict[str, Any]) -> None:
        _pl.utilities.rank_zero.rank_zero_info(commit_line(figures))  # as Lightning reports its own saves
        self._figures.append(figures)  # handed to the loggers at the next batch end, in the loop's own order

    def _log_figures(self, trainer: Any) -> None:
        figures, self._figures = self._figures, []
        for fig in figures:
            metrics = metric_figures(fig)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
