"""A small tensor's blob decoded by comparing its framing with torch.save's own for the dtype and shape .metadata gives.

Each decode is compared bit for bit with what torch.load makes of the same blob; each blob
that is not exactly torch.save's (CRCs on, another dtype or shape claimed, a byte of the
framing changed, a length claimed past the limit) is left to the general way (None).
A verified load of a checkpoint of small tensors is run with the general way made to fail:
every blob is recognised, and the state equals the saved one.
"""

from __future__ import annotations

import io

import pytest
import torch

from overlapckpt import Checkpointer, load
from overlapckpt.format import blob_checks
from overlapckpt.format.known_framing import KNOWN_FRAMING_MAX_BYTES, KnownFramings
from overlapckpt.format.tensor_decode import locate

from helpers import assert_state_equal, make_run, snapshot, train_step


def _saved(tensor: torch.Tensor, crc: bool = False) -> bytearray:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        out = io.BytesIO()
        torch.save(tensor, out)
    finally:
        torch.serialization.set_crc32_options(before)
    return bytearray(out.getvalue())


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8])
@pytest.mark.parametrize("shape", [(4, 4), (3,), (), (2, 3, 5)])
def test_a_blob_in_torch_saves_framing_decodes_to_the_tensor_torch_load_makes(dtype, shape):
    torch.manual_seed(0)
    tensor = (torch.randn(shape) * 100).to(dtype)
    blob = _saved(tensor)
    decoded = KnownFramings().tensor(blob, dtype, shape)
    assert decoded is not None
    reference = torch.load(io.BytesIO(bytes(blob)), weights_only=True)
    assert decoded.dtype == reference.dtype and decoded.shape == reference.shape
    assert torch.equal(_bits(decoded), _bits(reference))  # bit for bit, NaN payloads and signed zeros included
    # A view of the bytes read, not a copy: at the data record, where the zip's directory places it.
    record = locate(memoryview(bytes(blob)))
    assert record is not None and bytes(blob[record.data_start : record.data_end]) == bytes(_bits(reference).numpy().tobytes())
    start = record.data_start
    assert decoded.untyped_storage().data_ptr() == torch.frombuffer(memoryview(blob)[start:], dtype=torch.uint8).data_ptr()


def test_anything_but_torch_saves_framing_for_the_claimed_dtype_and_shape_is_left_to_the_general_way():
    framings = KnownFramings()
    tensor = torch.arange(16, dtype=torch.float32).view(4, 4)
    blob = _saved(tensor)
    assert framings.tensor(blob, torch.float32, (4, 4)) is not None
    assert framings.tensor(_saved(tensor, crc=True), torch.float32, (4, 4)) is None  # a stock save: CRCs of its data
    assert framings.tensor(blob, torch.int32, (4, 4)) is None  # another dtype claimed, the same length
    assert framings.tensor(blob, torch.float32, (2, 8)) is None  # another shape, the same bytes
    assert framings.tensor(blob, torch.float32, (16,)) is None
    assert framings.tensor(blob + b"\0", torch.float32, (4, 4)) is None  # a byte more
    assert framings.tensor(blob[:-1], torch.float32, (4, 4)) is None
    for where in (0, 40, len(blob) - 30, len(blob) - 1):  # a framing byte changed: a header, the pickle, the directory
        changed = bytearray(blob)
        changed[where] ^= 0x01
        assert framings.tensor(changed, torch.float32, (4, 4)) is None, where
    # What .metadata claims never sizes an allocation past the limit, nor a nonsense one.
    assert framings.tensor(blob, torch.float32, (KNOWN_FRAMING_MAX_BYTES // 4 + 1,)) is None
    assert framings.tensor(blob, torch.float32, (1 << 40, 1 << 40)) is None
    assert framings.tensor(blob, torch.float32, (-1, 4)) is None
    assert framings.tensor(blob, "float32", (4, 4)) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("crc_before", [True, False])
def test_making_a_framing_puts_torchs_crc_option_back(crc_before):
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc_before)
    try:
        assert KnownFramings().tensor(_saved(torch.ones(3, 3)), torch.float32, (3, 3)) is not None
        assert torch.serialization.get_crc32_options() is crc_before
    finally:
        torch.serialization.set_crc32_options(before)


def test_a_verified_load_of_small_tensors_parses_no_blob(tmp_path, monkeypatch):
    """Before: every blob's zip directory was read and its pickle unpickled, in both of the load's passes."""
    model, opt, sched, sampler = make_run(optimizer="adamw")
    with Checkpointer(model, opt, tmp_path, stateful={"sched": sched}) as ckpt:
        for _ in range(3):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.request()
        ckpt.wait(timeout_s=120)
        saved = snapshot(model, opt)

    def parsed(*args, **kwargs):
        raise AssertionError("a blob in the writer's own framing was parsed")

    monkeypatch.setattr(blob_checks, "locate", parsed)
    monkeypatch.setattr(blob_checks, "decode_in_place", parsed)
    monkeypatch.setattr(blob_checks, "known_framings", KnownFramings())  # each framing made afresh in this load
    fresh, fresh_opt, fresh_sched, _ = make_run(seed=7, optimizer="adamw")
    load(str(tmp_path), fresh, fresh_opt, stateful={"sched": fresh_sched})
    assert_state_equal(*saved, fresh, fresh_opt)
