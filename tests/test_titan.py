"""TorchTitan: overlapckpt's checkpoint manager with TorchTitan's real components, driven as its trainer drives a manager.

Two launches (tests/workers/titan_worker.py) serve the checks: 2 gloo ranks with FSDP2, and one
process with two pipeline stages and two optimizer types. The rest runs here: the
config's refusals, the data loader's state read without running code, the merge of
model parts.
"""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from torch import nn

from overlapckpt import Checkpointer, ConfigError
from overlapckpt.errors import UnsafeCheckpointError
from overlapckpt.titan import DataloaderState, OverlapCheckpointManager, merged_model_parts

from helpers import launch_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "titan_worker.py")
LAUNCH_TIMEOUT_S = 300


def _steps(names: list[str]) -> list[str]:
    return sorted((n for n in names if n.startswith("step-")), key=lambda n: int(n.split("-")[1]))


def test_fsdp_two_ranks_save_resume_and_the_stock_manager(tmp_path):
    results = launch_ranks(WORKER, "fsdp", 2, str(tmp_path), LAUNCH_TIMEOUT_S)
    for rank, r in enumerate(results):
        full = {int(k): v for k, v in r["losses"].items()}
        # TorchTitan's directory names, one per due step (interval 4; the last step), in TorchTitan's layout.
        assert _steps(r["exact_dirs"]) == ["step-4", "step-8", "step-12"], (rank, r["exact_dirs"])
        assert r["layout_differs"] == [], (rank, r["layout_differs"])  # the same items as the stock manager's, same shapes
        # Resumed by overlapckpt's manager at step 8: this rank's shards, the schedule and the RNG bit-exact, the same losses.
        assert r["ours_state_differs"] == [], (rank, r["ours_state_differs"])
        assert r["ours_train_state"] == {"step": 8, "ntokens_seen": 8 * 4 * 16}, r["ours_train_state"]
        assert {int(k): v for k, v in r["ours_losses"].items()} == {s: full[s] for s in range(9, 13)}, rank
        # TorchTitan's own manager resumes from overlapckpt's step-8: the same losses, the same state at 12.
        assert {int(k): v for k, v in r["stock_losses"].items()} == {s: full[s] for s in range(9, 13)}, rank
        assert r["stock_state_differs"] == [], (rank, r["stock_state_differs"])
        assert r["stock_dirs"] == ["step-12"], r["stock_dirs"]
        # ... and overlapckpt's manager resumes from TorchTitan's own checkpoint.
        assert r["from_stock_differs"] == [], (rank, r["from_stock_differs"])
        assert r["from_stock_train_state"] == {"step": 12, "ntokens_seen": 12 * 4 * 16}


def test_pipeline_stages_on_one_rank_and_two_optimizer_types(tmp_path):
    (r,) = launch_ranks(WORKER, "parts", 1, str(tmp_path), LAUNCH_TIMEOUT_S)
    full = {int(k): v for k, v in r["losses"].items()}
    assert _steps(r["dirs"]) == ["step-4", "step-8", "step-12"], r["dirs"]  # window 3 replay: on the interval's steps
    assert r["ours_state_differs"] == [], r["ours_state_differs"]  # both stages, both optimizers, the pre-hook's buffer
    assert {int(k): v for k, v in r["ours_losses"].items()} == {s: full[s] for s in range(9, 13)}
    assert r["stock_state_differs"] == [], r["stock_state_differs"]
    assert {int(k): v for k, v in r["stock_losses"].items()} == {s: full[s] for s in range(9, 13)}
    # Adam and AdamW in one container: replay is refused by name; window 1 is exact.
    assert r["mixed_replay_error"] is not None and "Adam, torch.optim.adamw.AdamW] cannot be replayed" in r["mixed_replay_error"]
    assert r["mixed_state_differs"] == [], r["mixed_state_differs"]
    assert r["mixed_losses_equal"] == [True] * 4


def test_pipeline_stages_across_two_ranks(tmp_path):
    from torchtitan.components.optimizer.optimizer import default_adamw
    from workers.titan_worker import TitanLike, split_into_stages, tensors_of

    from overlapckpt import load

    results = launch_ranks(WORKER, "pipeline", 2, str(tmp_path), LAUNCH_TIMEOUT_S)
    full = {int(k): v for k, v in results[1]["losses"].items()}  # the last stage computes the loss
    for rank, r in enumerate(results):
        # Each rank holds tensors no other rank holds: each writes its own, and every one is in the checkpoint.
        assert _steps(r["exact_dirs"]) == ["step-4", "step-8", "step-12"], (rank, r["exact_dirs"])
        assert r["ours_state_differs"] == [], (rank, r["ours_state_differs"])
        # Replay at window 3: the windows open two steps early, so the versions are the interval's, 4 and 8, then the last step.
        assert _steps(r["replay_dirs"]) == ["step-4", "step-8", "step-12"], (rank, r["replay_dirs"])
        assert r["replay_state_differs"] == [], (rank, r["replay_state_differs"])
    assert {int(k): v for k, v in results[1]["ours_losses"].items()} == {s: full[s] for s in range(9, 13)}
    assert {int(k): v for k, v in results[1]["replay_losses"].items()} == {s: full[s] for s in range(9, 13)}
    # Both stages' checkpoint into one process holding both: resharded from 2 pipeline ranks, bit-exact.
    torch.manual_seed(0)
    parts = split_into_stages(TitanLike())
    config = default_adamw(lr=1e-2)
    config.implementation = "foreach"
    container = config.build(model_parts=parts)
    load(results[0]["step12_dir"], merged_model_parts(parts), container, per_rank_state="skip")
    expected = {**torch.load(results[0]["state12_file"], weights_only=True), **torch.load(results[1]["state12_file"], weights_only=True)}
    actual = tensors_of(parts, container)
    assert sorted(actual) == sorted(expected)
    assert [k for k in expected if not torch.equal(expected[k], actual[k])] == []


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("last_save_in_hf", True, "checkpoint.last_save_in_hf=True is not implemented by OverlapCheckpointManager"),
        ("create_seed_checkpoint", True, "create the seed checkpoint with TorchTitan's own CheckpointManager"),
        ("save_on_signal", ["SIGNOPE"], "checkpoint.save_on_signal names 'SIGNOPE', which is no signal"),
    ],
)
def test_config_refusals_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OverlapCheckpointManager.Config(enable=True, **{field: value})


def test_a_disabled_manager_does_nothing(tmp_path):
    manager = OverlapCheckpointManager.Config(enable=False).build(
        dataloader=None, model_parts=[nn.Linear(2, 2)], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None,
        base_folder=str(tmp_path),
    )
    assert manager.load() is False and manager.save(1) is False
    manager.maybe_wait_for_staging()
    manager.close()
    assert os.listdir(tmp_path) == []


def _dataloader():
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader

    class Numbers(IterableDataset):
        def __iter__(self):
            yield from range(100)

    return ParallelAwareDataloader(Numbers(), dp_rank=0, dp_world_size=1, batch_size=2)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo overlapckpt-was-here",))


def test_dataloader_state_restores_without_running_code():
    loader = _dataloader()
    it = iter(loader)
    next(it), next(it)
    saved = DataloaderState(loader).state_dict()
    fresh = _dataloader()
    DataloaderState(fresh).load_state_dict(saved)  # plain data: restored
    assert torch.equal(next(iter(fresh)), next(it))
    crafted = {"dp_rank_0": pickle.dumps({"state": _Boom()}), "world_size": 1}
    with pytest.raises(UnsafeCheckpointError, match=r"names the global posix\.system: refused"):
        DataloaderState(_dataloader()).load_state_dict(crafted)
    with pytest.raises(ConfigError, match="is for 2 data-parallel ranks, and this run has 1"):
        DataloaderState(_dataloader()).load_state_dict({**saved, "world_size": 2})


def test_merged_model_parts_share_the_modules_and_refuse_overlaps():
    first, second = nn.Module(), nn.Module()
    first.layers = nn.ModuleDict({"0": nn.Linear(2, 2)})
    first.embed = nn.Linear(2, 2)
    second.layers = nn.ModuleDict({"1": nn.Linear(2, 2)})
    second.out = nn.Linear(2, 2)
    merged = merged_model_parts([first, second])
    assert sorted(merged.state_dict()) == sorted(
        ["embed.weight", "embed.bias", "layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias", "out.weight", "out.bias"]
    )
    assert merged.layers["1"] is second.layers["1"] and merged.embed is first.embed
    assert list(first.layers) == ["0"]  # the parts themselves are left as they were
    clash = nn.Module()
    clash.layers = nn.ModuleDict({"0": nn.Linear(2, 2)})
    with pytest.raises(ConfigError, match=r"model_parts\[1\] and an earlier part both hold layers\.0"):
        merged_model_parts([first, clash])


def test_key_layout_is_checked(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"key_layout='titan' is invalid; use 'get_state_dict' .* or 'torchtitan'"):
        Checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), str(tmp_path), key_layout="titan")


def _trained_folder(tmp_path, monkeypatch, signed: bool) -> str:
    """One process trains TorchTitan's components for 12 steps under overlapckpt's manager (step-4, -8, -12)."""
    from workers.titan_worker import Run, ours

    monkeypatch.setenv("TITAN_BASE", str(tmp_path))
    if signed:
        monkeypatch.setenv("OVERLAPCKPT_SIGNING_KEY", "k" * 32)
    run = Run(0, 1, fsdp=False)
    run.train(run.manager(ours("ckpts")))
    return str(tmp_path / "ckpts")


def _tamper(directory: str) -> None:
    """Delete the manifest and change a shard's bytes (a weight's last byte)."""
    os.remove(os.path.join(directory, "overlapckpt.json"))
    (shard,) = [f for f in os.listdir(directory) if f.endswith(".distcp")]
    with open(os.path.join(directory, shard), "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(data)


def _resume(config_kwargs: dict, **load_kwargs):
    from workers.titan_worker import Run, ours

    run = Run(0, 1, fsdp=False)
    before = {k: v.clone() for k, v in run.model_parts[0].state_dict().items()}
    manager = run.manager(ours("ckpts", **config_kwargs))
    try:
        manager.load(**load_kwargs)
    finally:
        unchanged = all(torch.equal(v, run.model_parts[0].state_dict()[k]) for k, v in before.items())
        manager.close()
    return unchanged


def test_a_checkpoint_without_its_manifest_is_refused_in_a_signed_folder_or_one_of_ours(tmp_path, monkeypatch):
    """Deleting a signed checkpoint's manifest and tampering a shard made the manager read it as TorchTitan's stock
    layout, unchecked, and load the tampered weights."""
    from overlapckpt import CorruptCheckpointError
    from overlapckpt.errors import SignatureError

    folder = _trained_folder(tmp_path, monkeypatch, signed=True)
    _tamper(os.path.join(folder, "step-12"))
    with pytest.raises(SignatureError, match=r"step-12 has no overlapckpt.json, and a signing key is set: an unsigned checkpoint is refused"):
        _resume({"read_stock_checkpoints": True})  # even when reading stock checkpoints is chosen
    assert _resume({}, step=8) is False  # a signed checkpoint of the folder still resumes (and changes the weights)
    os.rename(folder, folder + "-old")  # a fresh folder: the initial checkpoint is what loads
    with pytest.raises(SignatureError, match=r"initial_load_path=.*step-12' has no overlapckpt.json, and a signing key is set"):
        _resume({"initial_load_path": os.path.join(folder + "-old", "step-12")})
    step_4 = os.path.join(folder + "-old", "step-4")
    shutil.copy(os.path.join(step_4, "overlapckpt.json"), tmp_path / "manifest-4")
    _tamper(step_4)
    shutil.copy(tmp_path / "manifest-4", os.path.join(step_4, "overlapckpt.json"))  # signed manifest kept, shard changed
    with pytest.raises(CorruptCheckpointError, match=r"checksum"):  # an initial checkpoint of ours is verified too
        _resume({"initial_load_path": step_4, "initial_load_model_only": False})
    os.rename(folder + "-old", folder)

    monkeypatch.delenv("OVERLAPCKPT_SIGNING_KEY")
    with pytest.raises(CorruptCheckpointError, match=r"step-12 has no overlapckpt.json, while this folder holds overlapckpt checkpoints \(step-4, step-8\)"):
        _resume({"read_stock_checkpoints": True})


def test_reading_a_stock_checkpoint_is_an_explicit_choice(tmp_path, monkeypatch):
    folder = _trained_folder(tmp_path, monkeypatch, signed=False)
    for name in ("step-4", "step-8"):
        shutil.rmtree(os.path.join(folder, name))
    os.remove(os.path.join(folder, "step-12", "overlapckpt.json"))  # what TorchTitan's own manager writes: no manifest
    with pytest.raises(ConfigError, match=r"step-12 has no overlapckpt.json: TorchTitan's own CheckpointManager wrote it.*checkpoint.read_stock_checkpoints=True"):
        _resume({})
    assert _resume({"read_stock_checkpoints": True}) is False  # chosen: it loads
