"""Hugging Face Trainer: OverlapCallback on a tiny random GPT-2 (no download), against uninterrupted twins."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from overlapckpt import CheckpointStore, ConfigError, list_checkpoints
from overlapckpt.format.verify import verify_checkpoint
from overlapckpt.restore import optimizer_state_by_index, read_checkpoint

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from overlapckpt.hf import OverlapCallback  # noqa: E402

from helpers import LogLines  # noqa: E402

MAX_STEPS = 8
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(transformers.TrainerCallback):
    """The twin's model and optimizer after every step; and every log the reporting integrations would see."""

    def __init__(self) -> None:
        self.states: dict[int, tuple[dict, dict]] = {}
        self.logs: list[dict] = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        model_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt_sd = optimizer.state_dict()
        opt_sd = {
            "state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in opt_sd["state"].items()},
            "param_groups": [dict(g) for g in opt_sd["param_groups"]],
        }
        self.states[state.global_step] = (model_sd, opt_sd)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}, at_global_step=state.global_step))


def _trainer(out, callbacks, eval_dataset=None, **save_args) -> transformers.Trainer:
    transformers.set_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=4,
        max_steps=MAX_STEPS,
        learning_rate=1e-3,
        warmup_steps=2,
        logging_steps=2,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **({"save_strategy": "no"} | save_args),
    )
    return transformers.Trainer(model=model, args=args, train_dataset=TokenData(), eval_dataset=eval_dataset, callbacks=callbacks)


class StopAt(transformers.TrainerCallback):
    """Stop training at the end of step ``at``, as a preempted job stops."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_training_stop = True


class WaitForCommits(transformers.TrainerCallback):
    """At the end of step ``at``, wait until the checkpoints in flight commit, so the next log has their figures."""

    def __init__(self, overlap: OverlapCallback, at: int) -> None:
        self.overlap, self.at = overlap, at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            self.overlap.ckpt.wait(timeout_s=120)


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    rec = Record()
    _trainer(tmp_path_factory.mktemp("twin"), [rec]).train()
    return rec


def _assert_equal(model_sd: dict, opt_sd: dict, expected) -> None:
    want_model, want_opt = expected
    for k, v in want_model.items():
        if k in model_sd:
            assert torch.equal(model_sd[k], v), k
    assert opt_sd["param_groups"] == want_opt["param_groups"]
    assert opt_sd["state"].keys() == want_opt["state"].keys()
    for i, s in want_opt["state"].items():
        for k, v in s.items():
            assert torch.equal(opt_sd["state"][i][k], v), (i, k)


@pytest.mark.parametrize("window", [1, 3])
def test_every_commit_and_its_hf_files_equal_the_twin(tmp_path, twin, window):
    integration = Record()  # placed first, as the Trainer places report_to integrations
    cb = OverlapCallback(tmp_path / "ckpts", save_steps=2, window=window, max_inflight=4)
    _trainer(tmp_path, [integration, cb, WaitForCommits(cb, at=4)]).train()
    losses = [entry["loss"] for entry in integration.logs if "loss" in entry]
    assert losses == [entry["loss"] for entry in twin.logs if "loss" in entry]  # training unchanged

    infos = list_checkpoints(str(tmp_path / "ckpts"))
    assert [i.step for i in infos] == [2, 4, 6, 8]  # window 3 too: every=2 cuts its windows to 2 steps, on the steps asked for
    for info in infos:
        contents = read_checkpoint(info.path)
        _assert_equal(contents.model, optimizer_state_by_index(contents.optimizer), twin.states[info.step])
        # What Hugging Face's resume reads, written by the writer from the same snapshot.
        hf_model = safetensors_torch.load_file(f"{info.path}/model.safetensors")
        hf_opt = torch.load(f"{info.path}/optimizer.pt", weights_only=True)
        _assert_equal(hf_model, hf_opt, twin.states[info.step])
        assert hf_model.keys() == twin.states[info.step][0].keys()
        with open(f"{info.path}/trainer_state.json") as f:
            assert json.load(f)["global_step"] == info.step
        report = verify_checkpoint(CheckpointStore(str(tmp_path / "ckpts")), info.path.rsplit("/", 1)[1])
        assert report.ok and report.files >= 6, report  # the shard and the five framework files
    # The figures reached the callback that stands where the integrations do, at a log after their commit
    # (at the latest the log of step 4, right after the wait): the few a user reads, each once.
    with_figures = [e for e in integration.logs if "overlapckpt/step" in e]
    assert all(e["overlapckpt/step"] in (2.0, 4.0, 6.0, 8.0) for e in with_figures), integration.logs
    assert [e["overlapckpt/step"] for e in with_figures if e["at_global_step"] == 4] == [4.0], integration.logs
    assert all(e["overlapckpt/time_to_commit_s"] > 0 for e in with_figures)
    assert {k for e in with_figures for k in e if k.startswith("overlapckpt/")} == {
        "overlapckpt/step", "overlapckpt/hook_host_s", "overlapckpt/copy_s", "overlapckpt/time_to_commit_s", "overlapckpt/state_bytes",
    }


def test_resume_from_checkpoint_reproduces_the_losses_and_the_final_model(tmp_path, twin):
    root = tmp_path / "ckpts"
    _trainer(tmp_path, [OverlapCallback(root, save_steps=2, max_inflight=4)]).train()
    step4 = next(i for i in list_checkpoints(str(root)) if i.step == 4)

    rec = Record()
    trainer = _trainer(tmp_path / "again", [OverlapCallback(tmp_path / "next", save_steps=2, max_inflight=4), rec])
    trainer.train(resume_from_checkpoint=step4.path)
    assert sorted(rec.states) == [5, 6, 7, 8]
    final_model, _ = twin.states[MAX_STEPS]
    for k, v in final_model.items():
        assert torch.equal(trainer.model.state_dict()[k], v), k
    _assert_equal(rec.states[8][0], rec.states[8][1], twin.states[8])
    resumed_losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e and e["step"] > 4]
    twin_losses = [(s, e["loss"]) for s, e in zip(range(2, MAX_STEPS + 1, 2), [e for e in twin.logs if "loss" in e]) if s > 4]
    assert resumed_losses == twin_losses
    # The resumed run continues the step count: its checkpoints are 6 and 8.
    assert [i.step for i in list_checkpoints(str(tmp_path / "next"))] == [6, 8]


def test_local_save_steps_and_resume_from_the_newest_checkpoint_of_either_tier(tmp_path, twin):
    """save_steps=4 to the root, local_save_steps=2 to a local tier; stopped at 6 without a final save, so the local
    tier's step 6 is the newest: newest_checkpoint() names it, and the Trainer's own resume from it equals the twin."""
    root, local = tmp_path / "ckpts", tmp_path / "local"

    def callback():
        return OverlapCallback(root, save_steps=4, local_save_steps=2, local_dir=str(local), max_inflight=4, save_on_train_end=False)

    first = callback()
    _trainer(tmp_path, [first, StopAt(6)]).train()
    assert [i.step for i in list_checkpoints(str(root))] == [4]
    assert [i.step for i in list_checkpoints(str(local))] == [4, 6]
    newest = first.newest_checkpoint()
    assert newest == str(local / "checkpoint-6")
    hf_model = safetensors_torch.load_file(f"{newest}/model.safetensors")  # the Trainer's files, in the local tier too
    _assert_equal(hf_model, torch.load(f"{newest}/optimizer.pt", weights_only=True), twin.states[6])

    rec = Record()
    trainer = _trainer(tmp_path / "again", [callback(), rec])
    trainer.train(resume_from_checkpoint=newest)
    assert sorted(rec.states) == [7, 8]
    _assert_equal(rec.states[8][0], rec.states[8][1], twin.states[8])


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match="sets 'export_formats' itself"):
        OverlapCallback(tmp_path, export_formats=())
    with pytest.raises(ConfigError, match="not one"):
        from overlapckpt import Checkpointer

        model = torch.nn.Linear(2, 2)
        Checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), "s3://bucket/x", export_formats=("hf_trainer",))


def test_adding_the_callback_is_the_only_change_and_resume_from_checkpoint_true_finds_the_newest(tmp_path, twin):
    """The callback follows TrainingArguments (output_dir, save_steps, save_total_limit), names checkpoint-N, and
    takes over the Trainer's own saves. Before: resume_from_checkpoint=True found "No valid checkpoint"."""
    save_args = {"save_strategy": "steps", "save_steps": 2, "save_total_limit": 2}
    trainer_log = transformers.utils.logging.get_logger("transformers.trainer")
    lines = LogLines()
    trainer_log.addHandler(lines)
    level = trainer_log.level
    trainer_log.setLevel(logging.INFO)
    try:
        _trainer(tmp_path, [OverlapCallback(max_inflight=4), StopAt(6)], **save_args).train()
    finally:
        trainer_log.removeHandler(lines)
        trainer_log.setLevel(level)
    out = tmp_path / "hf"
    # Ours only (each committed, with .metadata), keep=save_total_limit; no Trainer checkpoint of its own.
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-4", "checkpoint-6"]
    assert all((out / name / ".metadata").exists() for name in ("checkpoint-4", "checkpoint-6"))
    assert [i.step for i in list_checkpoints(str(out))] == [4, 6]
    commits = [line for line in lines.lines if line.startswith("overlapckpt: checkpoint of step")]
    assert [line.split()[4] for line in commits] == ["2", "4", "6"], lines.lines  # one line per commit, at the Trainer's INFO

    rec = Record()
    trainer = _trainer(tmp_path, [OverlapCallback(max_inflight=4), rec], **save_args)
    trainer.train(resume_from_checkpoint=True)  # get_last_checkpoint(output_dir): checkpoint-6
    assert sorted(rec.states) == [7, 8]
    _assert_equal(rec.states[8][0], rec.states[8][1], twin.states[8])
    # save_total_limit bounds the lineage across the resume, as the stock Trainer's rotation does: the
    # checkpoint it resumed from is kept until this run commits a newer one; the older run's 4 goes.
    # Before, save_total_limit counted this run's only: 6 checkpoint-N after one kill and resume.
    assert [i.step for i in list_checkpoints(str(out))] == [6, 8]


def test_save_strategy_best_is_refused_by_name(tmp_path):
    trainer = _trainer(
        tmp_path, [OverlapCallback()], eval_dataset=TokenData(8), save_strategy="best", metric_for_best_model="loss",
        eval_strategy="steps", eval_steps=2,
    )
    with pytest.raises(ConfigError, match=r"save_strategy='best'\) is not supported by OverlapCallback"):
        trainer.train()
