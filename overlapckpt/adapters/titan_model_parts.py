"""TorchTitan's model parts (pipeline stages on one rank) merged into one module under the names TorchTitan saves.

Separate from ``titan.py`` (the checkpoint manager): a pure transformation of modules,
tested on its own, that needs neither the manager nor torchtitan itself.
"""

from __future__ import annotations

from torch import nn

from ..errors import ConfigError


def merged_model_parts(parts: list[nn.Module]) -> nn.Module:
    """One module whose parameters and buffers are those of every part, under the names TorchTitan saves them.

    A pipeline stage is the whole model with the other stages' layers deleted, so its
    FQNs are the model's (``layers.3.attention.wq.weight``). Several stages on one rank
    are merged here: children found in more than one part (``layers``) are merged by
    name; the modules themselves are shared, never copied.
    """
    if not parts:
        raise ConfigError("model_parts is empty; pass the model's parts, as the trainer builds them")
    if len(parts) == 1:
        return parts[0]
    merged = nn.Module()
    for index, part in enumerate(parts):
        _merge_into(merged, part, f"model_parts[{index}]")
    return merged


def _merge_into(target: nn.Module, part: nn.Module, where: str) -> None:
    for name, tensor in list(part._parameters.items()) + list(part._buffers.items()):
        if tensor is None:
            continue
        if name in target._parameters or name in target._buffers:
            raise ConfigError(f"{where} and an earlier part both hold {name!r}; each part must hold different tensors")
        if name in part._parameters:
            target.register_parameter(name, part._parameters[name])
        else:
            target.register_buffer(name, tensor, persistent=name not in part._non_persistent_buffers_set)
    for name, child in part.named_children():
        existing = target._modules.get(name)
        if existing is None:
            target.add_module(name, child)
        elif existing is child:
            continue
        elif isinstance(existing, nn.ModuleDict) and isinstance(child, nn.ModuleDict):
            if not getattr(existing, "_overlapckpt_merged", False):
                existing = nn.ModuleDict(dict(existing.items()))
                existing._overlapckpt_merged = True  # type: ignore[assignment]
                target._modules[name] = existing
            for key, module in child.items():
                if key in existing:
                    raise ConfigError(f"{where} and an earlier part both hold {name}.{key}; each part must hold different layers")
                existing[key] = module
        else:
            raise ConfigError(f"{where} and an earlier part both have a child {name!r} that is not a ModuleDict; cannot merge them")
