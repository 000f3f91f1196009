"""Replay of a fused Adam / AdamW that stepped on a GPU: CUDA's fused arithmetic on the CPU (fused_adam_math.py).

On an H200 (torch 2.11) replay through the CPU's fused kernel left exp_avg_sq 1.25e-5 away
from the device's own state after 3 steps: the CUDA kernel computes with float32 betas and
FMAs. Here: the emulation is that formula with one rounding per operation (against exact
rational arithmetic), it is not the CPU kernel, the measurement picks the CPU kernel where
the CPU kernel ran, and the writer's replay takes the arithmetic the log names.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from exact_float import f32, fma32

from overlapckpt import fused_adam_math, fused_adam_native
from overlapckpt.format.entries import ROLE_OPTIM, ROLE_PARAM, TensorEntry
from overlapckpt.fused_adam_math import ARITHMETICS, CUDA_FP32_FMA, CUDA_FP32_FMA_L2_ROUNDED, step_like_cuda_fused_adam
from overlapckpt.protocol import GradientStep, ReplayLog, ReplayTables
from overlapckpt.train.consistency import fused_arithmetic
from overlapckpt.writer.replay import replay_to_version


@pytest.fixture(autouse=True, params=["native", "python"])
def road(request, monkeypatch):
    """Every test on both roads: the C loop (csrc/fused_adam_cuda.c) and its torch twin."""
    if request.param == "python":
        monkeypatch.setenv("OVERLAPCKPT_NATIVE", "0")
    elif shutil.which("cc") or shutil.which("gcc"):
        assert fused_adam_native.library() is not None  # where it can be built it must be: no silent twin
    else:
        pytest.skip("no C compiler: the native road is not built here")
    return request.param


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
        step_like_cuda_fused_adam([param], [g], [exp_avg], [exp_avg_sq], None, [step], lr=1e-3, beta1=0.9, beta2=0.999,
                                  weight_decay=0.01, eps=1e-8, maximize=False, decoupled_weight_decay=decoupled,
                                  arithmetic=arithmetic)
        reference = [
            _reference_step(p, float(gi), m, v, float(count), 1e-3, 0.9, 0.999, 0.01, 1e-8, decoupled, arithmetic == CUDA_FP32_FMA)
            for (p, m, v), gi in zip(reference, g)
        ]
    assert float(step) == 3.0
    for got, column in ((param, 0), (exp_avg, 1), (exp_avg_sq, 2)):
        assert torch.equal(got, torch.tensor([r[column] for r in reference], dtype=torch.float32))


def test_cudas_arithmetic_is_not_the_cpu_kernels_it_differs_by_the_float32_betas():
    # Why replay cannot use the CPU kernel for a GPU's fused steps: 1 - float32(0.999) is not float32(1 - 0.999).
    start, grads = _random_state(4096, seed=2)
    emulated = fused_arithmetic._state_by_emulation(torch.optim.AdamW, start, grads, CUDA_FP32_FMA)
    cpu_kernel = fused_arithmetic._state_after(torch.optim.AdamW, torch.device("cpu"), start, grads)
    relative = ((emulated[2] - cpu_kernel[2]).abs() / cpu_kernel[2]).max().item()
    one_minus_beta2 = 1 - torch.tensor(0.999, dtype=torch.float32).item()
    assert relative == pytest.approx(abs(one_minus_beta2 - 0.001) / 0.001, rel=0.05)  # 1.29e-5
    assert not torch.equal(emulated[0], cpu_kernel[0])


def test_the_probe_never_steps_its_start_state_in_place():
    """Before: on the CPU, start.to("cpu") was start itself, so the fused step changed the probe's start state and
    every candidate measured after it started from the stepped state."""
    start, grads = _random_state(4096, seed=3)
    kept = (start.clone(), [g.clone() for g in grads])
    first = fused_arithmetic._state_after(torch.optim.AdamW, torch.device("cpu"), start, grads)
    assert torch.equal(start, kept[0]) and all(torch.equal(g, k) for g, k in zip(grads, kept[1]))
    again = fused_arithmetic._state_after(torch.optim.AdamW, torch.device("cpu"), start, grads)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_the_measurement_picks_the_cpu_kernel_where_the_cpu_kernel_ran():
    assert fused_arithmetic.measure(torch.optim.AdamW, torch.device("cpu")) is None
    assert fused_arithmetic.measure(torch.optim.Adam, torch.device("cpu")) is None
    # CPU training is never measured: its own kernel is what ran.
    model = torch.nn.Linear(4, 4)
    assert fused_arithmetic.replay_arithmetic(torch.optim.AdamW, torch.optim.AdamW(model.parameters(), fused=True).param_groups) is None
    assert fused_arithmetic.fused_device(torch.optim.SGD, [{"fused": True, "params": [torch.zeros(1, device="meta")]}]) is None


def test_a_device_whose_fused_step_cannot_be_measured_leaves_the_cpu_kernel_with_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(fused_arithmetic, "_measured", {})  # measured once per process and (class, device): again here
    # The meta device runs no kernel: the measurement fails, and the Checkpointer must still build.
    params = [torch.nn.Parameter(torch.zeros(4, device="meta"))]
    with caplog.at_level("WARNING", logger="overlapckpt"):
        assert fused_arithmetic.replay_arithmetic(torch.optim.AdamW, [{"fused": True, "params": params}]) is None
    assert "could not measure the device's arithmetic" in caplog.text and "on meta" in caplog.text


@pytest.mark.parametrize("device_computes", ARITHMETICS)
def test_the_measurement_picks_the_arithmetic_the_device_computes(monkeypatch, device_computes):
    # The device's own fused step stood in for by one of the emulations (no GPU here); the CPU kernel stays itself.
    real_state_after = fused_arithmetic._state_after

    def state_after(optimizer_cls, device, start, grads):
        if device.type == "cpu":
            return real_state_after(optimizer_cls, device, start, grads)
        return fused_arithmetic._state_by_emulation(optimizer_cls, start, grads, device_computes)

    monkeypatch.setattr(fused_arithmetic, "_state_after", state_after)
    assert fused_arithmetic.measure(torch.optim.Adam, torch.device("cuda")) == device_computes
    # AdamW never reaches Adam's L2 line: both emulations are the same, and the tie goes to the first listed.
    assert fused_arithmetic.measure(torch.optim.AdamW, torch.device("cuda")) == CUDA_FP32_FMA


def test_the_writer_refuses_a_fused_arithmetic_it_does_not_know():
    with pytest.raises(ValueError, match=r"names the fused arithmetic 'cuda-fp64'.*run one version"):
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
        fused_arithmetic=arithmetic,
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
        [live], [grads[1]], [state["exp_avg"]], [state["exp_avg_sq"]], [state["max_exp_avg_sq"]] if amsgrad else None,
        [state["step"]], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False,
        decoupled_weight_decay=optimizer_cls is torch.optim.AdamW, arithmetic=arithmetic_named,
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
            step_like_cuda_fused_adam([param], [grad], [exp_avg], [exp_avg_sq], None, [step], lr=1e-3, beta1=betas[0],
                                      beta2=betas[1], weight_decay=0.01, eps=1e-8, maximize=True, decoupled_weight_decay=True)
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
        step_like_cuda_fused_adam([p64], [p64], [p64.clone()], [p64.clone()], None, [torch.zeros(())], lr=1e-3, beta1=0.9,
                                  beta2=0.999, weight_decay=0.0, eps=1e-8, maximize=False, decoupled_weight_decay=True)


def _mixed_optimizer(cls: type) -> tuple[torch.optim.Optimizer, dict[str, torch.nn.Parameter]]:
    start, grads = _random_state(64, seed=5)
    params = {
        "fused32": torch.nn.Parameter(start.clone()),
        "fused64": torch.nn.Parameter(start.double()),
        "fused_no_grad": torch.nn.Parameter(start.clone() * 2),
        "plain": torch.nn.Parameter(start.clone() * 3),
    }
    optimizer = cls(
        [{"params": [params["fused32"], params["fused64"], params["fused_no_grad"]], "fused": True, "amsgrad": True},
         {"params": [params["plain"]], "foreach": True}],
        lr=1e-3, weight_decay=0.01,
    )
    params["fused32"].grad = grads[0].clone()
    params["fused64"].grad = grads[0].double()
    params["plain"].grad = grads[1].clone()
    return optimizer, params


def test_the_writer_emulates_only_torchs_fused_float_steps_and_steps_everything_else_with_the_optimizer():
    from overlapckpt.writer.replay import _step_fused_groups_like_the_device

    replayed, params = _mixed_optimizer(torch.optim.AdamW)
    _step_fused_groups_like_the_device(replayed, CUDA_FP32_FMA)
    stock, stock_params = _mixed_optimizer(torch.optim.AdamW)
    stock.step()  # the CPU's kernels throughout
    # The float32 fused parameter: the emulation, with its amsgrad state made as torch makes it.
    expected = torch.nn.Parameter(_random_state(64, seed=5)[0].clone())
    state = {"step": torch.zeros(()), "exp_avg": torch.zeros(64), "exp_avg_sq": torch.zeros(64), "max_exp_avg_sq": torch.zeros(64)}
    step_like_cuda_fused_adam([expected], [params["fused32"].grad], [state["exp_avg"]], [state["exp_avg_sq"]],
                              [state["max_exp_avg_sq"]], [state["step"]], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01,
                              eps=1e-8, maximize=False, decoupled_weight_decay=True)
    assert torch.equal(params["fused32"], expected)
    assert replayed.state[params["fused32"]].keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(replayed.state[params["fused32"]][k], v), k
    assert not torch.equal(params["fused32"], stock_params["fused32"])  # so the line above can tell them apart
    # Float64, the non-fused group, and the parameter without a gradient: as the optimizer itself steps them.
    for name in ("fused64", "plain", "fused_no_grad"):
        assert torch.equal(params[name], stock_params[name]), name
        assert replayed.state[params[name]].keys() == stock.state[stock_params[name]].keys(), name
        for k, v in stock.state[stock_params[name]].items():
            assert torch.equal(replayed.state[params[name]][k], v), (name, k)
    assert not replayed.state[params["fused_no_grad"]]


def test_a_subclass_with_its_own_step_is_replayed_by_that_step_and_never_measured(caplog):
    from overlapckpt.writer.replay import _step_fused_groups_like_the_device

    class CountingAdamW(torch.optim.AdamW):
        steps = 0

        def step(self, closure=None):
            CountingAdamW.steps += 1
            return super().step(closure)

    class PlainSubclass(torch.optim.AdamW):
        pass

    replayed, params = _mixed_optimizer(CountingAdamW)
    _step_fused_groups_like_the_device(replayed, CUDA_FP32_FMA)
    stock, stock_params = _mixed_optimizer(torch.optim.AdamW)
    stock.step()
    assert CountingAdamW.steps == 1
    for name in params:
        assert torch.equal(params[name], stock_params[name]), name
    on_device = [{"fused": True, "params": [torch.zeros(1, device="meta")]}]
    assert fused_arithmetic.fused_device(CountingAdamW, on_device) is None
    assert fused_arithmetic.fused_device(PlainSubclass, on_device) == torch.device("meta")
    # Fused parameters on the CPU and an accelerator at once: one arithmetic cannot serve both.
    with caplog.at_level("WARNING", logger="overlapckpt"):
        mixed = [{"fused": True, "params": [torch.zeros(1), torch.zeros(1, device="meta")]}]
        assert fused_arithmetic.fused_device(torch.optim.AdamW, mixed) is None
    assert "step on ['cpu', 'meta']; replay uses the CPU's fused kernel" in caplog.text
    # Float64 parameters alone are not emulated: nothing to measure.
    assert fused_arithmetic.fused_device(torch.optim.AdamW, [{"fused": True, "params": [torch.zeros(1, dtype=torch.float64, device="meta")]}]) is None


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
            step_like_cuda_fused_adam([state[0]], [g], [state[1]], [state[2]], [state[3]] if amsgrad else None, [state[4]],
                                      lr=3e-4, beta1=0.8, beta2=0.99, weight_decay=0.1, eps=1e-6, maximize=maximize,
                                      decoupled_weight_decay=decoupled, arithmetic=arithmetic)
        results[name] = state
    for native, twin in zip(results["native"], results["python"]):
        assert torch.equal(native, twin)


def test_a_failed_build_of_the_c_pass_leaves_no_file_and_the_torch_twin_runs(monkeypatch, tmp_path, road):
    if road == "python":
        pytest.skip("about the native road's build: run once")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setattr(fused_adam_native._fused_adam, "_loaded", {})
    assert fused_adam_native.build() is None and fused_adam_native.library() is None
    assert list((tmp_path / "overlapckpt").iterdir()) == []
    param, grad = torch.ones(8), torch.full((8,), 0.5)
    state = [torch.zeros(8), torch.zeros(8)]
    assert not fused_adam_native.step_float32([param, grad, *state], False, lr_times_weight_decay=0.0, beta1=0.9, beta2=0.999,
                                              weight_decay=0.0, eps=1e-8, step_size=1e-3, bias_correction2_sqrt=1.0,
                                              decoupled_weight_decay=True, l2_contracted=True, maximize=False)
    step_like_cuda_fused_adam([param], [grad], state[:1], state[1:], None, [torch.zeros(())], lr=1e-3, beta1=0.9, beta2=0.999,
                              weight_decay=0.0, eps=1e-8, maximize=False, decoupled_weight_decay=True)  # the twin
    expected = _reference_step(1.0, 0.5, 0.0, 0.0, 1.0, 1e-3, 0.9, 0.999, 0.0, 1e-8, True)[0]
    assert torch.equal(param, torch.full((8,), expected, dtype=torch.float32))
