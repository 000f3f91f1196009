"""TorchTitan's data loader as a stateful object whose restore reads plain data only (``DataloaderState``).

Separate from ``titan.py`` (the checkpoint manager): it is the one piece of TorchTitan's
state that needs its own reader, and it needs neither the manager nor torchtitan itself.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import ConfigError


class DataloaderState:
    """A TorchTitan data loader as a stateful object whose restore never unpickles code.

    ``ParallelAwareDataloader.state_dict()`` holds ``pickle.dumps`` of torchdata's state
    under ``dp_rank_<r>``, and its ``load_state_dict`` calls ``pickle.loads`` on it. That
    form is kept for TorchTitan's own manager; here it is read by a plain-data unpickler.
    """

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader

    def state_dict(self) -> dict[str, Any]:
        return self.dataloader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from ..format.safe_unpickle import load_plain_data

        rank_key = getattr(self.dataloader, "_rank_id", None)
        stateful_loader = _stateful_dataloader_base(self.dataloader)
        if rank_key is None or stateful_loader is None:
            self.dataloader.load_state_dict(state)  # not TorchTitan's pickling loader: its own restore
            return
        if not state:
            return
        if rank_key not in state:
            raise ConfigError(
                f"the checkpoint's data loader state has no {rank_key!r} (it has {sorted(state)}); resume with the "
                "data-parallel degree that wrote it"
            )
        if state.get("world_size") != self.dataloader.dp_world_size:
            raise ConfigError(
                f"the checkpoint's data loader state is for {state.get('world_size')} data-parallel ranks, and this "
                f"run has {self.dataloader.dp_world_size}; TorchTitan's loader cannot reshard it"
            )
        stateful_loader.load_state_dict(self.dataloader, load_plain_data(state[rank_key], f"the data loader state {rank_key}"))


def _stateful_dataloader_base(dataloader: Any) -> Any:
    try:
        StatefulDataLoader = importlib.import_module("torchdata.stateful_dataloader").StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader if isinstance(dataloader, StatefulDataLoader) else None
