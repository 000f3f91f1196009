"""Hugging Face Trainer: ``OverlapCallback``, a ``TrainerCallback`` that checkpoints without stopping training.

Where it sits in the Trainer's loop (transformers 5.x):

* ``on_init_end``: moves itself to the front of the Trainer's callbacks, because the
  Trainer puts its reporting integrations (``report_to``: TensorBoard, W&B, ...) before
  user callbacks, and ``on_log`` must add the commit figures before they report.
* ``on_train_begin`` (after the Trainer restored a resumed run): builds the
  ``Checkpointer`` on the model and the torch optimizer inside the
  ``AcceleratedOptimizer``, continuing the resumed global step.
* ``on_pre_optimizer_step`` (after backward and clipping): ``ckpt.before_update()``.
* ``on_step_end`` (the update, the scheduler step and ``global_step += 1`` are done):
  ``ckpt.step()``, the boundary where the ``TrainerState``, the scheduler and the RNG
  states are captured, at the point where the Trainer's own ``_save_checkpoint`` would.
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
from typing import Any

import torch

from ..errors import ConfigError
from . import AdapterSettings, finish, metric_figures, require

_transformers = require("hf")
TrainerCallback = _transformers.TrainerCallback

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
    """Checkpoint a Hugging Face Trainer run in the background; resume with ``train(resume_from_checkpoint=dir)``.

    Args:
        output_dir: the checkpoint root (a local directory: the Trainer reads its files from there).
        every_n_steps: checkpoint after every N-th optimizer step (``state.global_step``), or None.
        window, consistency, keep: as for ``Checkpointer``.
        save_on_train_end: checkpoint the final step when training ends.
        **checkpointer_options: any other ``Checkpointer`` argument.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        every_n_steps: int | None = None,
        window: int | str = 1,
        consistency: str = "replay",
        keep: int | None = None,
        save_on_train_end: bool = True,
        **checkpointer_options: Any,
    ) -> None:
        self.settings = AdapterSettings.checked(
            "OverlapCallback", "output_dir", output_dir, ("export_formats",), every=every_n_steps, window=window,
            consistency=consistency, keep=keep, save_on_train_end=save_on_train_end, options=checkpointer_options,
        )
        self.output_dir = self.settings.root
        self.ckpt: Any = None
        self._state: _HFState | None = None
        self._figures: dict[str, float] = {}

    # ---- the Trainer's events ------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        callbacks = _calling_callback_list(self)
        if callbacks is None:
            log.warning("could not find the Trainer's callback list: commit figures reach report_to only from the next log")
            return
        callbacks.remove(self)
        callbacks.insert(0, self)  # before the reporting integrations, which the Trainer puts first

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        from ..checkpointer import Checkpointer
        from ..loading import list_checkpoints

        if getattr(args, "world_size", 1) > 1:
            raise ConfigError(
                f"OverlapCallback runs in one process for now (this run has {args.world_size}); the Trainer's resume files "
                "need the whole state in one writer"
            )
        self._state = _HFState(state, lr_scheduler)
        self.ckpt = Checkpointer(
            model,
            optimizer,  # an AcceleratedOptimizer: the torch optimizer inside is hooked
            self.output_dir,
            stateful={STATE_NAME: self._state},
            export_formats=("hf_trainer",),
            on_commit=self._on_commit,
            **self.settings.checkpointer_kwargs(),
        )
        if state.global_step > 0:  # the Trainer resumed: continue its step count and lineage
            ours = [i for i in list_checkpoints(self.output_dir) if i.step == state.global_step]
            self.ckpt.continued_from(ours[-1] if ours else state.global_step)
            log.info("continuing from global step %d", state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ckpt is not None:
            self.ckpt.before_update()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ckpt is None or self._state is None:
            return
        self._state.trainer_state = state
        self.ckpt.step()

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
