"""Window 1 end to end: the committed snapshot is the state at the requested step."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from overlapckpt import Checkpointer, ConfigError, list_checkpoints, load
from overlapckpt.format.storage import CheckpointStore
from overlapckpt.format.verify import verify_checkpoint
from overlapckpt.seams import engine_of

from helpers import assert_state_equal, make_run, snapshot, states_differ, train_step


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_snapshot_equals_state_at_request_step(tmp_path, optimizer, cpu_device):
    model, opt, sched, sampler = make_run(optimizer=optimizer)
    with Checkpointer(model, opt, tmp_path, window=1, stateful={"sched": sched, "sampler": sampler}) as ckpt:
        for _ in range(4):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.request()
        ref_model, ref_opt = snapshot(model, opt)
        # Training runs on past s before the snapshot is persisted.
        for _ in range(5):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        infos = ckpt.wait(timeout_s=120)
    assert [i.step for i in infos] == [4]
    assert states_differ(ref_model, model)  # precondition: the live state moved on

    fresh_model, fresh_opt, fresh_sched, fresh_sampler = make_run(seed=99, optimizer=optimizer)
    info = load(str(tmp_path), fresh_model, fresh_opt, stateful={"sched": fresh_sched, "sampler": fresh_sampler})
    assert info.step == 4 and info.window == 1 and info.mode == "single"
    assert_state_equal(ref_model, ref_opt, fresh_model, fresh_opt)
    assert fresh_sampler.position == 4 and fresh_sched.last_epoch == 4


def test_stock_dcp_load_reads_the_same_tensors(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path) as ckpt:
        for _ in range(3):
            train_step(model, opt, sched, sampler)
        ckpt.request()
        ref_model, ref_opt = snapshot(model, opt)
        train_step(model, opt, sched, sampler)
        (info,) = ckpt.wait(timeout_s=120)

    # The stock recipe, with no overlapckpt code.
    fresh_model, fresh_opt, _, _ = make_run(seed=7)
    msd, osd = get_state_dict(fresh_model, fresh_opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=info.path)
    set_state_dict(fresh_model, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    assert_state_equal(ref_model, ref_opt, fresh_model, fresh_opt)


def test_writer_threads_write_a_shard_file_each_and_stock_dcp_reads_them(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, writer_threads=2) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.request()
        ref_model, ref_opt = snapshot(model, opt)
        ckpt.step()
        (info,) = ckpt.wait(timeout_s=120)
    assert sorted(f for f in os.listdir(info.path) if f.endswith(".distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    manifest = json.loads((tmp_path / "step-000000001" / "overlapckpt.json").read_text())
    assert sorted(manifest["checksums"]["files"]) == ["__0_0.distcp", "__0_1.distcp"]  # both files' every byte
    assert verify_checkpoint(CheckpointStore(str(tmp_path)), "step-000000001").ok
    fresh_model, fresh_opt, _, _ = make_run(seed=7)
    load(info.path, fresh_model, fresh_opt)
    assert_state_equal(ref_model, ref_opt, fresh_model, fresh_opt)
    fresh_model, fresh_opt, _, _ = make_run(seed=7)
    msd, osd = get_state_dict(fresh_model, fresh_opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=info.path)
    set_state_dict(fresh_model, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    assert_state_equal(ref_model, ref_opt, fresh_model, fresh_opt)


def test_layout_and_manifest_on_disk(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, every=2, stateful={"sampler": sampler}) as ckpt:
        for _ in range(5):
            train_step(model, opt, sched, sampler)
            ckpt.step()
            ckpt.wait(timeout_s=120)  # commit each before the next is due, so none is deferred
        stats = ckpt.stats
    names = sorted(os.listdir(tmp_path))
    assert names == ["latest", "step-000000002", "step-000000004"]
    assert (tmp_path / "latest").read_text() == "step-000000004"
    files = sorted(os.listdir(tmp_path / "step-000000004"))
    assert ".metadata" in files and "overlapckpt.json" in files
    manifest = json.loads((tmp_path / "step-000000004" / "overlapckpt.json").read_text())
    assert manifest["step"] == 4 and manifest["window"] == 1 and manifest["torch_version"] == torch.__version__
    assert "model.inp.weight" in manifest["items"] and "optimizer.state.inp.weight.exp_avg" in manifest["items"]
    assert manifest["extra_state_index"] == ["rng", "stateful"]
    assert manifest["ledger"]["groups"][0]["version"] == 4
    assert [s["step"] for s in stats] == [2, 4]
    assert all(s["nbytes"] == manifest["nbytes"] for s in stats)
    assert [i.step for i in list_checkpoints(str(tmp_path))] == [2, 4]


def test_keep_retention_removes_oldest_after_newer_commit(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, every=1, keep=2) as ckpt:
        for _ in range(4):
            train_step(model, opt, sched, sampler)
            ckpt.wait(timeout_s=120)
    assert [i.step for i in list_checkpoints(str(tmp_path))] == [3, 4]
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step-")) == ["step-000000003", "step-000000004"]


def test_restore_continues_step_count(tmp_path):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, every=3) as ckpt:
        for _ in range(4):
            train_step(model, opt, sched, sampler)
        ckpt.wait(timeout_s=120)
    model2, opt2, sched2, sampler2 = make_run(seed=5)
    with Checkpointer(model2, opt2, tmp_path, every=3) as ckpt2:
        info = ckpt2.restore()
        assert info.step == 3 and ckpt2.step_count == 3
        for _ in range(3):
            train_step(model2, opt2, sched2, sampler2)
        (new,) = ckpt2.wait(timeout_s=120)
    assert new.step == 6
    assert [i.step for i in list_checkpoints(str(tmp_path))] == [3, 6]


def test_a_tight_loop_with_every_2_gets_every_checkpoint_it_asked_for(tmp_path):
    """The writer is ready when the constructor returns, and a scheduled checkpoint waits for a slot at its own
    step rather than merge into a later one. Before: every=2 for 2 s under load wrote only step-2 and step-40."""
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, every=2) as ckpt:
        assert engine_of(ckpt).parts.link.writer.awaiting_responses == 0  # its ReadyResponse was read in the constructor
        for _ in range(20):
            train_step(model, opt, sched, sampler)
            ckpt.step()
    assert [i.step for i in list_checkpoints(str(tmp_path))] == list(range(2, 21, 2))


def test_a_non_tensor_optimizer_state_value_is_checkpointed_with_its_step(tmp_path):
    """A per-parameter value that is no tensor (some optimizers count calls in a plain int) travels in the
    snapshot's boundary, read at the request step: changed afterwards, the checkpoint still holds the old one."""
    model, opt, sched, sampler = make_run()
    first_fqn, first = next(iter(model.named_parameters()))
    with Checkpointer(model, opt, tmp_path, window=1) as ckpt:
        for step in range(1, 4):
            train_step(model, opt, sched, sampler)
            opt.state[first]["calls"] = 10 * step
            ckpt.step()
        ckpt.request()
        train_step(model, opt, sched, sampler)
        opt.state[first]["calls"] = 40
        ckpt.step()
        (info,) = ckpt.wait(timeout_s=120)
    assert info.step == 3
    # Read with stock DCP: the value is a DCP bytes item of the optimizer's state.
    target = {"optimizer": {"state": {first_fqn: {"calls": 0}}}}
    dcp.load(target, checkpoint_id=info.path)
    assert target["optimizer"]["state"][first_fqn]["calls"] == 30


class _WithAnEmptyBuffer(torch.nn.Module):
    """BatchNorm, and an empty buffer: torch gives a zero-element tensor data_ptr() 0."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("marker", torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.inp(x))


@pytest.mark.parametrize("window", [1, 3])
def test_a_model_with_an_empty_buffer_checkpoints_and_restores_bit_exact(tmp_path, window, cpu_device):
    """Before: optimizer.step() raised `invalid storage offset` at the first checkpoint (the emulated device's view)."""
    torch.manual_seed(0)
    model = _WithAnEmptyBuffer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    with Checkpointer(model, opt, tmp_path, window=window, every=3) as ckpt:
        for step in range(1, 6):
            model(torch.randn(8, 4, generator=data)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
            if step == 3:
                expected = ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()))
        ckpt.wait(timeout_s=120)
    torch.manual_seed(7)
    fresh = _WithAnEmptyBuffer()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert load(str(tmp_path), fresh, fresh_opt, step=3).step == 3
    assert fresh.marker.shape == (0,)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in expected[0].items())
    got = fresh_opt.state_dict()["state"]
    assert all(torch.equal(v, got[i][k]) for i, s in expected[1]["state"].items() for k, v in s.items())


def test_from_settings_builds_what_the_keywords_build_and_checks_the_record_as_they_do(tmp_path):
    """Checkpointer.from_settings(model, optimizer, CheckpointerSettings(...)): the public record, built by keyword, beside
    the keyword constructor; the same checkpoints, bit for bit, and the same refusals."""
    from overlapckpt import CheckpointerSettings
    from overlapckpt.settings import CadenceSettings, OverlapSettings, StorageSettings

    states = {}
    for how in ("keywords", "settings"):
        model, opt, sched, sampler = make_run()
        root = tmp_path / how
        if how == "keywords":
            ckpt = Checkpointer(model, opt, root, window=1, every=4, keep=2, stateful={"sched": sched})
        else:
            settings = CheckpointerSettings(
                storage=StorageSettings(path=str(root)), overlap=OverlapSettings(window=1), cadence=CadenceSettings(every=4, keep=2),
            )
            ckpt = Checkpointer.from_settings(model, opt, settings, stateful={"sched": sched})
        with ckpt:
            for _ in range(12):
                train_step(model, opt, sched, sampler)
                ckpt.step()
            ckpt.wait(timeout_s=120)
        states[how] = [i.step for i in list_checkpoints(str(root))]
        fresh, fresh_opt, _, _ = make_run(seed=3)
        load(str(root), fresh, fresh_opt, stateful=None, per_rank_state="skip")
        states[how].append({k: v.clone() for k, v in fresh.state_dict().items()})
    assert states["keywords"][:-1] == states["settings"][:-1] == [8, 12]  # every=4, keep=2
    assert all(torch.equal(v, states["settings"][-1][k]) for k, v in states["keywords"][-1].items())
    model, opt, _, _ = make_run()
    with pytest.raises(ConfigError, match=r"every=0 is invalid"):
        Checkpointer.from_settings(model, opt, CheckpointerSettings(storage=StorageSettings(path=str(tmp_path / "x")), cadence=CadenceSettings(every=0)))
    with pytest.raises(ConfigError, match=r"path=123 is invalid"):
        Checkpointer.from_settings(model, opt, CheckpointerSettings(storage=StorageSettings(path=123)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"is not a CheckpointerSettings; build one from overlapckpt.settings"):
        Checkpointer.from_settings(model, opt, {"path": str(tmp_path)})  # type: ignore[arg-type]
