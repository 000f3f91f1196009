"""``from overlapckpt.hf import OverlapCallback``: the Hugging Face Trainer callback (``adapters/hf.py``)."""

from .adapters.hf import OverlapCallback

__all__ = ["OverlapCallback"]
