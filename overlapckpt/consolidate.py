"""One consolidated file from a committed checkpoint: ``torch.save`` or safetensors, as stock DCP's ``dcp_to_torch_save`` writes.

For tools that take one file: a Hugging Face ``from_pretrained`` directory, an
evaluation script, a model hub. The checkpoint is read whole into host memory through
the same checks as ``load`` (the allowlists, every blob against its checksum, the
signature with a key), then written to a temporary file beside ``out`` and renamed onto
it, so ``out`` is never half-written.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError
from .format.manifest import CheckpointInfo
from .restore.contents import read_checkpoint

FORMATS = ("torch", "safetensors")


@dataclass(frozen=True)
class ExportOptions:
    """What ``export_checkpoint`` writes, and which checkpoint it reads how; built by keyword."""

    fmt: str = "torch"  # "torch" (torch.save of model and optimizer) or "safetensors" (the model only)
    step: int | None = None  # of a root: the checkpoint of this step; None: the newest
    model_only: bool = False  # torch format: leave the optimizer's state out
    storage_options: dict[str, Any] | None = None  # fsspec options for a remote checkpoint
    signing_key: str | bytes | None = None  # check the checkpoint's signature (None: OVERLAPCKPT_SIGNING_KEY, if set)


def export_checkpoint(
    path: str,
    out: str | os.PathLike[str],
    options: ExportOptions | None = None,
    *,
    on_stage: Callable[[str], None] | None = None,
) -> CheckpointInfo:
    """Write checkpoint ``path`` (a directory, or the root: ``options.step``, else the newest) to the file ``out``.

    ``ExportOptions(fmt="torch")`` (the default): ``torch.save`` of ``{"model": ..., "optimizer": ..., "step": N}`` (the
    optimizer's state keyed by parameter name, as ``get_state_dict`` gives it; ``model_only``
    leaves it out), loadable with ``torch.load(out, weights_only=True)``. ``fmt="safetensors"``:
    the model's tensors only (safetensors holds nothing else), with the step in the file's
    metadata. ``on_stage`` is told what is being done (the CLI's progress line).
    """
    options = options if options is not None else ExportOptions()
    fmt = options.fmt
    if fmt not in FORMATS:
        raise ConfigError(f"fmt={fmt!r} is invalid; use one of {FORMATS}")
    target = os.fspath(out)
    if os.path.isdir(target):
        raise ConfigError(f"out={target!r} is a directory; pass a file path such as {os.path.join(target, 'model.pt')}")
    save_safetensors: Callable[..., Any] | None = None
    if fmt == "safetensors":
        try:
            save_safetensors = importlib.import_module("safetensors.torch").save_file
        except ImportError as e:
            raise ConfigError("exporting to safetensors needs the safetensors package: pip install safetensors") from e
    say = on_stage or (lambda _text: None)
    say(f"reading {path}")
    contents = read_checkpoint(path, step=options.step, storage_options=options.storage_options, signing_key=options.signing_key)
    step_held = contents.info.step
    tmp = f"{target}.tmp-{os.getpid()}"
    say(f"writing {target}")
    try:
        if save_safetensors is not None:
            # safetensors refuses views that share storage, and non-contiguous ones: plain copies.
            tensors = {k: v.detach().contiguous().clone() for k, v in contents.model.items() if isinstance(v, torch.Tensor)}
            save_safetensors(tensors, tmp, metadata={"step": str(step_held), "source": contents.info.path})
        else:
            whole: dict[str, Any] = {"model": contents.model, "step": step_held}
            if not options.model_only and contents.optimizer is not None:
                whole["optimizer"] = contents.optimizer
            torch.save(whole, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    say(f"wrote {target}")
    return contents.info
