"""No code from a checkpoint: crafted pickles in .metadata and in a byte item, through load and the CLI.

The attacker here can write the checkpoint's files and recompute every checksum (they
are CRCs: integrity, not authenticity). Each crafted file carries a payload that
would create a marker file; the marker must never appear, and the refusal must name
the file and the global.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zlib
from pathlib import Path

import pytest
import torch

from overlapckpt import Checkpointer, CorruptCheckpointError, load
from overlapckpt.cli import main
from overlapckpt.errors import UnsafeCheckpointError
from overlapckpt.format.checksum import hex32, updater
from overlapckpt.format.manifest import dump_manifest

from helpers import make_run, train_step

STEP = "step-000000003"


class _Payload:
    """Unpickling this runs ``touch marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _checkpoint(root: Path, **checkpointer_kwargs) -> Path:
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, root, **checkpointer_kwargs) as ckpt:
        for _ in range(3):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.request()
    return root / STEP


def _recompute_checksums(ckpt: Path, shard_blob: dict | None = None) -> None:
    """What an attacker does after editing files: fix the manifest's checksums, then its own."""
    manifest = json.loads((ckpt / "overlapckpt.json").read_text())
    sums = manifest["checksums"]
    metadata = (ckpt / ".metadata").read_bytes()
    sums["metadata"]["checksum"] = hex32(updater(sums["algorithm"])(metadata, 0))
    sums["metadata"]["nbytes"] = len(metadata)
    if shard_blob is not None:
        whole = (ckpt / shard_blob["file"]).read_bytes()
        data = whole[shard_blob["offset"] :]
        sums["files"][shard_blob["file"]]["nbytes"] = len(whole)
        sums["files"][shard_blob["file"]]["blobs"].append(
            {"checksum": hex32(updater(sums["algorithm"])(data, 0)), "key": shard_blob["key"], "length": len(data), "offset": shard_blob["offset"]}
        )
    manifest.pop("manifest_crc32", None)
    (ckpt / "overlapckpt.json").write_bytes(dump_manifest(manifest))


def _craft_metadata(ckpt: Path, marker: Path) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _recompute_checksums(ckpt)


def _craft_byte_item(ckpt: Path, marker: Path) -> None:
    """Point the optimizer's lr byte item at a torch.save of the payload, appended to the shard."""
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # our own, honest file
    key = next(k for k in metadata.storage_data if k.fqn == "optimizer.param_groups.0.lr")
    info = metadata.storage_data[key]
    shard = ckpt / str(info.relative_path)
    offset = shard.stat().st_size
    buffer = io.BytesIO()
    torch.save(_Payload(marker), buffer)
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[key] = type(info)(relative_path=info.relative_path, offset=offset, length=len(buffer.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _recompute_checksums(ckpt, {"file": str(info.relative_path), "offset": offset, "key": key.fqn})


@pytest.mark.parametrize("craft, needle", [(_craft_metadata, "posix.system"), (_craft_byte_item, "optimizer.param_groups.0.lr")], ids=["metadata", "byte-item"])
def test_a_crafted_checkpoint_runs_no_code(tmp_path, capsys, craft, needle):
    ckpt = _checkpoint(tmp_path / "root")
    marker = tmp_path / "marker"
    craft(ckpt, marker)
    assert main(["verify", str(tmp_path / "root"), "--step", "3"]) == 0  # the checksums were recomputed: integrity only
    for verify in (True, False):
        model, opt, _, _ = make_run(seed=5)
        with pytest.raises(UnsafeCheckpointError, match=needle) as info:
            load(str(tmp_path / "root"), model, opt, verify=verify)
        assert not marker.exists(), f"the payload ran (verify={verify})"
        assert "refused" in str(info.value) or "not DCP metadata" in str(info.value)
    for command in (["ls", str(tmp_path / "root")], ["inspect", str(ckpt)], ["verify", str(tmp_path / "root")]):
        main(command)
        assert not marker.exists(), f"overlapckpt {command[0]} ran the payload"
    capsys.readouterr()


def test_stock_dcp_metadata_of_every_kind_is_allowed(tmp_path):
    """The allowlist admits what DCP writes: the precondition of the refusals above."""
    from overlapckpt.format.safe_unpickle import load_metadata

    ckpt = _checkpoint(tmp_path)
    with open(ckpt / ".metadata", "rb") as f:
        metadata = load_metadata(f, str(ckpt / ".metadata"))
    assert "optimizer.param_groups.0.lr" in metadata.state_dict_metadata
    assert zlib.crc32((ckpt / ".metadata").read_bytes()) != 0


def _rewrite_manifest(ckpt: Path, edit) -> None:
    manifest = json.loads((ckpt / "overlapckpt.json").read_text())
    edit(manifest)
    manifest.pop("manifest_crc32", None)
    (ckpt / "overlapckpt.json").write_bytes(dump_manifest(manifest))  # its own checksum matches


def test_verify_refuses_manifest_paths_outside_the_checkpoint(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "root")
    outside = tmp_path / "secret"
    outside.write_bytes(b"s" * 100)
    escape = os.path.relpath(outside, ckpt)

    def point_outside(m):
        files = m["checksums"]["files"]
        files[escape] = {"nbytes": 100, "blobs": [{"key": "x", "offset": 0, "length": 100, "checksum": "00000000"}]}

    _rewrite_manifest(ckpt, point_outside)
    assert main(["verify", str(tmp_path / "root")]) == 1
    out = capsys.readouterr().out
    assert f"lists the file {escape!r}, which is not a DCP file name: refused unread" in out
    with pytest.raises(CorruptCheckpointError, match="not a DCP file name"):
        load(str(tmp_path / "root"), *make_run(seed=5)[:2], verify=True)


def test_verify_refuses_a_fifo_without_hanging(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "root")
    os.mkfifo(ckpt / "__0_1.distcp")  # opening it for reading would block forever

    def add_fifo(m):
        m["checksums"]["files"]["__0_1.distcp"] = {"nbytes": 8, "blobs": [{"key": "x", "offset": 0, "length": 8, "checksum": "00000000"}]}

    _rewrite_manifest(ckpt, add_fifo)
    assert main(["verify", str(tmp_path / "root")]) == 1
    assert "__0_1.distcp is not a regular file (a FIFO, device or directory): refused unread" in capsys.readouterr().out


@pytest.mark.parametrize(
    "edit",
    [lambda m: m.update(world_size="two"), lambda m: m["items"].update({"model.inp.weight": {"shape": 7}}), lambda m: m["checksums"]["files"]["__0_0.distcp"].update(nbytes=[1])],
    ids=["world-size", "item-shape", "file-nbytes"],
)
def test_wrong_field_types_are_a_named_corrupt_checkpoint(tmp_path, edit):
    from overlapckpt import CheckpointNotFoundError, CorruptCheckpointError

    ckpt = _checkpoint(tmp_path / "root")
    _rewrite_manifest(ckpt, edit)
    with pytest.raises(CorruptCheckpointError, match=r"has a malformed field"):
        load(str(ckpt), *make_run(seed=5)[:2], verify=True)
    # Asked for the newest, the listing skips it as damaged, with a warning that names the field.
    with pytest.warns(UserWarning, match="has a malformed field"), pytest.raises(CheckpointNotFoundError, match="damaged manifest"):
        load(str(tmp_path / "root"), *make_run(seed=5)[:2], verify=True)


KEY = "a secret of at least sixteen bytes"


def test_signed_checkpoints_load_and_forged_or_unsigned_ones_are_refused(tmp_path, capsys, monkeypatch):
    from overlapckpt.errors import SignatureError

    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path / "signed", signing_key=KEY) as ckpt:
        for _ in range(3):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.request()
    ckpt_dir = tmp_path / "signed" / STEP
    signature = json.loads((ckpt_dir / "overlapckpt.json").read_text())["signature"]
    assert signature["algorithm"] == "hmac-sha256" and len(signature["mac"]) == 64
    assert load(str(tmp_path / "signed"), *make_run(seed=5)[:2], signing_key=KEY).step == 3
    with pytest.raises(SignatureError, match="does not match"):  # another key
        load(str(tmp_path / "signed"), *make_run(seed=5)[:2], signing_key="another secret, sixteen+ bytes")
    # An unsigned checkpoint, with a key set.
    unsigned = _checkpoint(tmp_path / "unsigned")
    with pytest.raises(SignatureError, match="is not signed"):
        load(str(tmp_path / "unsigned"), *make_run(seed=5)[:2], signing_key=KEY, verify=False)
    # A forger who edits a field and recomputes every checksum, but has no key.
    _rewrite_manifest(ckpt_dir, lambda m: m.update(requested_step=1))
    for verify in (True, False):
        with pytest.raises(SignatureError, match="does not match"):
            load(str(tmp_path / "signed"), *make_run(seed=5)[:2], signing_key=KEY, verify=verify)
    # The CLI checks the signature when OVERLAPCKPT_SIGNING_KEY is set.
    monkeypatch.setenv("OVERLAPCKPT_SIGNING_KEY", KEY)
    assert main(["verify", str(tmp_path / "signed")]) == 1
    assert "signature does not match" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "unsigned")]) == 1
    assert "is not signed" in capsys.readouterr().out
    assert unsigned.exists()


def test_a_swapped_metadata_is_refused_by_the_signature(tmp_path):
    from overlapckpt.errors import SignatureError

    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, signing_key=KEY) as ckpt:
        for _ in range(3):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.request()
    ckpt_dir = tmp_path / STEP
    metadata = pickle.loads((ckpt_dir / ".metadata").read_bytes())
    metadata.planner_data = {}  # another, valid .metadata; the signed manifest is left as it was
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(SignatureError, match=r"\.metadata is not the one that was signed"):
        load(str(tmp_path), *make_run(seed=5)[:2], signing_key=KEY, verify=False)


# ---- crafted bytes import nothing and allocate nothing (issue 26, items 1-4) -----------------------

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _in_a_fresh_interpreter(code: str) -> str:
    """Run ``code`` in a new Python (nothing imported yet but what it imports): its stdout."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(TESTS_DIR), TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


_LOAD_AND_REPORT = """
import sys
from helpers import make_run
from overlapckpt import load
from overlapckpt.restore import read_checkpoint
from overlapckpt.errors import OverlapCkptError
before = {modules!r}
assert not any(m in sys.modules for m in before), [m for m in before if m in sys.modules]
try:
    {call}
    print("loaded")
except OverlapCkptError as e:
    print("refused", type(e).__name__, str(e).replace(chr(10), " "))
print("imported", sorted(m for m in before if m in sys.modules))
"""


def test_a_metadata_naming_a_lazy_torch_submodule_is_refused_before_anything_is_imported(tmp_path):
    # torch's lazy __getattr__ imported torch._inductor (217 modules) for the allowlist's getattr.
    ckpt = _checkpoint(tmp_path / "root")
    (ckpt / ".metadata").write_bytes(b"\x80\x02ctorch\n_inductor\n.")
    _recompute_checksums(ckpt)
    # read_checkpoint builds no model or optimizer (creating those imports torch's lazy modules anyway).
    out = _in_a_fresh_interpreter(_LOAD_AND_REPORT.format(modules=["torch._inductor"], call=f"read_checkpoint({str(tmp_path / 'root')!r})"))
    assert "refused UnsafeCheckpointError" in out and "torch._inductor" in out.split("imported")[0], out
    assert "imported []" in out, out
    with pytest.raises(UnsafeCheckpointError, match="names the global torch._inductor"):
        load(str(tmp_path / "root"), *make_run(seed=5)[:2])


def test_an_extra_state_dtype_that_names_a_submodule_is_a_corrupt_checkpoint_and_imports_nothing(tmp_path):
    ckpt = _checkpoint(tmp_path / "root")

    def name_onnx(node):
        if isinstance(node, dict):
            if node.get("dtype") == "uint8" and "data" in node:
                node["dtype"] = "onnx"
                return True
            return any(name_onnx(v) for v in node.values())
        return isinstance(node, list) and any(name_onnx(v) for v in node)

    _rewrite_manifest(ckpt, lambda m: name_onnx(m) or pytest.fail("no tensor in the manifest's extra state"))
    out = _in_a_fresh_interpreter(_LOAD_AND_REPORT.format(modules=["torch.onnx"], call=f"read_checkpoint({str(tmp_path / 'root')!r})"))
    assert "refused CorruptCheckpointError" in out and "names the dtype 'onnx', which is no torch dtype" in out, out
    assert "imported []" in out, out
    with pytest.raises(CorruptCheckpointError, match="names the dtype 'onnx'"):
        load(str(tmp_path / "root"), *make_run(seed=5)[:2])


def test_with_a_key_the_signature_is_checked_before_metadata_is_decoded(tmp_path):
    ckpt_dir = _checkpoint(tmp_path / "root", signing_key=KEY)
    (ckpt_dir / ".metadata").write_bytes(b"\x80\x02ctorch\n_inductor\n.")
    call = f"read_checkpoint({str(tmp_path / 'root')!r}, signing_key={KEY!r})"  # Lightning's resume path
    out = _in_a_fresh_interpreter(_LOAD_AND_REPORT.format(modules=["torch._inductor"], call=call))
    assert "refused SignatureError" in out and "imported []" in out, out
    # load() too: decoded first, the same .metadata is an UnsafeCheckpointError instead.
    from overlapckpt.errors import SignatureError

    with pytest.raises(SignatureError, match=r"\.metadata is not the one that was signed"):
        load(str(tmp_path / "root"), *make_run(seed=5)[:2], signing_key=KEY)


def test_a_pickle_with_a_huge_memo_index_is_refused_before_it_allocates(tmp_path):
    from overlapckpt.format.safe_unpickle import load_plain_data

    bomb = b"\x80\x02Nr" + struct.pack("<I", 1 << 26) + b"."  # 9 bytes; unpickled, a 512 MiB memo
    with pytest.raises(UnsafeCheckpointError, match="puts memo entry 67108864 at byte 3 after 0 entries"):
        load_plain_data(bomb, "TorchTitan's dataloader state")  # TorchTitan's data loader blob
    ckpt = _checkpoint(tmp_path / "root")
    (ckpt / ".metadata").write_bytes(bomb)
    _recompute_checksums(ckpt)
    with pytest.raises(UnsafeCheckpointError, match="puts memo entry 67108864"):
        load(str(tmp_path / "root"), *make_run(seed=5)[:2])


def test_a_pickle_that_passed_is_scanned_once_and_a_refused_one_every_time(monkeypatch):
    import pickle as std_pickle

    from overlapckpt.format import pickle_bounds

    scans: list[int] = []
    real_scan = pickle_bounds._scan

    def counting_scan(data, where):
        scans.append(len(data))
        return real_scan(data, where)

    monkeypatch.setattr(pickle_bounds, "_scan", counting_scan)
    monkeypatch.setattr(pickle_bounds, "_passed", set())
    honest = std_pickle.dumps({"a": [1, 2, 3], "b": "x" * 10}, protocol=2)
    for _ in range(3):
        pickle_bounds.check_pickle_bounds(honest, "honest")
    assert len(scans) == 1  # the same bytes: scanned once
    pickle_bounds.check_pickle_bounds(honest[:-1] + b"\x2e", "the same bytes")  # b"." is the STOP it ends with
    assert len(scans) == 1
    bomb = b"\x80\x02Nr" + struct.pack("<I", 1 << 26) + b"."
    for _ in range(2):
        with pytest.raises(UnsafeCheckpointError, match="puts memo entry 67108864"):
            pickle_bounds.check_pickle_bounds(bomb, "bomb")
    assert len(scans) == 3  # refused each time: a refusal is never remembered as a pass


def _edit_metadata(ckpt: Path, edit) -> None:
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # our own, honest file
    edit(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_blob_length_beyond_its_file_is_refused_before_any_buffer_is_allocated(tmp_path):
    ckpt = _checkpoint(tmp_path / "root")
    claimed = 1 << 30
    key_name = "model.inp.weight"

    def claim_a_gibibyte(metadata):
        key = next(k for k in metadata.storage_data if k.fqn == key_name)
        info = metadata.storage_data[key]
        metadata.storage_data[key] = type(info)(relative_path=info.relative_path, offset=info.offset, length=claimed)

    _edit_metadata(ckpt, claim_a_gibibyte)
    _recompute_checksums(ckpt)

    def claim_in_the_manifest(m):
        for f in m["checksums"]["files"].values():
            for b in f["blobs"]:
                if b["key"] == key_name:
                    b["length"] = claimed

    _rewrite_manifest(ckpt, claim_in_the_manifest)
    shard = ckpt / "__0_0.distcp"
    assert shard.stat().st_size < 1 << 20  # the precondition: the file is far smaller than the claim
    for verify in (True, False):
        with pytest.raises(CorruptCheckpointError, match=r"claims bytes \d+\.\.\d+ of __0_0\.distcp, which holds \d+ bytes") as info:
            load(str(tmp_path / "root"), *make_run(seed=5)[:2], verify=verify)
        assert "refused before reading" in str(info.value) or "damaged or crafted" in str(info.value)


def test_a_metadata_claiming_a_huge_tensor_is_refused_before_it_is_allocated(tmp_path):
    from overlapckpt.restore import read_checkpoint

    ckpt = _checkpoint(tmp_path / "root")

    def claim_a_quadrillion(metadata):
        item = metadata.state_dict_metadata["model.inp.weight"]
        item.size = torch.Size([10**15])

    _edit_metadata(ckpt, claim_a_quadrillion)
    _recompute_checksums(ckpt)
    with pytest.raises(CorruptCheckpointError, match=r"describes 'model.inp.weight' as \(1000000000000000,\) \(4000000000000000 bytes\)"):
        read_checkpoint(str(tmp_path / "root"))


def test_a_relative_path_outside_the_checkpoint_is_refused_without_verify_too(tmp_path):
    other = _checkpoint(tmp_path / "other")
    ckpt = _checkpoint(tmp_path / "root")

    def read_the_other_root(metadata):
        for key, info in list(metadata.storage_data.items()):
            escape = os.path.relpath(other / str(info.relative_path), ckpt)
            metadata.storage_data[key] = type(info)(relative_path=escape, offset=info.offset, length=info.length)

    _edit_metadata(ckpt, read_the_other_root)
    _recompute_checksums(ckpt)
    with pytest.raises(CorruptCheckpointError, match=r"which is not one of its data files"):
        load(str(tmp_path / "root"), *make_run(seed=5)[:2], verify=False)


def test_the_cli_escapes_control_characters_from_a_manifest(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "root")
    _rewrite_manifest(ckpt, lambda m: m.update(torch_version="2.13\x1b[2J\x1b]0;owned\x07"))
    root = str(tmp_path / "root")
    assert main(["inspect", root, "--step", "3"]) == 0
    assert main(["inspect", root, "--step", "3", "--json"]) == 0
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "2.13\\x1b[2J\\x1b]0;owned\\x07" in out


def test_a_signed_checkpoint_copied_under_another_name_is_refused(tmp_path, capsys, monkeypatch):
    # Signed step-3's files copied into step-000000006: they loaded as step 6, and verify passed.
    import shutil

    from overlapckpt import list_checkpoints

    shutil.copytree(_checkpoint(tmp_path, signing_key=KEY), tmp_path / "step-000000006")
    for key in (KEY, None):  # signed or not, the name must be the manifest's
        with pytest.raises(CorruptCheckpointError, match=r"is named for step 6, but its manifest holds step 3"):
            load(str(tmp_path), *make_run(seed=5)[:2], step=6, signing_key=key)
    with pytest.warns(UserWarning, match="is named for step 6"):
        assert [i.step for i in list_checkpoints(str(tmp_path))] == [3]
    monkeypatch.setenv("OVERLAPCKPT_SIGNING_KEY", KEY)
    assert main(["verify", str(tmp_path), "--step", "6"]) != 0
    printed = capsys.readouterr()
    assert "is named for step 6, but its manifest holds step 3" in printed.out + printed.err
