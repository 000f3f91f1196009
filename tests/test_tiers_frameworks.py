"""The node-local tier through each framework's own option names, with the real packages.

Lightning: ``local_every_n_train_steps``, and ``fit(ckpt_path=dirpath)`` resumes from the
newer local tier (the root's shards corrupted: a read of them would fail). Hugging Face:
``local_save_steps`` and ``newest_checkpoint()``. TorchTitan: ``local_interval``,
``local_keep_latest_k`` and ``local_folder`` in its checkpoint config.
"""

from __future__ import annotations

import os

import pytest
import torch

from overlapckpt import list_checkpoints
from overlapckpt.restore import read_checkpoint


def _flip_root_shards(root: str) -> None:
    """Flip a byte in the middle of every shard of every checkpoint under ``root``: a read of them fails verification."""
    for info in list_checkpoints(root):
        for name in os.listdir(info.path):
            if name.endswith(".distcp"):
                path = os.path.join(info.path, name)
                with open(path, "r+b") as f:
                    f.seek(os.path.getsize(path) // 2)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0xFF]))


def test_lightning_local_every_n_train_steps_and_resume_from_the_newer_local_tier(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from overlapckpt.lightning import OverlapCheckpoint

    from lightning_support import STEPS_PER_EPOCH, RecordStates, TinyModule, tiny_loader

    def fit(callbacks, max_epochs, ckpt_path=None):
        pl.seed_everything(7, verbose=False)
        model = TinyModule()
        trainer = pl.Trainer(
            max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
            enable_checkpointing=any(isinstance(c, OverlapCheckpoint) for c in callbacks),
        )
        trainer.fit(model, tiny_loader(), ckpt_path=ckpt_path)
        return model

    twin = RecordStates()
    twin_model = fit([twin], max_epochs=2)
    losses = torch.stack(twin_model.losses)
    root, local = str(tmp_path / "ckpts"), str(tmp_path / "local")

    def callback():
        return OverlapCheckpoint(
            root, every_n_train_steps=3, local_every_n_train_steps=1, local_keep=2, local_dir=local, max_inflight=2, save_on_train_end=False
        )

    first = fit([callback()], max_epochs=1)
    assert torch.equal(torch.stack(first.losses), losses[:STEPS_PER_EPOCH])
    assert [i.step for i in list_checkpoints(root)] == [3]
    assert [i.step for i in list_checkpoints(local)] == [3, 4]
    for info in list_checkpoints(local):
        contents = read_checkpoint(info.path)
        for k, v in twin.states[info.step][0].items():
            assert torch.equal(contents.model[k], v), (info.step, k)
    _flip_root_shards(root)

    rec = RecordStates()
    resuming = callback()
    resumed = fit([resuming, rec], max_epochs=2, ckpt_path=root)
    assert resuming.restore_figures is not None
    assert (resuming.restore_figures["restore_source"], resuming.restore_figures["restore_step"]) == ("local tier", 4)
    # Resumed from the local tier's step 4 (the root's 3 is older, and corrupt): the second epoch as the twin's.
    assert torch.equal(torch.stack(resumed.losses), losses[STEPS_PER_EPOCH:])
    assert rec.states.keys() == {5, 6, 7, 8}
    for k, v in twin.states[8][0].items():
        assert torch.equal(rec.states[8][0][k], v), k


def test_hf_local_save_steps_and_newest_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    from overlapckpt.hf import OverlapCallback

    callback = OverlapCallback(str(tmp_path / "out"), save_steps=4, local_save_steps=2, local_dir=str(tmp_path / "local"))
    assert callback.settings.checkpointer_kwargs()["local_every"] == 2
    assert callback.newest_checkpoint() is None  # neither tier holds one yet
    with pytest.raises(Exception, match="OverlapCallback sets 'local_every' itself"):
        OverlapCallback(str(tmp_path / "out"), local_every=2)


def test_titan_local_interval_and_resume_from_the_local_tier(tmp_path, monkeypatch):
    """TorchTitan's components for 12 steps: the folder every 4 steps, the local tier every 2 (2 kept). A new job's
    load() resumes from the local tier's step-12 with the folder's shards corrupted, equal to the first job's state."""
    pytest.importorskip("torchtitan")
    from workers.titan_worker import Run, ours

    monkeypatch.setenv("TITAN_BASE", str(tmp_path))
    local = str(tmp_path / "local")
    config = ours("ckpts", local_interval=2, local_keep_latest_k=2, local_folder=local)
    first = Run(0, 1, fsdp=False)
    first.train(first.manager(config))
    final = first.local_state()
    root = str(tmp_path / "ckpts")
    assert [i.step for i in list_checkpoints(root)] == [4, 8, 12]
    assert [i.step for i in list_checkpoints(local)] == [10, 12]
    _flip_root_shards(root)
    resumed = Run(0, 1, fsdp=False)
    manager = resumed.manager(config)
    try:
        assert manager.load() is True
        assert manager.ckpt.local_dir == local and manager.ckpt.step_count == 12
        assert manager.ckpt.restore_figures["restore_source"] == "local tier"
        assert manager.ckpt.restore_figures["restore_step"] == 12
        after = resumed.local_state()
    finally:
        manager.close()
    assert after.keys() == final.keys()
    for k, v in final.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(after[k], v), k
