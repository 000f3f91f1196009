"""Lightning: OverlapCheckpoint under a stock pytorch_lightning.Trainer, against uninterrupted twins."""

from __future__ import annotations

import csv

import pytest
import torch

from overlapckpt import ConfigError, list_checkpoints
from overlapckpt.restore import optimizer_state_by_index, read_checkpoint

pl = pytest.importorskip("pytorch_lightning")
from overlapckpt.lightning import OverlapCheckpoint  # noqa: E402

from lightning_support import STEPS_PER_EPOCH, RecordStates, TinyModule, tiny_loader  # noqa: E402


def _fit(callbacks, max_epochs: int, ckpt_path=None, logger=False, model=None, root_dir=None) -> TinyModule:
    pl.seed_everything(7, verbose=False)
    model = model or TinyModule()
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        # Our callback replaces Lightning's default ModelCheckpoint; the twin runs without one.
        enable_checkpointing=any(isinstance(c, OverlapCheckpoint) for c in callbacks),
        default_root_dir=root_dir,
    )
    trainer.fit(model, tiny_loader(), ckpt_path=ckpt_path)
    return model


def _assert_equal_state(contents, expected) -> None:
    model_sd, opt_sd = expected
    assert contents.model.keys() == model_sd.keys()
    for k, v in model_sd.items():
        assert torch.equal(contents.model[k], v), k
    got = optimizer_state_by_index(contents.optimizer)
    assert got["param_groups"] == opt_sd["param_groups"]
    for i, s in opt_sd["state"].items():
        for k, v in s.items():
            assert torch.equal(got["state"][i][k], v), (i, k)


@pytest.fixture(scope="module")
def twin():
    """The uninterrupted run: 2 epochs, the state after every step and the losses."""
    rec = RecordStates()
    model = _fit([rec], max_epochs=2)
    return rec.states, torch.stack(model.losses)


@pytest.mark.parametrize("window", [1, 3])
def test_every_commit_equals_the_twin_and_figures_reach_the_logger(tmp_path, twin, window):
    states, losses = twin
    logger = pl.loggers.CSVLogger(str(tmp_path / "logs"), name="run")
    # Host slots for every request in flight: none waits or merges, whatever the commit times.
    cb = OverlapCheckpoint(tmp_path / "ckpts", every_n_train_steps=2, window=window, max_inflight=4)
    model = _fit([cb], max_epochs=2, logger=logger)
    assert torch.equal(torch.stack(model.losses), losses)  # checkpointing did not change training

    infos = list_checkpoints(str(tmp_path / "ckpts"))
    # W=3: the request after step 2 holds version 4, which also answers the request after step 4; so do 6 and 8.
    expected_versions = [2, 4, 6, 8]  # window 3 too: on the steps asked for (every=2 cuts its windows to 2 steps)
    assert [i.step for i in infos] == expected_versions, [(i.step, i.requested_step) for i in infos]
    for info in infos:
        _assert_equal_state(read_checkpoint(info.path), states[info.step])
    assert cb.ckpt is None  # closed at on_train_end

    with open(logger.experiment.metrics_file_path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("overlapckpt/step")]
    assert sorted({int(float(r["overlapckpt/step"])) for r in rows}) == expected_versions
    assert all(float(r["overlapckpt/time_to_commit_s"]) > 0 for r in rows)


def test_resume_through_fit_ckpt_path_reproduces_the_losses_and_final_state(tmp_path, twin):
    states, losses = twin
    root = tmp_path / "ckpts"
    first = _fit([OverlapCheckpoint(root, every_n_train_steps=2, max_inflight=2)], max_epochs=1)
    assert torch.equal(torch.stack(first.losses), losses[:STEPS_PER_EPOCH])
    assert [i.step for i in list_checkpoints(str(root))] == [2, 4]

    # A new process would build everything afresh: a new module, trainer and callback.
    rec = RecordStates()
    resumed = _fit([OverlapCheckpoint(root, every_n_train_steps=2, max_inflight=2), rec], max_epochs=2, ckpt_path=str(root))
    assert torch.equal(torch.stack(resumed.losses), losses[STEPS_PER_EPOCH:])
    final_model, final_opt = states[2 * STEPS_PER_EPOCH]
    assert rec.states.keys() == {5, 6, 7, 8}
    for k, v in final_model.items():
        assert torch.equal(resumed.state_dict()[k], v), k
    assert rec.states[8][1]["param_groups"] == final_opt["param_groups"]  # the scheduler's lr too
    # The resumed run continues the versions: its checkpoints are 6 and 8, of the same lineage root.
    assert [i.step for i in list_checkpoints(str(root))] == [2, 4, 6, 8]
    _assert_equal_state(read_checkpoint(str(root)), states[8])


def test_a_directory_of_one_checkpoint_resumes_too(tmp_path, twin):
    states, losses = twin
    root = tmp_path / "ckpts"
    _fit([OverlapCheckpoint(root, every_n_train_steps=2, max_inflight=2, save_on_train_end=False)], max_epochs=1)
    (step2, step4) = list_checkpoints(str(root))
    rec = RecordStates()
    _fit([OverlapCheckpoint(tmp_path / "next", every_n_train_steps=2), rec], max_epochs=2, ckpt_path=step4.path)
    assert rec.states.keys() == {5, 6, 7, 8}
    for k, v in states[8][0].items():
        assert torch.equal(rec.states[8][0][k], v), k


def test_refusals_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="sets 'every' itself"):
        OverlapCheckpoint(tmp_path, every=3)

    class TwoOptimizers(TinyModule):
        def configure_optimizers(self):
            half = len(list(self.parameters())) // 2
            params = list(self.parameters())
            return [torch.optim.SGD(params[:half], lr=0.1), torch.optim.SGD(params[half:], lr=0.1)]

        def training_step(self, batch, batch_idx):
            for opt in self.optimizers():
                opt.zero_grad()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()

    model = TwoOptimizers()
    model.automatic_optimization = False
    with pytest.raises(ConfigError, match="checkpoints one optimizer; configure_optimizers returned 2"):
        _fit([OverlapCheckpoint(tmp_path / "two")], max_epochs=1, model=model)


def test_deepspeed_is_refused_before_training(tmp_path):
    from pytorch_lightning.strategies import SingleDeviceStrategy

    class DeepSpeedStrategy(SingleDeviceStrategy):  # what DeepSpeed's strategy is called: detected by name
        pass

    trainer = pl.Trainer(
        max_epochs=1,
        strategy=DeepSpeedStrategy(device=torch.device("cpu")),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[OverlapCheckpoint(tmp_path)],
    )
    with pytest.raises(ConfigError, match="cannot hook DeepSpeedStrategy: DeepSpeed steps its own optimizer"):
        trainer.fit(TinyModule(), tiny_loader())
    assert not list(tmp_path.iterdir())


def test_ddp_two_ranks_save_and_resume(tmp_path):
    """2 gloo ranks under torchrun: a save with every_n_train_steps=1, then fit(ckpt_path=root) equal to the twin."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "workers", "lightning_ddp_script.py")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", script, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # 32 samples, 2 ranks, batches of 8: 2 steps per epoch.
    infos = list_checkpoints(str(tmp_path / "ckpts"))
    assert [i.step for i in infos] == [1, 2, 3, 4] and {i.world_size for i in infos} == {2}
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            result = json.load(f)
        assert result["world_size"] == 2
        assert result["first"] == result["twin"][:2]
        assert result["resumed"] == result["twin"][2:], rank
        states = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for k, v in states["twin"].items():
            assert torch.equal(states["resumed"][k], v), (rank, k)


def test_ckpt_path_last_starts_fresh_on_the_first_run_and_resumes_ours_on_the_next(tmp_path, twin, recwarn):
    """Lightning's own idiom, one line for every run. Before: fit(ckpt_path="last") warned "no last checkpoint" and
    silently trained from step 0 beside our checkpoints; the README's ckpt_path=<root> raised FileNotFoundError on a
    first run."""
    states, losses = twin
    root = tmp_path / "ckpts"
    first = _fit([OverlapCheckpoint(root, every_n_train_steps=2, max_inflight=2)], max_epochs=1, ckpt_path="last")
    assert torch.equal(torch.stack(first.losses), losses[:STEPS_PER_EPOCH])
    assert not [w for w in recwarn.list if "no last checkpoint" in str(w.message)]
    rec = RecordStates()
    resumed = _fit([OverlapCheckpoint(root, every_n_train_steps=2, max_inflight=2), rec], max_epochs=2, ckpt_path="last")
    assert rec.states.keys() == {5, 6, 7, 8}  # resumed at 4, not retrained from 0
    assert torch.equal(torch.stack(resumed.losses), losses[STEPS_PER_EPOCH:])
    for k, v in states[8][0].items():
        assert torch.equal(resumed.state_dict()[k], v), k


def test_ckpt_path_at_an_empty_root_names_last_as_the_fix(tmp_path):
    with pytest.raises(Exception, match=r'no checkpoint under it yet; pass ckpt_path="last"'):
        _fit([OverlapCheckpoint(tmp_path / "ckpts", every_n_train_steps=2)], max_epochs=1, ckpt_path=str(tmp_path / "ckpts"))
