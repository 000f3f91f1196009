"""Reading a checkpoint TorchTitan's own ``CheckpointManager`` wrote: no manifest, so through the allowlists, unverified.

Separate from ``titan.py``: the manager decides whether such a checkpoint may be read at all
(``read_stock_checkpoints``, never with a signing key); this is only how it is read.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..format.key_layout import TORCHTITAN


def read_stock_checkpoint(store: Any, name: str, model: nn.Module, optimizers: Any, stateful: dict[str, Any], group: Any) -> None:
    """Restore a checkpoint TorchTitan's own manager wrote (no manifest), through the allowlists, unverified."""
    from ..optimizers import torch_optimizers, unwrap_optimizer
    from ..restore.apply import apply_state_dicts, live_state_dicts, named_as, unnamed
    from ..restore.read import ReadOptions, empty_like_on_cpu, read_into

    inner = None if optimizers is None else torch_optimizers(unwrap_optimizer(optimizers))
    msd, osd = live_state_dicts(model, inner)
    target = named_as(TORCHTITAN, msd, osd)
    saved = {k: obj.state_dict() for k, obj in stateful.items()}  # DCP fills the same keys from the checkpoint
    host = {**empty_like_on_cpu(target), **saved}
    read_into(store, name, host, group, ReadOptions(manifest=None))
    model_sd, optim_sd = unnamed(TORCHTITAN, {k: v for k, v in host.items() if k not in saved}, osd)
    apply_state_dicts(model, inner, model_sd, optim_sd)
    for key, obj in stateful.items():
        obj.load_state_dict(host[key])
