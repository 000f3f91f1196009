"""Non-tensor state (stateful objects, RNG states) as tagged JSON, for the manifest.

``state_dict()`` of a scheduler, sampler or data loader holds numbers, strings,
lists, tuples, dicts (sometimes with int keys) and small tensors. JSON keeps them
readable and free of pickle: tuples, non-string keys, tensors and bytes carry a tag.
Floats round-trip exactly (``repr`` is shortest-exact), including inf and nan.
"""

from __future__ import annotations

import base64
import ctypes
from typing import Any

import torch

from ..errors import ConfigError, CorruptCheckpointError

_TAG = "__overlapckpt__"


def encode(value: Any, where: str = "state") -> Any:
    """Turn ``value`` into JSON-able data; raise ConfigError naming the first unsupported leaf."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        return {
            _TAG: "tensor",
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": base64.b64encode(tensor_bytes(t)).decode("ascii"),
        }
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "data": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {_TAG: "dict", "items": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise ConfigError(
        f"{where} is a {type(value).__name__}, which overlapckpt cannot store; a stateful object's "
        "state_dict() may hold only None, bool, int, float, str, bytes, tensors, lists, tuples and dicts"
    )


def decode(value: Any) -> Any:
    """Invert :func:`encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: decode(v) for k, v in value.items()}
    if tag == "tuple":
        return tuple(decode(v) for v in value["items"])
    if tag == "dict":
        return {_hashable(decode(k)): decode(v) for k, v in value["items"]}
    if tag == "bytes":
        return base64.b64decode(value["data"])
    if tag == "tensor":
        dtype = _DTYPES.get(value["dtype"]) if isinstance(value["dtype"], str) else None
        if dtype is None:
            raise CorruptCheckpointError(
                f"the manifest's extra state names the dtype {value['dtype']!r}, which is no torch dtype; the file is damaged"
            )
        raw = base64.b64decode(value["data"])
        if not raw:
            return torch.empty(value["shape"], dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(value["shape"])
    raise CorruptCheckpointError(f"unknown tag {tag!r} in the manifest's extra state; the file is damaged")


# Every dtype by the name encode() writes: looked up here, never with getattr(torch, name),
# whose lazy __getattr__ imports a submodule of that name ("onnx" imports torch.onnx).
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a contiguous CPU tensor (a copy)."""
    nbytes = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k
