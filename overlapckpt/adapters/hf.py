"""Hugging Face Trainer: ``OverlapCallback``, a ``TrainerCallback`` that checkpoints without stopping training.

Adding the callback is the only change a Trainer script needs: it follows the
``TrainingArguments`` (``output_dir``, ``save_strategy``, ``save_steps``,
``save_total_limit``) and names its checkpoints as the Trainer does, ``checkpoint-N``
under ``output_dir``, so ``trainer.train(resume_from_checkpoint=True)`` finds the newest.
The Trainer's own saves are switched off for the steps this callback checkpoints.

Where it sits in the Trainer's loop (transformers 5.x):

* ``on_init_end``: moves itself right after the Trainer's ``DefaultFlowCallback``: after
  it, so that ``on_step_end`` sees (and takes over) the save it asks for; before the
  reporting integrations (``report_to``: TensorBoard, W&B, ...), so that ``on_log`` adds
  the commit figures before they report.
* ``on_train_begin`` (after the Trainer restored a resumed run): builds the
  ``Checkpointer`` on the model and the torch optimizer inside the
  ``AcceleratedOptimizer``, continuing the resumed global step.
* ``on_pre_optimizer_step`` (after backward and clipping): ``ckpt.before_update()``.
* ``on_step_end`` (the update, the scheduler step and ``global_step += 1`` are done):
  ``ckpt.step()``, the boundary where the ``TrainerState``, the scheduler and the RNG
  states are captured, at the point where the Trainer's own ``_save_checkpoint`` would.
* ``on_epoch_end``: with ``save_strategy="epoch"``, requests a checkpoint.
* ``on_train_end``: checkpoints the final step, waits for the checkpoints in flight.

Every checkpoint directory also holds the files ``trainer.train(resume_from_checkpoint=dir)``
reads (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``,
``trainer_state.json``), written by the writer process from the same snapshot
(``writer/exports.py``), never by a save in the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import sys
import warnings
from typing import Any

import torch

from ..errors import ConfigError
from ..user_log import say_resumed
from . import AdapterSettings, commit_line, finish, metric_figures, require

_transformers = require("hf")
TrainerCallback = _transformers.TrainerCallback
_trainer_log = _transformers.utils.logging.get_logger("transformers.trainer")

log = logging.getLogger("overlapckpt.hf")
STATE_NAME = "hf"  # the stateful object writer/exports.py reads


class _HFState:
    """What the Trainer's own checkpoint holds besides the tensors, captured at each boundary."""

    def __init__(self, trainer_state: Any, lr_scheduler: Any) -> None:
        self.trainer_state = trainer_state  # replaced by the Trainer on a resume: kept current by the callback
        self.lr_scheduler = lr_scheduler

    def state_dict(self) -> dict[str, Any]:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        return {
            "trainer_state": dataclasses.asdict(self.trainer_state),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else {},
            "rng": {
                "python": random.getstate(),
                "numpy": (str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)),
                "cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,  # one device, as the Trainer saves it
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ConfigError("resume a Hugging Face run with trainer.train(resume_from_checkpoint=<checkpoint directory>)")


class OverlapCallback(TrainerCallback):  # type: ignore[misc, valid-type]
    """Checkpoint a Hugging Face Trainer run in the background; resume with ``train(resume_from_checkpoint=True)``.

    With no arguments it follows the run's ``TrainingArguments``: checkpoints go to
    ``output_dir`` as ``checkpoint-N``, every ``save_steps`` steps (``save_strategy="steps"``)
    or at each epoch's end (``"epoch"``), keeping ``save_total_limit`` of them. Each
    argument given here overrides its ``TrainingArguments`` counterpart.

    Args:
        output_dir: the checkpoint root (a local directory: the Trainer reads its files from there).
        save_steps: checkpoint after every N-th optimizer step (``state.global_step``).
        save_total_limit: keep only the newest N checkpoints of this run.
        window: as for ``Checkpointer``.
        consistency: as for ``Checkpointer``.
        save_on_train_end: checkpoint the final step when training ends.
        every_n_steps: the former name of ``save_steps`` (deprecated).
        local_save_steps: also checkpoint into the node-local tier every N steps (``Checkpointer``'s
            ``local_every``; ``local_keep`` and ``local_dir`` go in the options). Each local
            checkpoint holds the Trainer's files too; ``newest_checkpoint()`` names the newest
            verified of the two tiers, for ``train(resume_from_checkpoint=...)``.
        **checkpointer_options: any other ``Checkpointer`` argument.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        save_steps: int | None = None,
        save_total_limit: int | None = None,
        window: int | str = 1,
        consistency: str = "replay",
        save_on_train_end: bool = True,
        every_n_steps: int | None = None,
        local_save_steps: int | None = None,
        **checkpointer_options: Any,
    ) -> None:
        if every_n_steps is not None:
            warnings.warn("OverlapCallback(every_n_steps=) is now save_steps=, the Trainer's name for it", DeprecationWarning, stacklevel=2)
            save_steps = every_n_steps if save_steps is None else save_steps
        if "keep" in checkpointer_options:
            save_total_limit = checkpointer_options.pop("keep")
        # What was given here, over the TrainingArguments (None: the TrainingArguments' value).
        self._output_dir_given = None if output_dir is None else os.fspath(output_dir)
        self._save_steps_given, self._save_total_limit_given = save_steps, save_total_limit
        self.settings = AdapterSettings.checked(
            "OverlapCallback", "output_dir", output_dir if output_dir is not None else ".", ("export_formats",), every=save_steps,
            window=window, consistency=consistency, keep=save_total_limit, save_on_train_end=save_on_train_end,
            options=checkpointer_options, local_every=local_save_steps,
        )
        self.output_dir = self._output_dir_given  # from the TrainingArguments at the start of training, if None
        self._save_each_epoch = False
        self.ckpt: Any = None
        self._state: _HFState | None = None
        self._figures: dict[str, float] = {}

    def newest_checkpoint(self, output_dir: str | os.PathLike[str] | None = None) -> str | None:
        """The checkpoint directory to resume from: the local tier's newest when it is the newest verified, else the root's.

        For ``trainer.train(resume_from_checkpoint=callback.newest_checkpoint(args.output_dir))``;
        None when neither tier holds a checkpoint. The root is ``output_dir`` (or the one given here).
        """
        from ..errors import CheckpointNotFoundError
        from ..restore.locate import checkpoint_at
        from ..restore.tiers import RestoreScope, local_candidate

        root = os.fspath(output_dir) if output_dir is not None else (self.output_dir or self.settings.root)
        settings = dataclasses.replace(self.settings, root=root)
        local_dir = settings.local_dir()
        if local_dir is not None:
            candidate = local_candidate(RestoreScope(root, None, self.settings.options.get("storage_options")), local_dir)
            if candidate is not None:
                return candidate.url
        try:
            store, name = checkpoint_at(root, None, self.settings.options.get("storage_options"))
        except CheckpointNotFoundError:
            return None
        return store.checkpoint_url(name)

    # ---- the Trainer's events ------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        callbacks = _calling_callback_list(self)
        if callbacks is None:
            log.warning("could not find the Trainer's callback list: commit figures reach report_to only from the next log")
            return
        callbacks.remove(self)
        flow = [i for i, c in enumerate(callbacks) if isinstance(c, _transformers.trainer_callback.DefaultFlowCallback)]
        # After the flow callback (its save request is ours to take), before the reporting integrations.
        callbacks.insert(flow[0] + 1 if flow else 0, self)

    def _settings_from(self, args: Any, state: Any) -> AdapterSettings:
        """This callback's settings, completed from the run's TrainingArguments."""
        strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
        every, keep = self._save_steps_given, self._save_total_limit_given
        if strategy == "best" and every is None:
            raise ConfigError(
                "TrainingArguments(save_strategy='best') is not supported by OverlapCallback (it saves on a schedule); "
                "pass save_strategy='steps' or 'epoch', or OverlapCallback(save_steps=N)"
            )
        if every is None and strategy == "steps":
            every = int(state.save_steps) if state.save_steps else None
        self._save_each_epoch = every is None and strategy == "epoch"
        if keep is None:
            keep = args.save_total_limit
        root = self._output_dir_given if self._output_dir_given is not None else os.fspath(args.output_dir)
        self.output_dir = root
        return dataclasses.replace(self.settings, root=root, every=every, keep=keep)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        from ..checkpointer import Checkpointer
        from ..restore import list_checkpoints

        if getattr(args, "world_size", 1) > 1:
            raise ConfigError(
                f"OverlapCallback runs in one process for now (this run has {args.world_size}); the Trainer's resume files "
                "need the whole state in one writer"
            )
        self.settings = self._settings_from(args, state)
        self._state = _HFState(state, lr_scheduler)
        self.ckpt = Checkpointer(
            model,
            optimizer,  # an AcceleratedOptimizer: the torch optimizer inside is hooked
            self.settings.root,
            stateful={STATE_NAME: self._state},
            export_formats=("hf_trainer",),
            on_commit=self._on_commit,
            **self.settings.checkpointer_kwargs(),
        )
        if state.global_step > 0:  # the Trainer resumed: continue its step count and lineage
            ours = [i for i in list_checkpoints(self.settings.root) if i.step == state.global_step]
            self.ckpt.continued_from(ours[-1] if ours else state.global_step)
            if ours:
                say_resumed(ours[-1].path, ours[-1].step, "root, read by the Trainer", None)
            else:
                log.info("continuing from global step %d (a checkpoint of the Trainer's own)", state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ckpt is not None:
            self.ckpt.before_update()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.ckpt is None or self._state is None:
            return None
        self._state.trainer_state = state
        self.ckpt.step()
        control.should_save = False  # this callback checkpoints the run: the Trainer's own save would stop it
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.ckpt is None:
            return None
        if self._save_each_epoch and state.global_step > 0:
            self.ckpt.request()
        control.should_save = False
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is not None and self._figures:
            logs.update(self._figures)  # the reporting callbacks, after this one, send them on
            self._figures = {}

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ckpt is None:
            return
        try:
            finish(self.ckpt, self.settings.save_on_train_end)
        finally:
            self.ckpt = None

    def request(self) -> None:
        """Checkpoint the state of the last completed optimizer step (as ``Checkpointer.request``)."""
        if self.ckpt is None:
            raise ConfigError("OverlapCallback.request() is for the training loop, between on_train_begin and on_train_end")
        self.ckpt.request()

    def _on_commit(self, figures: dict[str, Any]) -> None:
        # One line where the Trainer logs its own "Saving model checkpoint to ..." (its verbosity).
        _trainer_log.info(commit_line(figures))
        # The latest commit's figures, for the next on_log (one value per name and step).
        self._figures = metric_figures(figures)


def _calling_callback_list(callback: Any) -> list[Any] | None:
    """The callback list of the CallbackHandler that is calling ``callback`` now (it holds no reference to it)."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        callbacks = getattr(owner, "callbacks", None)
        if isinstance(callbacks, list) and any(c is callback for c in callbacks):
            return callbacks
        frame = frame.f_back  # type: ignore[assignment]
    return None
