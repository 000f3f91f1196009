"""``python examples/demo_dist.py``: checkpoint a 2-rank FSDP2 run, restore it in one process, verify.

Three modes:

* ``launch`` (the default): runs ``train`` under ``torchrun --standalone
  --nproc_per_node=NPROC`` (a free port is picked), then ``restore`` in this process.
* ``train`` (under torchrun, on every rank): a small GPT sharded with FSDP2
  (``fully_shard`` on a ``("cpu", (NPROC,))`` mesh, gloo), each rank with its own
  data stream (a stateful sampler) and dropout RNG, checkpointed with overlapckpt
  (``window=4`` replay, ``every=10`` by default). Each rank copies and writes only
  its local shards. After every step the ranks also gather the full, unsharded state
  (``get_state_dict(..., full_state_dict=True)``); rank 0 saves it for every
  committed version as ``reference-step-<V>.pt`` under the checkpoint root.
* ``restore`` (one process, no torch.distributed): loads the newest checkpoint into a
  plain, unsharded model and optimizer with ``overlapckpt.load(...,
  per_rank_state="skip")`` and compares them, bit for bit, with that reference.
  Exits non-zero on any difference.

Checkpoints go to ``./demo-dist-checkpoints`` (or ``--path``), which ``train`` empties first.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from overlapckpt import Checkpointer, CheckpointMismatchError, load

from demo import TinyGPT, TokenStream  # beside this file, which Python puts first on sys.path

# Settings of the model and data; the same in the ranks and in the restoring process.
VOCAB, DIM, LAYERS, HEADS, CONTEXT, BATCH = 256, 64, 2, 4, 32, 8
# Gloo collectives of the demo itself (the training ranks' group); a rank that died
# makes the other fail within this, not hang for gloo's default 30 minutes.
TRAIN_GROUP_TIMEOUT_S = 120.0


def reference_file(path: str, version: int) -> str:
    return os.path.join(path, f"reference-step-{version}.pt")


def build(total_steps: int, rank: int) -> tuple[TinyGPT, torch.optim.Optimizer, Any, TokenStream]:
    """The same initial weights everywhere; data and dropout RNG differ per rank."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, context=CONTEXT)
    return model, *optimizer_for(model, total_steps), TokenStream(VOCAB, CONTEXT, BATCH, seed=1000 + rank)


def optimizer_for(model: nn.Module, total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))
    )
    return optimizer, scheduler


def flat_state(msd: dict[str, Any], osd: dict[str, Any]) -> dict[str, Any]:
    """Model and optimizer state by DCP key: tensors detached and cloned, param_groups without their 'params'."""
    out: dict[str, Any] = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        for k, v in state.items():
            out[f"optimizer.state.{fqn}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    for i, group in enumerate(osd["param_groups"]):
        for k, v in group.items():
            if k != "params":
                out[f"optimizer.param_groups.{i}.{k}"] = v
    return out


def differences(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Keys missing on either side, or whose values are not bit-identical (dtype and shape included)."""
    problems = [f"{k}: only in the reference" for k in sorted(set(expected) - set(got))]
    problems += [f"{k}: only in the restored state" for k in sorted(set(got) - set(expected))]
    for k in sorted(set(expected) & set(got)):
        a, b = expected[k], got[k]
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            same = (
                isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b)
            )
        else:
            same = a == b
        if not same:
            problems.append(f"{k}: {a!r} != {b!r}" if not isinstance(a, torch.Tensor) else f"{k}: tensors differ")
    return problems


# ---- train: one rank, under torchrun ------------------------------------------------


def train(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", timeout=timedelta(seconds=TRAIN_GROUP_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = False
    try:
        if rank == 0 and "://" not in args.path:
            shutil.rmtree(args.path, ignore_errors=True)
        dist.barrier()  # no rank constructs its Checkpointer before the old checkpoints are gone

        torch.manual_seed(0)
        model = TinyGPT(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=HEADS, context=CONTEXT)
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer, scheduler = optimizer_for(model, args.steps)
        sampler = TokenStream(VOCAB, CONTEXT, BATCH, seed=1000 + rank)  # each rank its own data
        torch.manual_seed(100 + rank)  # each rank its own dropout masks
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # the whole state, on rank 0 only
        if rank == 0:
            print(
                f"overlapckpt demo-dist: {world} ranks, FSDP2 on a CPU mesh (gloo), {args.steps} steps, "
                f"checkpoint every {args.every}, window {args.window} ({args.consistency})",
                flush=True,
            )

        states: dict[int, dict[str, Any]] = {}  # step -> the full state after it (rank 0)
        losses: list[float] = []
        gather_s = 0.0  # spent gathering the reference, not training
        started = time.perf_counter()
        with Checkpointer(
            model, optimizer, args.path, window=args.window, consistency=args.consistency, every=args.every,
            keep=3, stateful={"scheduler": scheduler, "sampler": sampler}, max_inflight=args.max_inflight,
        ) as ckpt:
            for step in range(1, args.steps + 1):
                x, y = sampler.next(torch.device("cpu"))
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()  # overlapckpt's hooks: this rank's shards, over the window
                scheduler.step()
                ckpt.step()  # the iteration boundary: sampler, scheduler and RNG state
                losses.append(float(loss.detach()))
                # The reference for the check: the unsharded state at every version (a
                # collective, here in the loop, never in overlapckpt's hooks).
                gather_started = time.perf_counter()
                msd, osd = get_state_dict(model, optimizer, options=full)
                if rank == 0:
                    states[step] = flat_state(msd, osd)
                gather_s += time.perf_counter() - gather_started
            committed = ckpt.wait(timeout_s=120)
            stats = ckpt.stats
        elapsed = time.perf_counter() - started

        if rank == 0:
            print(
                f"trained {args.steps} steps in {elapsed:.1f} s ({gather_s:.1f} s of it gathering the full state for "
                f"the check); rank 0 loss {losses[0]:.3f} -> {losses[-1]:.3f}"
            )
        # Each rank's own figures: its share of the state, its time inside the hooks.
        lines = [f"rank {rank}: {'version':>7} {'requested':>9} {'KiB':>8} {'hooks ms':>9} {'commit s':>9}"]
        for s in stats:
            lines.append(
                f"rank {rank}: {s['step']:>7} {s['requested_step']:>9} {s['nbytes'] / 2**10:>8.1f} "
                f"{1e3 * s['hook_host_s']:>9.1f} {s['time_to_commit_s']:>9.3f}"
            )
        for r in range(world):  # print rank by rank, so the tables do not interleave
            if r == rank:
                print("\n".join(lines), flush=True)
            dist.barrier()
        versions = sorted(s["step"] for s in stats)
        if sorted(i.step for i in committed) != versions:
            raise RuntimeError(f"wait() returned versions {[i.step for i in committed]}, the stats {versions}")
        if rank == 0:
            for version in versions:
                torch.save(states[version], reference_file(args.path, version))
            print(f"saved the full {world}-rank state of versions {versions} for the check", flush=True)
    except BaseException:
        failed = True
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    if failed:
        os._exit(1)  # torchrun stops the other ranks; no barrier they might never reach
    sys.stdout.flush()
    try:
        dist.barrier()  # every rank's files are written before any rank leaves
    finally:
        # gloo's teardown at interpreter exit can abort ("terminate called without an
        # active exception"); everything is written and flushed, so leave without it.
        os._exit(0)


# ---- restore: one process ------------------------------------------------------------


def restore(args: argparse.Namespace) -> int:
    from overlapckpt import list_checkpoints

    infos = list_checkpoints(args.path)
    if not infos:
        print(f"demo-dist: no committed checkpoint under {args.path}", file=sys.stderr)
        return 1
    newest = infos[-1]
    print(f"committed: {[(i.step, i.world_size) for i in infos]} (version, ranks); restoring {newest.path}")
    model, optimizer, scheduler, sampler = build(args.steps, rank=0)
    try:
        load(newest.path, model, optimizer, stateful={"scheduler": scheduler, "sampler": sampler})
        print("demo-dist: loading per-rank state at another world size did not raise", file=sys.stderr)
        return 1
    except CheckpointMismatchError as e:
        print(f"per-rank state is refused at another world size, as it should be: {e}")
    # Model and optimizer only: the sampler, scheduler and RNG were per rank.
    info = load(newest.path, model, optimizer, per_rank_state="skip")
    print(f"restored version {info.step}, written by {info.world_size} ranks, into one unsharded process")
    reference = reference_file(args.path, info.step)
    if not os.path.exists(reference):
        print(f"demo-dist: the training ranks saved no reference for version {info.step} ({reference})", file=sys.stderr)
        return 1
    expected = torch.load(reference, weights_only=True)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    problems = differences(expected, flat_state(*get_state_dict(model, optimizer)))
    untrained = differences(expected, flat_state(*get_state_dict(*build(args.steps, rank=0)[:2])))
    tensors = sum(isinstance(v, torch.Tensor) for v in expected.values())
    if not untrained:
        print("demo-dist: the reference equals an untrained model's state; the check would prove nothing", file=sys.stderr)
        return 1
    if problems:
        print(f"restored state DIFFERS from the {info.world_size}-rank run's full state at version {info.step}:", file=sys.stderr)
        for p in problems[:20]:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(
        f"restored model and optimizer state matches the {info.world_size}-rank run's full state at version {info.step} "
        f"bit for bit ({tensors} tensors, {len(expected) - tensors} param_group values)"
    )
    return 0


# ---- launch: torchrun, then restore --------------------------------------------------


def launch(args: argparse.Namespace, passthrough: list[str]) -> int:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        os.path.abspath(__file__), "train", *passthrough,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print("$ torchrun " + " ".join(command[3:]), flush=True)
    code = subprocess.run(command, env=env).returncode
    if code != 0:
        print(f"demo-dist: the {args.nproc}-rank training exited with {code}", file=sys.stderr)
        return code
    return restore(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="launch", choices=["launch", "train", "restore"])
    parser.add_argument("--nproc", type=int, default=2, help="launch: ranks to start with torchrun")
    shared = parser.add_argument_group("passed to every mode")
    shared.add_argument("--path", default="demo-dist-checkpoints", help="checkpoint root")
    shared.add_argument("--steps", type=int, default=36)
    shared.add_argument("--every", type=int, default=10)
    shared.add_argument("--window", type=int, default=4)
    shared.add_argument("--consistency", default="replay", choices=["replay", "stage"])
    shared.add_argument("--max-inflight", type=int, default=1)
    args = parser.parse_args(argv)
    if args.mode == "train":
        train(args)  # never returns
    elif args.mode == "restore":
        raise SystemExit(restore(args))
    passthrough = [
        f"--path={args.path}", f"--steps={args.steps}", f"--every={args.every}", f"--window={args.window}",
        f"--consistency={args.consistency}", f"--max-inflight={args.max_inflight}",
    ]
    raise SystemExit(launch(args, passthrough))


if __name__ == "__main__":
    main()
