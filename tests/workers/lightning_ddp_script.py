"""Lightning DDP on 2 gloo ranks under torchrun: an uninterrupted twin, a run that checkpoints, a resume.

Writes, per rank, the losses of each fit and the final parameters (torch.save, read by
the test with weights_only); tests/test_lightning.py judges them.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, fakes

import pytorch_lightning as pl  # noqa: E402

from overlapckpt.lightning import OverlapCheckpoint  # noqa: E402

from lightning_support import TinyModule, tiny_loader  # noqa: E402


def fit(out: str, max_epochs: int, callbacks: list, ckpt_path: str | None = None) -> TinyModule:
    pl.seed_everything(7, verbose=False)
    model = TinyModule()
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        enable_checkpointing=bool(callbacks),
        default_root_dir=out,
        callbacks=callbacks,
    )
    trainer.fit(model, tiny_loader(), ckpt_path=ckpt_path)
    return model


def main() -> None:
    out = sys.argv[1]
    root = os.path.join(out, "ckpts")
    twin = fit(out, 2, [])
    first = fit(out, 1, [OverlapCheckpoint(root, every_n_train_steps=1, max_inflight=2)])
    resumed = fit(out, 2, [OverlapCheckpoint(root, every_n_train_steps=1, max_inflight=2)], ckpt_path=root)
    rank = dist.get_rank()
    torch.save({"twin": twin.state_dict(), "resumed": resumed.state_dict()}, os.path.join(out, f"rank{rank}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "twin": [float(x) for x in twin.losses],
                "first": [float(x) for x in first.losses],
                "resumed": [float(x) for x in resumed.losses],
                "world_size": dist.get_world_size(),
            },
            f,
        )
    dist.barrier()
    os._exit(0)  # gloo's teardown can abort at exit


if __name__ == "__main__":
    main()
