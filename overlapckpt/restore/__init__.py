"""Restoring committed checkpoints: locate, check, read, apply; ``load`` runs them as one pipeline.

* ``locate``: list a root, resolve ``latest`` or a step, tell a checkpoint directory from a root;
* ``check``: the signature, the manifest's fields, the files' sizes, and that the checkpoint fits
  the live objects, all before anything is read;
* ``read``: the tensors into host memory through DCP, each blob checked as it arrives;
* ``apply``: into the live model, optimizer, stateful objects and RNG states;
* ``contents``: the whole checkpoint into plain host dicts, without live objects (a framework's resume).

Nothing here imports the training side (an import contract checks it).
"""

from ..format.entries import optimizer_state_by_index
from .contents import CheckpointContents, read_checkpoint
from .locate import list_checkpoints
from .pipeline import load

__all__ = ["CheckpointContents", "list_checkpoints", "load", "optimizer_state_by_index", "read_checkpoint"]
