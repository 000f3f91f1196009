"""``python examples/demo.py``: train a small GPT, checkpoint without stopping, restore, verify.

Runs on the GPU when there is one, else on the CPU; checkpoints go to
``./demo-checkpoints`` (or ``--path``). It prints each checkpoint's step, bytes,
device-side waits and time to commit, then restores the newest checkpoint into
fresh objects and shows that (1) the restored state equals the saved state bit for
bit and (2) continuing reproduces the uninterrupted run's next losses exactly.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time

import torch
from torch import nn

from overlapckpt import Checkpointer, load


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder in pure torch: token + position embeddings, causal blocks, tied head."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, context: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, context, dim))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos[:, : idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class TokenStream:
    """Synthetic tokens from its own generator; stateful, so a resume continues the stream."""

    def __init__(self, vocab: int, context: int, batch: int, seed: int = 0) -> None:
        self.vocab, self.context, self.batch = vocab, context, batch
        self.generator = torch.Generator().manual_seed(seed)

    def next(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # A repeating pattern plus noise, so the loss has something to learn.
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=self.generator)
        seq = (start + torch.arange(self.context + 1) * 7) % self.vocab
        noise = torch.randint(0, self.vocab, seq.shape, generator=self.generator)
        seq = torch.where(torch.rand(seq.shape, generator=self.generator) < 0.1, noise, seq).to(device)
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def build(device: torch.device, total_steps: int):
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))
    )
    data = TokenStream(vocab=256, context=32, batch=16)
    return model, optimizer, scheduler, data


def train_step(model, optimizer, scheduler, data, device) -> float:
    x, y = data.next(device)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    return float(loss.detach())


def clear_previous_demo(path: str) -> None:
    """Remove an earlier demo's checkpoints at ``path``; refuse, naming it, a path that holds anything else.

    The demo starts from nothing each time, but ``--path`` may name any directory: only a
    checkpoint root (``step-*`` directories, ``latest``, overlapckpt's own dot files) is
    deleted, never a directory with other files in it.
    """
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise SystemExit(f"--path {path!r} exists and is not a checkpoint directory; pass a new or empty directory")
    foreign = [
        name for name in os.listdir(path)
        if not (name == "latest" or name.startswith(".overlapckpt") or (name.startswith("step-") and os.path.isdir(os.path.join(path, name))))
    ]
    if foreign:
        raise SystemExit(
            f"--path {path!r} holds {', '.join(sorted(foreign)[:3])}{' ...' if len(foreign) > 3 else ''}, which are not "
            "checkpoints; the demo deletes its root before it starts, so pass a new or empty directory"
        )
    shutil.rmtree(path)
    print(f"removed the previous demo's checkpoints in {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="demo-checkpoints", help="checkpoint root: a directory or fsspec URL")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--window", type=int, default=1)
    parser.add_argument("--consistency", default="replay", choices=["replay", "stage"])
    parser.add_argument("--check-steps", type=int, default=10, help="steps compared after the restore")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "://" not in args.path:
        clear_previous_demo(args.path)
    print(f"overlapckpt demo on {device}: {args.steps} steps, checkpoint every {args.every}, window {args.window}")

    model, optimizer, scheduler, data = build(device, args.steps)
    stateful = {"scheduler": scheduler, "data": data}
    losses: dict[int, float] = {}
    started = time.perf_counter()
    with Checkpointer(model, optimizer, args.path, window=args.window, consistency=args.consistency,
                      every=args.every, keep=3, stateful=stateful) as ckpt:
        for step in range(1, args.steps + args.check_steps + 1):
            losses[step] = train_step(model, optimizer, scheduler, data, device)
            ckpt.step()  # the iteration boundary, after scheduler.step()
        ckpt.wait()
        stats = ckpt.stats
    elapsed = time.perf_counter() - started
    print(f"trained {args.steps + args.check_steps} steps in {elapsed:.1f} s; loss {losses[1]:.3f} -> {losses[args.steps]:.3f}")
    print(f"{'step':>6} {'MiB':>8} {'device waits':>13} {'in flight':>10} {'copy ms':>8} {'commit s':>9}")
    for s in stats:
        print(f"{s['step']:>6} {s['nbytes'] / 2**20:>8.2f} {s['device_waits_inserted']:>13} "
              f"{s['device_waits_in_flight']:>10} {1e3 * s['copy_s']:>8.2f} {s['time_to_commit_s']:>9.3f}")

    newest = max(s["step"] for s in stats if s["step"] <= args.steps)
    model2, optimizer2, scheduler2, data2 = build(device, args.steps)
    info = load(args.path, model2, optimizer2, stateful={"scheduler": scheduler2, "data": data2}, step=newest)
    print(f"restored step {info.step} from {info.path}")
    # Replay the uninterrupted run's state at that step for the comparison.
    model3, optimizer3, scheduler3, data3 = build(device, args.steps)
    for _ in range(info.step):
        train_step(model3, optimizer3, scheduler3, data3, device)
    same = all(torch.equal(a, b) for a, b in zip(model3.state_dict().values(), model2.state_dict().values()))
    o3, o2 = optimizer3.state_dict()["state"], optimizer2.state_dict()["state"]
    same = same and all(torch.equal(o3[k][n], o2[k][n]) for k in o3 for n in o3[k])
    print(f"restored state equals the saved state bit for bit: {same}")
    resumed = [train_step(model2, optimizer2, scheduler2, data2, device) for _ in range(args.check_steps)]
    reference = [losses[info.step + i + 1] for i in range(args.check_steps)]
    exact = resumed == reference
    print(f"next {args.check_steps} losses after the restore equal the uninterrupted run's exactly: {exact}")
    for i, (a, b) in enumerate(zip(reference, resumed)):
        print(f"  step {info.step + i + 1}: uninterrupted {a:.6f}  resumed {b:.6f}")
    if not (same and exact):
        raise SystemExit("demo: the restored run diverged from the uninterrupted one")


if __name__ == "__main__":
    main()
