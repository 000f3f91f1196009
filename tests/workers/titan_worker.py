"""One rank of a gloo run of TorchTitan's real components under overlapckpt's manager, for tests/test_titan.py.

    python tests/workers/titan_worker.py SCENARIO OUT_DIR   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

The loop is ``Trainer.train``'s (torchtitan 0.3): ``load(step)`` first, then per step
the batch, forward and backward, clipping, ``maybe_wait_for_staging()``,
``optimizers.step()``, ``lr_schedulers.step()``, ``save(step, last_step)``; the
components are TorchTitan's own (``OptimizersContainer``, ``LRSchedulersContainer``,
``ParallelAwareDataloader``, its ``CheckpointManager`` where the stock one is meant).
The model is a small stand-in with TorchTitan's structure (``layers`` as a ModuleDict,
a buffer written by an optimizer pre-hook as MoE load balancing writes ``expert_bias``):
TorchTitan's own models import triton, which has no CPU build here.

Each scenario writes what it observed to OUT_DIR/rank<R>.json, passes a barrier and
leaves with os._exit(0) (gloo's teardown can abort).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig, default_adamw  # noqa: E402

from overlapckpt.titan import OverlapCheckpointManager  # noqa: E402

from helpers import write_rank_result_and_leave  # noqa: E402

STEPS = 12
INTERVAL = 4
FEATURES = 16


class Tokens(IterableDataset, Stateful):
    """Per-rank batches from a counter: the loader's position is state a resume must restore."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.index = 0

    def __iter__(self) -> Any:
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.index)
            self.index += 1
            yield torch.randn(FEATURES, generator=g), torch.randn(FEATURES, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = state["index"]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.register_buffer("expert_bias", torch.zeros(width))  # written by an optimizer pre-hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x) + self.expert_bias)


class TitanLike(nn.Module):
    """TorchTitan's structure: ``tok_embeddings``, ``layers`` (a ModuleDict keyed "0", "1", ...), ``norm``, ``output``."""

    def __init__(self, n_layers: int = 3, width: int = 32) -> None:
        super().__init__()
        self.tok_embeddings = nn.Linear(FEATURES, width)
        self.layers = nn.ModuleDict({str(i): Block(width) for i in range(n_layers)})
        self.norm = nn.LayerNorm(width)
        self.output = nn.Linear(width, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


class TrainState:
    """What TorchTitan's ``Trainer`` saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.ntokens_seen = state["ntokens_seen"]


class Run:
    """One job's components, built the way TorchTitan's trainer builds them, from the same seed every time."""

    def __init__(
        self, rank: int, world: int, *, fsdp: bool, parts: int = 1, mixed: bool = False, impl: str = "foreach", pipeline: bool = False
    ) -> None:
        torch.manual_seed(0)
        self.rank = rank
        self.pipeline = pipeline  # rank r holds stage r of two; both read the same batches
        model = TitanLike()
        if fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        if pipeline:
            self.model_parts = [split_into_stages(model)[rank]]
        else:
            self.model_parts = [model] if parts == 1 else split_into_stages(model)
        if mixed:  # two optimizer types in one container: biases with Adam, the rest with AdamW
            config = OptimizersContainer.Config(
                param_groups=[
                    ParamGroupConfig(pattern=r"bias$", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-2}),
                    ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1}),
                ],
                implementation=impl,
            )
        else:
            config = default_adamw(lr=1e-2)
            config.implementation = impl
        self.optimizers = config.build(model_parts=self.model_parts)
        # MoE load balancing's shape: a pre-hook on the container that writes a buffer in place.
        self.optimizers.register_step_pre_hook(lambda *args, **kwargs: self._balance())
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers, training_steps=STEPS)
        dp_rank, dp_world = (0, 1) if pipeline else (rank, world)
        self.dataloader = ParallelAwareDataloader(Tokens(dp_rank), dp_rank=dp_rank, dp_world_size=dp_world, batch_size=4)
        self.train_state = TrainState()
        self.losses: dict[int, float] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def _balance(self) -> None:
        with torch.no_grad():
            for part in self.model_parts:
                for layer in part.layers.values():
                    bias = layer.expert_bias
                    local = bias.to_local() if hasattr(bias, "to_local") else bias
                    local.add_(0.01 * torch.sign(torch.sin(local.sum() + self.train_state.step + torch.arange(local.numel()))))

    def manager(self, config: Any) -> Any:
        return config.build(
            dataloader=self.dataloader, model_parts=self.model_parts, optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, states={"train_state": self.train_state}, sd_adapter=None,
            base_folder=os.environ["TITAN_BASE"],
        )

    def train(self, checkpointer: Any, load_step: int = -1, record_at: tuple[int, ...] = ()) -> None:
        """``Trainer.train``: load, then the steps, saving after each (the state right after the load is states[-1])."""
        checkpointer.load(step=load_step)
        self.states[-1] = self.local_state()
        self.loaded_train_state = self.train_state.state_dict()
        iterator = iter(self.dataloader)
        while self.train_state.step < STEPS:
            self.train_state.step += 1
            step = self.train_state.step
            inputs, labels = next(iterator)
            if self.pipeline:
                self.losses[step] = self.pipeline_forward_backward(inputs, labels)
            else:
                loss = nn.functional.mse_loss(self.forward(inputs), labels)
                loss.backward()
                self.losses[step] = float(loss.detach().item())
                torch.nn.utils.clip_grad_norm_([p for m in self.model_parts for p in m.parameters()], 1.0, foreach=True)
            checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()
            self.train_state.ntokens_seen += inputs.numel()
            checkpointer.save(step, last_step=step == STEPS)
            if step in record_at:
                self.states[step] = self.local_state()
        checkpointer.close()

    def pipeline_forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """One micro-batch through two stages on two ranks: activations forward, their gradient back (gloo send/recv)."""
        (stage,) = self.model_parts
        if self.rank == 0:
            hidden = stage(inputs)
            dist.send(hidden.detach().contiguous(), dst=1)
            grad = torch.empty_like(hidden)
            dist.recv(grad, src=1)
            hidden.backward(grad)
            return 0.0
        hidden = torch.empty(inputs.shape[0], 32)
        dist.recv(hidden, src=0)
        hidden.requires_grad_(True)
        loss = nn.functional.mse_loss(stage(hidden), labels)
        loss.backward()
        dist.send(hidden.grad.contiguous(), dst=0)
        return float(loss.detach().item())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.model_parts:
            x = part(x)
        return x

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's model and optimizer tensors (local shards), the LR schedule's position, the CPU RNG."""
        out = tensors_of(self.model_parts, self.optimizers)
        out["lr_scheduler.last_epoch"] = torch.tensor(self.lr_schedulers.schedulers[0].last_epoch)
        out["rng"] = torch.get_rng_state()
        return out


def tensors_of(model_parts: list[nn.Module], optimizers: Any) -> dict[str, torch.Tensor]:
    """The model parts' tensors and their optimizer state, as this rank holds them (local shards), cloned."""
    out: dict[str, torch.Tensor] = {}
    for part in model_parts:
        for k, v in part.state_dict().items():
            out[f"model.{k}"] = _local(v).clone()
    for optimizer in optimizers.optimizers:
        for group in optimizer.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                for k, v in optimizer.state.get(p, {}).items():
                    out[f"optimizer.{name}.{k}"] = _local(v).clone()
    return out


def split_into_stages(model: TitanLike) -> list[nn.Module]:
    """Two pipeline stages as TorchTitan splits them: copies of the model with the other stage's modules deleted."""
    first, second = TitanLike(), TitanLike()
    first.load_state_dict(model.state_dict())
    second.load_state_dict(model.state_dict())
    del first.layers["2"]
    first.norm = first.output = None  # type: ignore[assignment]
    for key in ("0", "1"):
        del second.layers[key]
    second.tok_embeddings = None  # type: ignore[assignment]
    return [first, second]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t.detach()


def differing(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors are not bit-identical (torch.equal), or that only one side has."""
    if expected.keys() != actual.keys():
        return sorted(expected.keys() ^ actual.keys())
    return [k for k in expected if not torch.equal(expected[k], actual[k])]


def layout_differences(ours_dir: str, stock_dir: str) -> list[str]:
    """What differs between the DCP items of two checkpoints of the same state: keys, kinds, shapes, dtypes."""
    from torch.distributed.checkpoint import FileSystemReader

    a = FileSystemReader(ours_dir).read_metadata().state_dict_metadata
    b = FileSystemReader(stock_dir).read_metadata().state_dict_metadata
    out = [f"only ours: {k}" for k in sorted(a.keys() - b.keys())] + [f"only stock: {k}" for k in sorted(b.keys() - a.keys())]
    for k in sorted(a.keys() & b.keys()):
        x, y = a[k], b[k]
        if type(x) is not type(y) or getattr(x, "size", None) != getattr(y, "size", None):
            out.append(f"kind or shape: {k}")
        elif hasattr(x, "properties") and x.properties.dtype != y.properties.dtype:
            out.append(f"dtype: {k}")
    return out


def ours(folder: str, **kwargs: Any) -> Any:
    return OverlapCheckpointManager.Config(enable=True, folder=folder, interval=INTERVAL, keep_latest_k=0, **kwargs)


def stock(folder: str, **kwargs: Any) -> Any:
    return CheckpointManager.Config(enable=True, folder=folder, interval=INTERVAL, keep_latest_k=0, last_save_model_only=False, **kwargs)


def resumed(rank: int, world: int, run_kwargs: dict[str, Any], config: Any, step: int) -> Run:
    """A new job from the same seed, resumed at ``step`` by ``config``'s manager; its state is recorded right after the load."""
    run = Run(rank, world, **run_kwargs)
    run.train(run.manager(config), load_step=step)
    return run


def replay_checks(rank: int, world: int, kw: dict[str, Any], full: Run, base: str) -> dict[str, Any]:
    """A run at window 3 (replay): its directories, and a resume from step-8 against the exact run's state there."""
    replayed = Run(rank, world, **kw)
    replayed.train(replayed.manager(ours("replay", window=3)))
    dirs = sorted(os.listdir(os.path.join(base, "replay")))  # before the resume adds its own
    again = resumed(rank, world, kw, ours("replay", window=3), 8)
    return {
        "replay_dirs": dirs,
        "replay_state_differs": differing(full.states[8], again.states[-1]),
        "replay_losses": again.losses,
    }


def scenario_fsdp(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 over the ranks, TorchTitan's components: ours saves; ours, the stock manager and ours again resume."""
    kw = {"fsdp": True, "impl": "foreach"}
    full = Run(rank, world, **kw)
    full.train(full.manager(ours("exact")), record_at=(8, 10, 12))
    out: dict[str, Any] = {"losses": full.losses}
    base = os.environ["TITAN_BASE"]
    out["exact_dirs"] = sorted(os.listdir(os.path.join(base, "exact")))

    again = resumed(rank, world, kw, ours("exact"), 8)
    out["ours_state_differs"] = differing(full.states[8], again.states[-1])
    out["ours_losses"] = again.losses
    out["ours_train_state"] = again.loaded_train_state

    # TorchTitan's own manager reads the checkpoint overlapckpt wrote, and writes its own from there.
    theirs = Run(rank, world, **kw)
    manager = theirs.manager(stock("stock", initial_load_path=os.path.join(base, "exact", "step-8"), initial_load_model_only=False))
    theirs.train(manager, record_at=(12,))
    out["stock_losses"] = theirs.losses
    out["stock_state_differs"] = differing(
        {k: v for k, v in full.states[12].items() if k != "rng"}, {k: v for k, v in theirs.states[12].items() if k != "rng"}
    )
    out["stock_dirs"] = sorted(os.listdir(os.path.join(base, "stock")))
    out["layout_differs"] = layout_differences(os.path.join(base, "exact", "step-12"), os.path.join(base, "stock", "step-12"))

    # overlapckpt's manager resumes from what TorchTitan's wrote (no manifest: read through the allowlists).
    back = Run(rank, world, **kw)
    manager = back.manager(ours("stock", read_stock_checkpoints=True))  # an explicit choice
    manager.load(step=12)
    back.states[-1] = back.local_state()
    manager.close()
    out["from_stock_differs"] = [k for k in differing(full.states[12], back.states[-1]) if k != "rng"]
    out["from_stock_train_state"] = back.train_state.state_dict()

    return out  # replay under this manager: the pipeline and the stages scenarios


def scenario_parts(rank: int, world: int) -> dict[str, Any]:
    """Two pipeline stages on one rank, replay at window 3; a container of two optimizer types."""
    from overlapckpt.errors import UnsupportedOptimizerError

    kw = {"fsdp": False, "parts": 2, "impl": "for-loop"}
    full = Run(rank, world, **kw)
    full.train(full.manager(ours("parts", window=3)), record_at=(8,))
    out: dict[str, Any] = {"losses": full.losses, "dirs": sorted(os.listdir(os.path.join(os.environ["TITAN_BASE"], "parts")))}
    again = resumed(rank, world, kw, ours("parts", window=3), 8)
    out["ours_state_differs"] = differing(full.states[8], again.states[-1])
    out["ours_losses"] = again.losses
    parts_dir = os.path.join(os.environ["TITAN_BASE"], "parts", "step-8")
    theirs = resumed(rank, world, kw, stock("stock", initial_load_path=parts_dir, initial_load_model_only=False), -1)
    out["stock_state_differs"] = [k for k in differing(full.states[8], theirs.states[-1]) if k != "rng"]
    out["stock_losses"] = theirs.losses

    mixed = Run(rank, world, fsdp=False, mixed=True, impl="for-loop")
    try:
        mixed.manager(ours("mixed", window=3))
        out["mixed_replay_error"] = None
    except UnsupportedOptimizerError as e:
        out["mixed_replay_error"] = str(e)
    mixed.train(mixed.manager(ours("mixed")), record_at=(8,))
    again = resumed(rank, world, {"fsdp": False, "mixed": True, "impl": "for-loop"}, ours("mixed"), 8)
    out["mixed_state_differs"] = differing(mixed.states[8], again.states[-1])
    out["mixed_losses_equal"] = [again.losses[s] == mixed.losses[s] for s in range(9, STEPS + 1)]
    return out


def scenario_pipeline(rank: int, world: int) -> dict[str, Any]:
    """Pipeline parallelism across the ranks: rank r holds stage r, plain tensors no other rank holds."""
    kw = {"fsdp": False, "pipeline": True, "impl": "foreach"}
    base = os.environ["TITAN_BASE"]
    full = Run(rank, world, **kw)
    full.train(full.manager(ours("exact")), record_at=(8, 10, 12))
    out: dict[str, Any] = {"losses": full.losses, "exact_dirs": sorted(os.listdir(os.path.join(base, "exact")))}
    state_file = os.path.join(os.path.dirname(base), f"state12_rank{rank}.pt")
    torch.save({k: v for k, v in full.states[12].items() if k.startswith(("model.", "optimizer."))}, state_file)
    out["state12_file"] = state_file
    out["step12_dir"] = os.path.join(base, "exact", "step-12")
    again = resumed(rank, world, kw, ours("exact"), 8)
    out["ours_state_differs"] = differing(full.states[8], again.states[-1])
    out["ours_losses"] = again.losses
    # (TorchTitan's own manager resuming from ours: the FSDP2 and the stages scenarios.)
    out.update(replay_checks(rank, world, kw, full, base))
    return out


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    os.environ["TITAN_BASE"] = os.path.join(out_dir, "job")
    scenarios = {"fsdp": scenario_fsdp, "parts": scenario_parts, "pipeline": scenario_pipeline}
    write_rank_result_and_leave(os.path.join(out_dir, f"rank{rank}.json"), lambda: scenarios[scenario](rank, world))


if __name__ == "__main__":
    main()
