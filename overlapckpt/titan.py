"""``from overlapckpt.titan import OverlapCheckpointManager``: the TorchTitan checkpoint manager (``adapters/titan.py``)."""

from .adapters.titan import DataloaderState, OverlapCheckpointManager, merged_model_parts

__all__ = ["DataloaderState", "OverlapCheckpointManager", "merged_model_parts"]
