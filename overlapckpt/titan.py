"""``from overlapckpt.titan import OverlapCheckpointManager``: the TorchTitan checkpoint manager (``adapters/titan.py``)."""

from .adapters.titan import OverlapCheckpointManager
from .adapters.titan_dataloader import DataloaderState
from .adapters.titan_model_parts import merged_model_parts

__all__ = ["DataloaderState", "OverlapCheckpointManager", "merged_model_parts"]
