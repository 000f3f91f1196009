"""Replay of a fused Adam / AdamW that stepped on a GPU: CUDA's fused arithmetic on the CPU (fused_adam_math.py).

On an H200 (torch 2.11) replay through the CPU's fused kernel left exp_avg_sq 1.25e-5 away
from the device's own state after 3 steps: the CUDA kernel computes with float32 betas and
FMAs. Here: the emulation is that formula with one rounding per operation (against exact
rational arithmetic), the C loop is its torch twin, and the writer's replay takes the arithmetic
the log names (the measurement that names it: tests/test_replay_arithmetic.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from exact_float import f32, fma32

from overlapckpt import cuda_adam_native, fused_adam_math
from overlapckpt.adam_step_arguments import AdamGroupTensors, AdamHyperparameters, FusedAdamScalars
from overlapckpt.format.entries import ROLE_OPTIM, ROLE_PARAM, TensorEntry
from overlapckpt.format.manifest_records import GroupArithmetic
from overlapckpt.fused_adam_math import CUDA_FP32_FMA, CUDA_FP32_FMA_L2_ROUNDED, step_like_cuda_fused_adam
from overlapckpt.protocol import GradientStep, ReplayLog, ReplayTables
from overlapckpt.writer.replay import replay_to_version

from tensor_roads import ROADS, take_cuda_adam_road


@pytest.fixture(autouse=True, params=ROADS)
def road(request, monkeypatch):
    """Every test on both roads: the C loop (csrc/cuda_adam.c) and its torch twin."""
    return take_cuda_adam_road(request.param, monkeypatch)


def _reference_step(p: float, g: float, m: float, v: float, step: float, lr: float, b1: float, b2: float, wd: float,
                    eps: float, decoupled: bool, l2_contracted: bool = True) -> tuple[float, float, float]:
    """aten/src/ATen/native/cuda/fused_adam_utils.cuh's adam_math, line by line, in exact arithmetic rounded as float32."""
    lr, b1, b2, wd, eps = f32(lr), f32(b1), f32(b2), f32(wd), f32(eps)
    bias_correction1 = f32(1 - f32(torch.tensor(b1, dtype=torch.float32).pow(torch.tensor(step)).item()))
    bias_correction2_sqrt = f32(math.sqrt(f32(1 - f32(torch.tensor(b2, dtype=torch.float32).pow(torch.tensor(step)).item()))))
    if wd != 0:
        if decoupled:
            p = fma32(-f32(lr * wd), p, p)
        elif l2_contracted:
            g = fma32(p, wd, g)
        else:
            g = f32(g + f32(p * wd))
    m = fma32(b1, m, fma32(-b1, g, g))
    gg = f32(g * g)
    v = fma32(b2, v, fma32(-b2, gg, gg))
    step_size = f32(lr / bias_correction1)
    denom = f32(f32(f32(math.sqrt(v)) / bias_correction2_sqrt) + eps)
    p = f32(p - f32(f32(step_size * m) / denom))
    return p, m, v


def _random_state(elements: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(elements, generator=generator) * torch.logspace(-3, 1, elements)
    grads = [torch.randn(elements, generator=generator) * torch.logspace(-4, 0, elements) for _ in range(3)]
    return start, grads


@pytest.mark.parametrize(
    "decoupled, arithmetic",
    [(True, CUDA_FP32_FMA), (False, CUDA_FP32_FMA), (False, CUDA_FP32_FMA_L2_ROUNDED)],
    ids=["adamw", "adam", "adam-l2-rounded"],
)
def test_the_emulation_is_cudas_fused_formula_with_one_rounding_per_operation(decoupled, arithmetic):
    start, grads = _random_state(96, seed=1)
    param, exp_avg, exp_avg_sq, step = start.clone(), torch.zeros(96), torch.zeros(96), torch.zeros(())
    reference = [(float(p), 0.0, 0.0) for p in start]
    for count, g in enumerate(grads, start=1):
        step_like_cuda_fused_adam(
            AdamGroupTensors([param], [g], [exp_avg], [exp_avg_sq], None, [step]),
            AdamHyperparameters(
                lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False, decoupled_weight_decay=decoupled,
            ),
            arithmetic=arithmetic,
        )
        reference = [
            _reference_step(p, float(gi), m, v, float(count), 1e-3, 0.9, 0.999, 0.01, 1e-8, decoupled, arithmetic == CUDA_FP32_FMA)
            for (p, m, v), gi in zip(reference, g)
        ]
    assert float(step) == 3.0
    for got, column in ((param, 0), (exp_avg, 1), (exp_avg_sq, 2)):
        assert torch.equal(got, torch.tensor([r[column] for r in reference], dtype=torch.float32))


def test_the_writer_refuses_an_arithmetic_it_does_not_know():
    with pytest.raises(ValueError, match=r"names the arithmetic 'cuda-fp64'.*run one version"):
        _replay_one_step("cuda-fp64", torch.optim.AdamW, amsgrad=False)


def _replay_one_step(arithmetic: str | None, optimizer_cls: type, amsgrad: bool) -> dict[str, torch.Tensor]:
    """The writer's replay of one logged step of a 64-element parameter copied at step 0."""
    start, grads = _random_state(64, seed=3)
    live = torch.nn.Parameter(start.clone())
    optimizer = optimizer_cls([live], lr=1e-3, weight_decay=0.01, fused=True, amsgrad=amsgrad)
    live.grad = grads[0]
    optimizer.step()  # the state at the copy: step 1
    names = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    tensors = [live.detach().clone()] + [optimizer.state[live][n].clone() for n in names]
    entries = [TensorEntry("model.w", ("model", "w"), ROLE_PARAM, "w", torch.float32, (64,), 256)] + [
        TensorEntry(f"optim.w.{n}", ("optim", "w", n), ROLE_OPTIM, "w", t.dtype, tuple(t.shape), t.nbytes)
        for n, t in zip(names, tensors[1:])
    ]
    hyperparameters = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    log = ReplayLog(
        optimizer_class=(optimizer_cls.__module__, optimizer_cls.__qualname__), grad_buffer_id=0, base_step=1,
        group_versions=[1], steps=[GradientStep(step=2, groups=[0], hyperparameters=[hyperparameters], grad_none=[])],
        group_arithmetics=[GroupArithmetic(0, "cuda:0", "fused", arithmetic, True, "named by the test")] if arithmetic else [],
    )
    tables = ReplayTables(grad_offsets={(1, "w"): 0}, grad_nbytes=256, param_group_of={"w": 0}, copy_group_of={"w": 0})
    replay_to_version(entries, tensors, log, tables, grads[1].view(torch.uint8).clone())
    return dict(zip(["param"] + names, tensors))


@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_the_writers_replay_steps_fused_groups_with_the_arithmetic_the_log_names(optimizer_cls, amsgrad):
    arithmetic_named = CUDA_FP32_FMA_L2_ROUNDED if optimizer_cls is torch.optim.Adam else CUDA_FP32_FMA
    start, grads = _random_state(64, seed=3)
    # What each arithmetic makes of the same two steps, computed here without the writer.
    expected: dict[str | None, dict[str, torch.Tensor]] = {}
    live = torch.nn.Parameter(start.clone())
    optimizer = optimizer_cls([live], lr=1e-3, weight_decay=0.01, fused=True, amsgrad=amsgrad)
    for g in grads[:2]:
        live.grad = g
        optimizer.step()
    expected[None] = {"param": live.detach(), **optimizer.state[live]}
    live = torch.nn.Parameter(start.clone())
    optimizer = optimizer_cls([live], lr=1e-3, weight_decay=0.01, fused=True, amsgrad=amsgrad)
    live.grad = grads[0]
    optimizer.step()
    state = optimizer.state[live]
    step_like_cuda_fused_adam(
        AdamGroupTensors(
            [live], [grads[1]], [state["exp_avg"]], [state["exp_avg_sq"]], [state["max_exp_avg_sq"]] if amsgrad else None, [state["step"]],
        ),
        AdamHyperparameters(
            lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False,
            decoupled_weight_decay=optimizer_cls is torch.optim.AdamW,
        ),
        arithmetic=arithmetic_named,
    )
    expected[arithmetic_named] = {"param": live.detach(), **state}
    for arithmetic in (None, arithmetic_named):
        replayed = _replay_one_step(arithmetic, optimizer_cls, amsgrad)
        assert replayed.keys() == expected[arithmetic].keys()
        for name, tensor in replayed.items():
            assert torch.equal(tensor, expected[arithmetic][name]), (arithmetic, name)
    assert not torch.equal(expected[None]["exp_avg_sq"], expected[arithmetic_named]["exp_avg_sq"])


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.45)], ids=["betas-at-least-half", "betas-below-half"])
def test_the_emulation_holds_in_chunks_on_strided_tensors_and_for_small_betas(monkeypatch, betas):
    # betas below 0.5: 1 - beta is not exact in float32, so (1 - beta) * g takes the float64 FMA road.
    monkeypatch.setattr(fused_adam_math, "_CHUNK_ELEMENTS", 7)  # 96 elements: 14 chunks, the last one short
    start, grads = _random_state(96, seed=4)
    for strided in (False, True):
        base = start.clone().view(12, 8)
        param = base.t() if strided else base  # a transposed view: not contiguous
        exp_avg, exp_avg_sq, step = torch.zeros_like(param), torch.zeros_like(param), torch.zeros(())
        reference = [(float(p), 0.0, 0.0) for p in param.reshape(-1)]
        for count, g in enumerate(grads, start=1):
            grad = g.view_as(param)
            step_like_cuda_fused_adam(
                AdamGroupTensors([param], [grad], [exp_avg], [exp_avg_sq], None, [step]),
                AdamHyperparameters(
                    lr=1e-3, beta1=betas[0], beta2=betas[1], weight_decay=0.01, eps=1e-8, maximize=True, decoupled_weight_decay=True,
                ),
            )
            reference = [
                _reference_step(p, -float(gi), m, v, float(count), 1e-3, betas[0], betas[1], 0.01, 1e-8, True)
                for (p, m, v), gi in zip(reference, grad.reshape(-1))
            ]
        for got, column in ((param, 0), (exp_avg, 1), (exp_avg_sq, 2)):
            assert torch.equal(got.reshape(-1), torch.tensor([r[column] for r in reference], dtype=torch.float32)), (strided, column)


def test_float64_tensors_are_refused_by_the_emulation_and_left_to_the_cpu_kernel_by_the_writer():
    # CUDA's fused kernel computes float64 in double, as the CPU's does: emulating it in float32 would lose precision.
    p64 = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"computes \[torch.float64.*step such tensors with the optimizer itself"):
        step_like_cuda_fused_adam(
            AdamGroupTensors([p64], [p64], [p64.clone()], [p64.clone()], None, [torch.zeros(())]),
            AdamHyperparameters(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, maximize=False, decoupled_weight_decay=True),
        )


@pytest.mark.parametrize("decoupled, arithmetic", [(True, CUDA_FP32_FMA), (False, CUDA_FP32_FMA), (False, CUDA_FP32_FMA_L2_ROUNDED)])
@pytest.mark.parametrize("amsgrad, maximize", [(False, False), (True, True)])
def test_the_c_loop_and_its_torch_twin_agree_bit_for_bit(monkeypatch, road, decoupled, arithmetic, amsgrad, maximize):
    if road == "python":
        pytest.skip("compares the two roads: run once")
    start, grads = _random_state(10_000, seed=6)
    results = {}
    for name in ("native", "python"):
        monkeypatch.setenv("OVERLAPCKPT_NATIVE", "1" if name == "native" else "0")
        state = [start.clone(), torch.zeros(10_000), torch.zeros(10_000), torch.zeros(10_000), torch.zeros(())]
        for g in grads:
            step_like_cuda_fused_adam(
                AdamGroupTensors([state[0]], [g], [state[1]], [state[2]], [state[3]] if amsgrad else None, [state[4]]),
                AdamHyperparameters(
                    lr=3e-4, beta1=0.8, beta2=0.99, weight_decay=0.1, eps=1e-6, maximize=maximize, decoupled_weight_decay=decoupled,
                ),
                arithmetic=arithmetic,
            )
        results[name] = state
    for native, twin in zip(results["native"], results["python"]):
        assert torch.equal(native, twin)


def test_a_failed_build_of_the_c_pass_leaves_no_file_and_the_torch_twin_runs(monkeypatch, tmp_path, road):
    if road == "python":
        pytest.skip("about the native road's build: run once")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setattr(cuda_adam_native._cuda_adam, "_loaded", {})
    assert cuda_adam_native.build() is None and cuda_adam_native.library() is None
    assert list((tmp_path / "overlapckpt").iterdir()) == []
    param, grad = torch.ones(8), torch.full((8,), 0.5)
    state = [torch.zeros(8), torch.zeros(8)]
    scalars = FusedAdamScalars(lr_times_weight_decay=0.0, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, step_size=1e-3,
                               bias_correction2_sqrt=1.0, decoupled_weight_decay=True, l2_contracted=True, maximize=False,
                               weight_decay_applies=False)
    assert not cuda_adam_native.fused_step_float32([param, grad, *state], False, scalars)
    step_like_cuda_fused_adam(
        AdamGroupTensors([param], [grad], state[:1], state[1:], None, [torch.zeros(())]),
        AdamHyperparameters(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, maximize=False, decoupled_weight_decay=True),
    )  # the twin
    expected = _reference_step(1.0, 0.5, 0.0, 0.0, 1.0, 1e-3, 0.9, 0.999, 0.0, 1e-8, True)[0]
    assert torch.equal(param, torch.full((8,), expected, dtype=torch.float32))
