"""The Lightning tests' tiny module, data and state recorder (tests/test_lightning.py, tests/workers/lightning_ddp_script.py)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

STEPS_PER_EPOCH = 4


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step"}]


class RecordStates(pl.Callback):
    """The twin's state after every optimizer step, at the batch's end."""

    def __init__(self) -> None:
        self.states: dict[int, tuple[dict, dict]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        model_sd = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        opt_sd = trainer.optimizers[0].state_dict()
        opt_sd = {
            "state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in opt_sd["state"].items()},
            "param_groups": [dict(g) for g in opt_sd["param_groups"]],
        }
        self.states[trainer.global_step] = (model_sd, opt_sd)


def tiny_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8 * STEPS_PER_EPOCH, 8, generator=g), torch.randn(8 * STEPS_PER_EPOCH, 1, generator=g))
    return DataLoader(data, batch_size=8, shuffle=True)  # shuffled by the global RNG: resume must restore it
