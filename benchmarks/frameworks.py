"""Stall per checkpoint inside a framework's own loop: OverlapCheckpoint against the framework's synchronous save.

    python benchmarks/frameworks.py [--out benchmarks/results/frameworks] [--width 1024] [--layers 6]

For Lightning, and likewise for the Hugging Face Trainer (its own ``save_steps=K``
checkpoint against ``OverlapCallback``): one ``Trainer.fit`` per method on the same model and data, alternated
twice (A B A B): no checkpoint, Lightning's ``ModelCheckpoint(every_n_train_steps=K,
save_top_k=-1)`` (``torch.save`` in the loop), and ``OverlapCheckpoint`` at window 1.
A callback times every training batch (``on_train_batch_start`` to the next one). The
stall per checkpoint is the sum, over the K steps from a checkpoint step, of (step time
minus the no-checkpoint run's median step). CPU only here; the same script runs on a GPU.
Writes ``frameworks.json`` and ``frameworks.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from measure import machine_description
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


def _lightning_rows(width: int, layers: int, steps: int, every: int) -> list[dict]:
    import pytorch_lightning as pl

    from overlapckpt.lightning import OverlapCheckpoint

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return F.mse_loss(self.net(x), x)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module):
            self.starts.append(time.perf_counter())

    def run(method: str, out_dir: str) -> list[float]:
        pl.seed_everything(0, verbose=False)
        timer = StepTimer()
        callbacks: list = [timer]
        if method == "ModelCheckpoint (torch.save)":
            callbacks.append(pl.callbacks.ModelCheckpoint(out_dir, every_n_train_steps=every, save_top_k=-1))
        elif method == "OverlapCheckpoint window=1":
            callbacks.append(OverlapCheckpoint(out_dir, every_n_train_steps=every, save_on_train_end=False, max_inflight=2))
        data = TensorDataset(torch.randn(steps * 4, width))
        trainer = pl.Trainer(
            max_steps=steps,
            accelerator="auto",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=method != "none",
            callbacks=callbacks,
        )
        trainer.fit(Module(), DataLoader(data, batch_size=4))
        return [b - a for a, b in zip(timer.starts, timer.starts[1:])]

    return _rows("lightning", run, ["none", "ModelCheckpoint (torch.save)", "OverlapCheckpoint window=1"], steps, every, width, layers)


def _hf_rows(width: int, layers: int, steps: int, every: int) -> list[dict]:
    import transformers

    from overlapckpt.hf import OverlapCallback

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def forward(self, x, labels=None):
            return {"loss": F.mse_loss(self.net(x), x)}

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return steps * 4

        def __getitem__(self, i):
            return {"x": torch.randn(width, generator=torch.Generator().manual_seed(i))}

    class StepTimer(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.starts.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            # The last step ends here, before on_train_end, where the callback waits for its commits.
            if state.global_step == state.max_steps:
                self.starts.append(time.perf_counter())

    def run(method: str, out_dir: str) -> list[float]:
        timer = StepTimer()
        callbacks: list = [timer]
        sync = method == "Trainer save_steps (synchronous)"
        if method == "OverlapCallback window=1":
            callbacks.append(OverlapCallback(os.path.join(out_dir, "overlap"), every_n_steps=every, save_on_train_end=False, max_inflight=2))
        args = transformers.TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-4,
            save_strategy="steps" if sync else "no", save_steps=every, save_only_model=False, report_to="none",
            use_cpu=not torch.cuda.is_available(), disable_tqdm=True, logging_steps=10_000, dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(model=Model(), args=args, train_dataset=Data(), callbacks=callbacks)
        trainer.train()
        return [b - a for a, b in zip(timer.starts, timer.starts[1:])]

    return _rows("hf", run, ["none", "Trainer save_steps (synchronous)", "OverlapCallback window=1"], steps, every, width, layers)


def _rows(framework: str, run, methods: list[str], steps: int, every: int, width: int, layers: int) -> list[dict]:
    times: dict[str, list[list[float]]] = {m: [] for m in methods}
    for _ in range(2):  # alternated: A B C A B C
        for m in methods:
            d = tempfile.mkdtemp(prefix="fw-bench-")
            try:
                times[m].append(run(m, d))
            finally:
                shutil.rmtree(d, ignore_errors=True)
    base = statistics.median(t for run_times in times["none"] for t in run_times[2:])
    nbytes = layers * (width * width + width) * 4 * 3
    rows = []
    for m in methods:
        stalls = []
        for run_times in times[m]:
            # Step i (1-based) ends at index i-1; a checkpoint after step s is paid in steps s+1..s+every.
            for s in range(every, steps - every + 1, every):
                stalls.append(sum(t - base for t in run_times[s : s + every]))
        rows.append(
            {
                "framework": framework,
                "method": m,
                "median_step_s": statistics.median(t for r in times[m] for t in r[2:]),
                "stall_per_checkpoint_s": statistics.median(stalls) if stalls else None,
                "stall_min_max_s": [min(stalls), max(stalls)] if stalls else None,
                "state_bytes": nbytes,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/frameworks")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = _lightning_rows(args.width, args.layers, args.steps, args.every) + _hf_rows(args.width, args.layers, args.steps, args.every)
    os.makedirs(args.out, exist_ok=True)
    machine = machine_description(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    with open(os.path.join(args.out, "frameworks.json"), "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=1)
    lines = [
        f"# Stall per checkpoint in the framework's loop ({machine['date_utc']}, {machine['cpu_count']} CPUs, torch {machine['torch']})",
        "",
        f"State: {rows[0]['state_bytes'] / 2**20:.0f} MiB (fp32 parameters and AdamW moments); training on 1 thread; "
        f"a checkpoint every {args.every} steps; stall = sum over the {args.every} steps from a checkpoint of (step − "
        "the no-checkpoint run's median step), median over checkpoints and 2 alternated runs.",
        "",
        "| framework | method | median step | stall / checkpoint (min–max) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        stall = "–" if r["stall_per_checkpoint_s"] is None else (
            f"{r['stall_per_checkpoint_s'] * 1e3:.1f} ms ({r['stall_min_max_s'][0] * 1e3:.1f} – {r['stall_min_max_s'][1] * 1e3:.1f})"
        )
        lines.append(f"| {r['framework']} | {r['method']} | {r['median_step_s'] * 1e3:.1f} ms | {stall} |")
    with open(os.path.join(args.out, "frameworks.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))  # noqa: T201 - a benchmark's report


if __name__ == "__main__":
    main()
