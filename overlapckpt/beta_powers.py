"""``pow(beta, k)`` as the training device computed it: the bias corrections of CUDA's fused and capturable kernels.

CUDA's fused Adam kernel and the capturable foreach path compute their bias corrections on the
device, ``1 - pow(beta, step)`` in float32. CUDA's ``powf`` is not correctly rounded, and the
CPU's may round the same power an ulp apart: a relative 1e-7 of an lr-sized update, at some
step counts only. So replay does not compute those powers on the CPU: the training side
computes a table of them on the device once, when the Checkpointer is built
(``train/consistency/replay_arithmetic.py``), out to the step count where ``beta^k`` falls
below 2^-26, and the writer's emulations look them up. Past the table ``1 - beta^k`` is 1 in
float32 whatever ``beta^k`` rounds to, so the CPU's power serves there.

For 0.999 the table holds about 18,000 float32 values (72 KB), for 0.9 about 170. It travels
with each replay log. Shared by the training side and the writer: imports neither.
"""

from __future__ import annotations

import math
import struct

import torch

# Past 2^-26, 1 - beta^k rounds to 1 in float32 (half an ulp below 1 is 2^-25), whatever beta^k's last bits.
NEGLIGIBLE_POWER = 2.0**-26
MAX_TABLE_ENTRIES = 1 << 18  # betas above about 0.99993 stop here (1 MiB); the probe says whether that is exact


def float32_bits(value: float | torch.Tensor) -> int:
    """The bits of a value as float32 (the kernels' beta): the table's key."""
    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


def table_length(beta: float) -> int:
    """The step counts a table for ``beta`` covers: out to where ``beta^k`` falls below 2^-26 (at most ``MAX_TABLE_ENTRIES``)."""
    beta32 = struct.unpack("<f", struct.pack("<f", float(beta)))[0]
    if not 0.0 < beta32 < 1.0:
        return 0  # 0 or 1 (or outside): every power is exact on any device
    return min(MAX_TABLE_ENTRIES, math.ceil(math.log(NEGLIGIBLE_POWER) / math.log(beta32)) + 1)


def powers_on(device: torch.device, beta: float) -> torch.Tensor:
    """``pow(float32(beta), k)`` for k = 1..table_length(beta), computed on ``device`` by torch's float32 ``pow``; on the CPU."""
    n = table_length(beta)
    counts = torch.arange(1, n + 1, dtype=torch.float32, device=device)
    base = torch.full((n,), float(beta), dtype=torch.float32, device=device)
    return torch.pow(base, counts).to("cpu", copy=True)


class BetaPowerTables:
    """The device's ``pow(beta, k)`` for each float32 beta it was computed for; the CPU's float32 ``pow`` past each table."""

    def __init__(self, tables: dict[int, bytes] | None = None) -> None:
        self.tables = dict(tables or {})  # float32 bits of beta -> little-endian float32 values for k = 1, 2, ...
        self._arrays: dict[int, torch.Tensor] = {}

    def add(self, beta: float, powers: torch.Tensor) -> None:
        values = powers.to(torch.float32).reshape(-1).tolist()  # float32 values, exact as Python floats
        self.tables[float32_bits(beta)] = struct.pack(f"<{len(values)}f", *values)
        self._arrays.pop(float32_bits(beta), None)

    def covers(self, beta: float) -> bool:
        return float32_bits(beta) in self.tables

    def power(self, beta: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """``pow(beta, count)`` of float32 0-dim values, as the device computed it where the table holds it."""
        key = float32_bits(beta)
        k = float(count)
        if key in self.tables and k.is_integer() and k >= 1:
            array = self._arrays.get(key)
            if array is None:
                raw = self.tables[key]
                array = self._arrays[key] = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw), dtype=torch.float32)
            if k <= array.numel():
                return array[int(k) - 1].clone()
        return beta.pow(count)
