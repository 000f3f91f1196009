"""DCP's ``torch.save`` of one small tensor, written from a template: the same bytes, in one write.

DCP's ``_write_item`` stores each tensor as ``torch.save(tensor, stream)``: a zip of seven
records. For a small tensor the bytes are few but the call is not: about 160 us of
pickling and zip framing, and 39 ``write`` calls into the checksumming stream
(``checksumming_stream.py``), about 60 us more. A model of 30,000 small tensors spent 6.7 s of its
commit there (2-core VM).

With torch.save's zip CRCs off (the writer turns them off: ``writer/process.py``), the
blob of a tensor depends on its data only in the data record: everything else (the
pickle, the headers, the alignment padding, the serialization id) is fixed by the
tensor's dtype, shape, strides, storage offset, storage size and ``requires_grad``, and
by torch's save settings. So the blob is ``prefix + storage bytes + suffix``, and the
prefix and suffix of one such key serve every tensor with that key.

Nothing here assumes that beyond the CRCs: with them on (or where torch cannot say) no
template is used. The template of a key is taken from a real ``torch.save``, then checked
against real ``torch.save`` output for the next ``VERIFY_SAMPLES`` tensors of that key whose
bytes differ from those already seen, byte for byte; a key whose real blobs differ from
the template (another torch's framing) is saved by ``torch.save`` from then on. Only plain
CPU tensors under ``SMALL_TENSOR_MAX_BYTES`` take this road: above it the call's cost is
lost in the bytes' own write, and the stream recognises the tensor's memory for its known
checksum (``known_sums.py``), which a copy into one buffer would hide.

``install()`` routes the ``torch.save`` calls of DCP's filesystem module here, and only
those whose stream is overlapckpt's ``ChecksummingStream``; every other caller, and any
object that is not such a tensor, gets torch.save itself.
"""

from __future__ import annotations

import ctypes
import io
import logging
import threading
import types
from typing import Any

import torch

from .checksumming_stream import ChecksummingStream
from .tensor_decode import locate

log = logging.getLogger("overlapckpt")

# At or above this many storage bytes a tensor goes through torch.save: its ~0.2 ms is then
# small beside writing and hashing the bytes, and known_sums.py's shortcut starts at 1 MiB.
SMALL_TENSOR_MAX_BYTES = 1 << 20
# Real torch.save blobs a key's template must equal, after the one it was taken from.
VERIFY_SAMPLES = 2

_Key = tuple[Any, ...]


class _Template:
    __slots__ = ("prefix", "suffix", "verified", "checked_data")

    def __init__(self, prefix: bytes, suffix: bytes, source_data: bytes) -> None:
        self.prefix = prefix
        self.suffix = suffix
        self.verified = 0  # real blobs of other data seen equal to prefix + data + suffix
        # The data of the blobs that made and checked the template: a check counts only on data
        # unlike these, or a frame that depends on the data (zero tensors' CRCs) would pass it.
        self.checked_data = {source_data}


_serialization_config: Any
try:
    from torch.utils.serialization import config as _serialization_config
except ImportError:  # an older torch: no configurable alignment
    _serialization_config = None
_get_crc32_options = getattr(torch.serialization, "get_crc32_options", None)
_has_names = getattr(torch.Tensor, "has_names", None)


def _save_settings() -> tuple[Any, ...]:
    """torch's settings that change a blob's framing: part of every key, so a change takes a new template."""
    crc = _get_crc32_options() if _get_crc32_options is not None else None
    alignment = getattr(_serialization_config.save, "storage_alignment", None) if _serialization_config is not None else None
    return (crc, alignment)


def _storage_bytes(tensor: torch.Tensor) -> bytes:
    """The whole storage, as torch.save writes it (its data record holds every byte of the storage)."""
    storage = tensor.untyped_storage()
    return ctypes.string_at(storage.data_ptr(), storage.nbytes())


def _real_blob(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    _TORCH_SAVE(tensor, out)
    return out.getvalue()


class TensorBlobTemplates:
    """Per-key templates of torch.save's blob for small plain tensors, each checked against real blobs before use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # DCP writes several files from several threads
        self._templates: dict[_Key, _Template | None] = {}  # None: this key's blobs do not fit a template

    @staticmethod
    def key_of(obj: Any, settings: tuple[Any, ...]) -> _Key | None:
        """The key a template serves, or None for anything else than a small plain CPU tensor saved without zip CRCs."""
        if type(obj) is not torch.Tensor:  # a Parameter, a subclass: torch.save pickles more
            return None
        if settings[0] is not False:  # the zip CRCs on (or unknown): the frame holds the data's CRC
            return None
        t: torch.Tensor = obj
        try:
            if (
                t.device.type != "cpu"
                or t.layout != torch.strided
                or t.is_nested
                or t.is_quantized
                or t.is_conj()
                or t.is_neg()
                or (_has_names is not None and _has_names(t))  # named tensors (gone from newer torch)
                or t._backward_hooks  # pickled with the tensor
                or t.__dict__  # Python attributes: pickled with the tensor
            ):
                return None
            storage_nbytes = t.untyped_storage().nbytes()
            if storage_nbytes == 0 or storage_nbytes >= SMALL_TENSOR_MAX_BYTES:
                return None
            return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), storage_nbytes, t.requires_grad, settings)
        except Exception:  # noqa: BLE001 - a tensor kind this does not know: torch.save decides what it is
            return None

    def blob(self, tensor: torch.Tensor, key: _Key) -> bytes | None:
        """torch.save's bytes for ``tensor``: from the template once verified, else real (and learned from); None:
        this key does not fit a template, call torch.save."""
        with self._lock:
            template = self._templates.get(key, _UNSEEN)
        if template is None:
            return None
        if isinstance(template, _Template) and template.verified >= VERIFY_SAMPLES:
            return template.prefix + _storage_bytes(tensor) + template.suffix
        real = _real_blob(tensor)
        with self._lock:
            self._learn(key, tensor, real)
        return real

    def _learn(self, key: _Key, tensor: torch.Tensor, real: bytes) -> None:
        template = self._templates.get(key, _UNSEEN)
        if template is None or (isinstance(template, _Template) and template.verified >= VERIFY_SAMPLES):
            return  # another thread settled it meanwhile
        if not isinstance(template, _Template):
            self._templates[key] = self._template_from(real, tensor)
            return
        data = _storage_bytes(tensor)
        if template.prefix + data + template.suffix != real:
            log.debug("overlapckpt: torch.save's blob of %s is not a fixed frame around its bytes; saved whole", key[:5])
            self._templates[key] = None
        elif data not in template.checked_data:
            template.checked_data.add(data)
            template.verified += 1
            if template.verified >= VERIFY_SAMPLES:
                template.checked_data = set()  # no longer needed

    @staticmethod
    def _template_from(real: bytes, tensor: torch.Tensor) -> _Template | None:
        record = locate(memoryview(real))
        data = _storage_bytes(tensor)
        if record is None or real[record.data_start : record.data_end] != data:
            return None  # not torch.save's plain form of one storage holding exactly these bytes
        return _Template(real[: record.data_start], real[record.data_end :], data)


_UNSEEN = object()
_TORCH_SAVE = torch.save
_templates = TensorBlobTemplates()


def _checksumming_stream(f: Any) -> ChecksummingStream | None:
    # DCP hands torch.save either the stream itself or its NoCloseWriter around it (.raw).
    for stream in (f, getattr(f, "raw", None)):
        if isinstance(stream, ChecksummingStream):
            return stream
    return None


def template_blob(obj: Any, stream: ChecksummingStream) -> bytes | None:
    """torch.save's bytes for ``obj`` in a file ``stream`` writes, from its key's template; None where no template
    serves it (anything but a small plain tensor, CRCs on, a key whose blobs do not fit): torch.save decides then."""
    if stream.serialization_settings is None:
        # Read once per file: reading torch's config costs about 20 us, more than the write.
        # Nothing in the writer process changes them while DCP writes a file (nor enters
        # torch.serialization.skip_data, which this does not follow).
        stream.serialization_settings = _save_settings()
    key = TensorBlobTemplates.key_of(obj, stream.serialization_settings)
    return None if key is None else _templates.blob(obj, key)


def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    """``torch.save``, with a small plain tensor written to overlapckpt's stream from its template in one write."""
    stream = _checksumming_stream(f) if not args and not kwargs else None
    blob = template_blob(obj, stream) if stream is not None else None
    if blob is not None:
        _write_all(f, blob)
        return
    _TORCH_SAVE(obj, f, *args, **kwargs)


def _write_all(f: Any, blob: bytes) -> None:
    """``blob`` into ``f``, then a flush, as torch.save ends."""
    write_fully(f, blob)
    flush = getattr(f, "flush", None)
    if callable(flush):
        flush()


def write_fully(f: Any, blob: bytes) -> None:
    """Every byte of ``blob`` into ``f`` (a raw stream may take part of a write)."""
    view = memoryview(blob)
    while view:
        written = f.write(view)
        if written is None:  # a stream that does not report takes everything or raises
            break
        view = view[written:]


class _TorchWithTemplateSave(types.ModuleType):
    """What DCP's filesystem module sees as ``torch``: torch itself, except ``save``."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.save = save

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def installed() -> bool:
    """Whether DCP's filesystem module saves through ``save`` here (``install`` ran in this process)."""
    from torch.distributed.checkpoint import filesystem

    return isinstance(getattr(filesystem, "torch", None), _TorchWithTemplateSave)


def install() -> bool:
    """Route DCP's per-item torch.save through ``save`` (idempotent); False where DCP's module does not call ``torch.save``."""
    from torch.distributed.checkpoint import filesystem

    current = getattr(filesystem, "torch", None)
    if isinstance(current, _TorchWithTemplateSave):
        return True
    if current is not torch:
        return False  # not the module layout this was written against: leave DCP as it is
    filesystem.torch = _TorchWithTemplateSave()
    return True
