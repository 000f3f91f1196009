"""One cycle of a crash loop (tests/test_crash_loop.py, make soak): the same training script, run again after a SIGKILL.

Each entry point resumes with its one line, trains, and kills itself with a real SIGKILL
``--kill-after`` optimizer steps after wherever it resumed (0: it runs to ``--steps`` and
writes its final state to ``--out``). ``--twin`` trains the same run without any
checkpointing, uninterrupted: the state every crash loop must end at, bit for bit.

    plain      Checkpointer(...); ckpt.restore(missing_ok=True)          window 2, replay
    tier       the same with the node-local tier (local_every=1)         window 1
    lightning  trainer.fit(model, loader, ckpt_path="last")              OverlapCheckpoint
    hf         trainer.train(resume_from_checkpoint=cb.newest_checkpoint(output_dir))
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers

from helpers import make_run, train_step  # noqa: E402

KEEP = 2
LOCAL_KEEP = 2
EVERY = 2


def _kill_self(args: argparse.Namespace, ckpt: Any) -> None:
    """SIGKILL this process, as the OOM killer or a node's reaper would: no handler, no cleanup.

    ``--settle`` first waits for the checkpoints in flight to commit (so the loop makes
    progress however slow the machine); without it the kill lands wherever the writer is.
    """
    if args.settle and ckpt is not None:
        ckpt.wait(timeout_s=120)
    os.kill(os.getpid(), signal.SIGKILL)


def _final(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def _note_resumed(out: str, step: int) -> None:
    """Append the step this cycle resumed at (0: fresh) to ``<out>.resumed``: the loop checks it made progress."""
    with open(out + ".resumed", "a") as f:
        f.write(f"{step}\n")


def run_plain(args: argparse.Namespace, tier: bool) -> None:
    from overlapckpt import Checkpointer

    torch.set_num_threads(1)
    model, opt, sched, sampler = make_run(seed=0)
    if args.twin:
        for _ in range(args.steps):
            train_step(model, opt, sched, sampler)
        _final(model, opt, args.out)
        return
    options: dict[str, Any] = {"window": 2, "consistency": "replay"} if not tier else {
        "local_every": 1, "local_keep": LOCAL_KEEP, "local_dir": args.local_dir,
    }
    with Checkpointer(model, opt, args.root, every=EVERY, keep=KEEP, stateful={"scheduler": sched, "sampler": sampler}, **options) as ckpt:
        ckpt.restore(missing_ok=True)  # the one line: resume the newest verified checkpoint, or start fresh
        resumed_at = ckpt.step_count
        _note_resumed(args.out, resumed_at)
        while ckpt.step_count < args.steps:
            train_step(model, opt, sched, sampler)
            ckpt.step()
            if args.kill_after and ckpt.step_count == resumed_at + args.kill_after:
                _kill_self(args, ckpt)
    _final(model, opt, args.out)


def run_lightning(args: argparse.Namespace) -> None:
    import pytorch_lightning as pl

    from overlapckpt.lightning import OverlapCheckpoint

    from lightning_support import STEPS_PER_EPOCH, TinyModule, tiny_loader

    class KillAfter(pl.Callback):
        def __init__(self, overlap: Any) -> None:
            self.overlap = overlap

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.resumed_at = trainer.global_step
            _note_resumed(args.out, self.resumed_at)

        def on_train_batch_start(self, trainer: Any, *rest: Any) -> None:
            # At the next batch's start: Lightning runs Checkpoint callbacks last, so the step's end, where
            # OverlapCheckpoint marks the boundary, has fully run by now.
            if args.kill_after and trainer.global_step == self.resumed_at + args.kill_after:
                _kill_self(args, self.overlap.ckpt)

    pl.seed_everything(7, verbose=False)
    model = TinyModule()
    # Lightning restarts a plain DataLoader's epoch from its start: checkpoints at epoch ends resume exactly.
    overlap = OverlapCheckpoint(args.root, every_n_train_steps=STEPS_PER_EPOCH, keep=KEEP)
    callbacks: list[Any] = [] if args.twin else [overlap, KillAfter(overlap)]
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks, enable_checkpointing=not args.twin,
        default_root_dir=os.path.dirname(args.out),
    )
    trainer.fit(model, tiny_loader(), ckpt_path=None if args.twin else "last")  # the one line
    _final(model, trainer.optimizers[0], args.out)


def run_hf(args: argparse.Namespace) -> None:
    import transformers

    from overlapckpt.hf import OverlapCallback

    class KillAfter(transformers.TrainerCallback):
        def on_train_begin(self, a: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.resumed_at = state.global_step
            _note_resumed(args.out, self.resumed_at)

        def on_step_end(self, a: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if args.kill_after and state.global_step == self.resumed_at + args.kill_after:
                _kill_self(args, overlap.ckpt)

    class TokenData(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.ids = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    transformers.set_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    overlap = OverlapCallback()
    training = transformers.TrainingArguments(
        output_dir=args.root, per_device_train_batch_size=4, max_steps=args.steps, learning_rate=1e-3, warmup_steps=2,
        report_to="none", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, logging_strategy="no",
        save_strategy="no" if args.twin else "steps", save_steps=EVERY, save_total_limit=KEEP,
    )
    callbacks = [] if args.twin else [overlap, KillAfter()]
    trainer = transformers.Trainer(model=model, args=training, train_dataset=TokenData(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=None if args.twin else overlap.newest_checkpoint(args.root))  # the one line
    _final(trainer.model, trainer.optimizer, args.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("entry", choices=("plain", "tier", "lightning", "hf"))
    parser.add_argument("--root", required=True)
    parser.add_argument("--local-dir", default=None)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-after", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--twin", action="store_true")
    parser.add_argument("--settle", action="store_true", help="wait for the commits in flight before the kill")
    args = parser.parse_args()
    if args.entry in ("plain", "tier"):
        run_plain(args, tier=args.entry == "tier")
    elif args.entry == "lightning":
        run_lightning(args)
    else:
        run_hf(args)


if __name__ == "__main__":
    main()
