"""The benchmark's training workload: a GPT-style decoder in pure torch, AdamW, synthetic tokens.

Sizes go from ``micro`` (the smoke test) through ``tiny`` (``make bench`` on a
2-core CPU) to ``h200-lean`` (about 440 M parameters) and ``h200`` (about 1.04 B parameters),
both with bf16 autocast and fused AdamW.
The state a checkpoint holds is fp32 parameters plus AdamW's two fp32 moments:
12 bytes per parameter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class WorkloadSize:
    vocab: int
    dim: int
    layers: int
    heads: int
    context: int
    batch: int


SIZES: dict[str, WorkloadSize] = {
    "micro": WorkloadSize(vocab=128, dim=32, layers=1, heads=2, context=16, batch=2),
    "tiny": WorkloadSize(vocab=8192, dim=384, layers=4, heads=6, context=64, batch=4),
    "small": WorkloadSize(vocab=16384, dim=768, layers=8, heads=12, context=256, batch=8),
    # About 1.04 B parameters, 12.5 GB of fp32 state: the 1-3 B range, at the size
    # whose checkpoints (12 methods x 3-4 each) fit gpu.sh's 8-minute budget on one H200.
    "h200": WorkloadSize(vocab=32768, dim=2048, layers=18, heads=16, context=2048, batch=4),
    # About 440 M parameters, 4.9 GiB of fp32 state: h200's layers cut to 6. Its copy (about
    # 95 ms at the 55 GB/s measured on the H200) is about two of its steps by an estimate from
    # h200's 113.6 ms (not yet measured), so the stall shows; its saves take about 40% of
    # h200's, so gpu.sh fits its methods beside the tests in one call.
    "h200-lean": WorkloadSize(vocab=32768, dim=2048, layers=6, heads=16, context=2048, batch=4),
}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, size: WorkloadSize) -> None:
        super().__init__()
        self.tok = nn.Embedding(size.vocab, size.dim)
        self.pos = nn.Embedding(size.context, size.dim)
        self.blocks = nn.ModuleList(Block(size.dim, size.heads) for _ in range(size.layers))
        self.ln = nn.LayerNorm(size.dim)
        self.head = nn.Linear(size.dim, size.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Workload:
    """Model, optimizer and a deterministic token stream, on one device."""

    def __init__(self, size_name: str, device: torch.device, seed: int = 0) -> None:
        self.size_name = size_name
        self.size = SIZES[size_name]
        self.device = device
        torch.manual_seed(seed)
        with torch.device(device):  # built in place: initializing 1 B parameters on the CPU takes long
            self.model = GPT(self.size)
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1, fused=fused or None, foreach=None if fused else True)
        self.autocast = device.type == "cuda"
        self._generator = torch.Generator(device="cpu").manual_seed(seed + 1)
        self.iteration = 0

    def _batch(self) -> torch.Tensor:
        s = self.size
        tokens = torch.randint(0, s.vocab, (s.batch, s.context + 1), generator=self._generator)
        return tokens.to(self.device, non_blocking=True)

    def forward_backward(self) -> None:
        tokens = self._batch()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.iteration += 1

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def state_nbytes(self) -> int:
        """Bytes of tensor state a checkpoint holds: parameters, buffers and optimizer state."""
        total = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        for st in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
        return total

    def describe(self) -> dict[str, Any]:
        return {
            "size": self.size_name,
            **asdict(self.size),
            "parameters": self.parameter_count(),
            "optimizer": "AdamW (fused)" if self.device.type == "cuda" else "AdamW (foreach)",
            "autocast": "bf16" if self.autocast else None,
        }
