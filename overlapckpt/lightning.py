"""``from overlapckpt.lightning import OverlapCheckpoint``: the Lightning callback (``adapters/lightning.py``)."""

from .adapters.lightning import OverlapCheckpoint

__all__ = ["OverlapCheckpoint"]
