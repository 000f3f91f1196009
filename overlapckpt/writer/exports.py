"""Framework formats written next to the DCP files, by the writer, from the snapshot in host memory.

``hf_trainer``: the files Hugging Face's ``Trainer.train(resume_from_checkpoint=dir)``
reads, so that its own resume works on an overlapckpt checkpoint directory:

- ``model.safetensors``: the model's tensors (written here, byte for byte, in the
  safetensors layout: a little-endian u64 header length, a JSON header, then the raw
  data; no copy of the snapshot). A tensor that shares storage with an earlier one
  (tied embeddings) is written once; Hugging Face reloads with ``strict=False`` and
  re-ties it.
- ``optimizer.pt`` and ``scheduler.pt``: ``torch.save`` of the optimizer's state dict
  in torch's own form and of the scheduler's; ``rng_state.pth``: Python's, numpy's and
  torch's RNG states; ``trainer_state.json``: the ``TrainerState`` at the boundary.
  Hugging Face reads the three ``.pt``/``.pth`` files with ``weights_only=True``.

Each file is written into the attempt's directory before DCP's ``.metadata``, and its
size and CRC-32 go into the manifest (``exports``), so ``verify`` covers it and the
commit publishes it with the rest.
"""

from __future__ import annotations

import dataclasses
import io
import json
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ConfigError
from ..format.blob_macs import default_mac_algorithm, mac_of, new_nonce
from ..format.entries import optimizer_state_by_index
from ..format.manifest_records import ExportRecord
from ..format.storage import CheckpointStore
from ..protocol import EXPORT_FORMATS

HF_STATE_NAME = "hf"  # the stateful object the Hugging Face adapter captures at each boundary
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def write_exports(
    store: CheckpointStore,
    directory: str,
    formats: tuple[str, ...],
    state_dict: dict[str, Any],
    extra_state: dict[str, Any],
    signing_key: bytes | None = None,
) -> dict[str, ExportRecord]:
    """Write each format's files into ``directory``; their sizes and CRC-32s (MACs, with a key), by file name."""
    written: dict[str, ExportRecord] = {}
    mac_algorithm = default_mac_algorithm() if signing_key is not None else None
    for fmt in formats:
        if fmt != "hf_trainer":
            raise ConfigError(f"export format {fmt!r} is unknown; use one of {EXPORT_FORMATS}")
        for name, data in _hf_trainer_files(state_dict, extra_state):
            store.write_bytes(directory, name, data)
            record = ExportRecord(nbytes=len(data), crc32=zlib.crc32(data) & 0xFFFFFFFF)
            if signing_key is not None and mac_algorithm is not None:
                nonce = new_nonce()
                record = dataclasses.replace(record, mac=mac_of(signing_key, mac_algorithm, nonce, 0, data), mac_nonce=nonce)
            written[name] = record
    return written


def _hf_trainer_files(state_dict: dict[str, Any], extra_state: dict[str, Any]) -> Iterator[tuple[str, bytes]]:
    """Each file's bytes, built only when it is written: one file in memory at a time."""
    hf = extra_state.get("stateful", {}).get(HF_STATE_NAME)
    if hf is None:
        raise ConfigError("export 'hf_trainer' needs the Hugging Face adapter's state; use overlapckpt.hf.OverlapCallback")
    yield "model.safetensors", safetensors_bytes(state_dict["model"])
    yield "optimizer.pt", _torch_save(optimizer_state_by_index(_owned(state_dict["optimizer"])))
    yield "scheduler.pt", _torch_save(hf["lr_scheduler"])
    yield "rng_state.pth", _torch_save(_rng_file(hf["rng"]))
    yield "trainer_state.json", (json.dumps(hf["trainer_state"], indent=2, sort_keys=True) + "\n").encode("utf-8")


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """The safetensors file of ``tensors`` (storage shared with an earlier tensor: written once)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    chunks: list[memoryview] = []
    offset = 0
    seen: set[tuple[int, int]] = set()
    for key in tensors:  # state-dict order: of tied names the first (the embedding) is kept, as save_pretrained does
        t = tensors[key].detach()
        identity = (t.untyped_storage().data_ptr() + int(t.storage_offset()) * t.element_size(), int(t.numel()))
        if identity in seen:
            continue  # a tied weight: Hugging Face re-ties it after a strict=False load
        seen.add(identity)
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ConfigError(f"tensor {key!r} has dtype {t.dtype}, which safetensors cannot store")
        t = t.contiguous()
        raw: Any = t.reshape(-1).view(torch.uint8).numpy()  # the tensor's bytes in place, no copy
        data = memoryview(raw) if t.numel() else memoryview(b"")
        header[key] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    raw_header = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw_header += b" " * (-len(raw_header) % 8)  # the data starts 8-byte aligned
    return b"".join([struct.pack("<Q", len(raw_header)), raw_header, *chunks])


def _owned(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state with tensors of their own (a view of the host slot would save the whole slot)."""
    return {
        "state": {fqn: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for fqn, s in optimizer_state["state"].items()},
        "param_groups": optimizer_state["param_groups"],
    }


def _rng_file(rng: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    kind, keys, pos, has_gauss, cached = rng["numpy"]
    python_version, python_state, python_gauss = rng["python"]
    out = {
        "python": (python_version, tuple(python_state), python_gauss),
        "numpy": (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
        "cpu": rng["cpu"],
    }
    if rng.get("cuda") is not None:
        out["cuda"] = rng["cuda"]
    return out


def _torch_save(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
