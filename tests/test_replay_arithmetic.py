"""Each param group's replay arithmetic, measured on its device (train/consistency/replay_arithmetic.py), and the writer
stepping each group by it (device_adam_step.py).

No GPU here: a stand-in device is a `_state_after` that, for a non-CPU device, computes one of the candidates (or
something none of them computes) and the CPU stays itself. The groups' parameters sit on the meta device, which
runs no kernel, so a measurement that is not stood in for fails, as on a device that cannot step.
"""

from __future__ import annotations

import pytest
import torch

from overlapckpt.adam_step_arguments import AdamGroupTensors, AdamHyperparameters
from overlapckpt.beta_powers import BetaPowerTables, powers_on, table_length
from overlapckpt.device_adam_step import FOR_LOOP, FOREACH, FOREACH_CAPTURABLE, FUSED, step_like_the_device
from overlapckpt.foreach_adam_math import CUDA_FOREACH_CAPTURABLE_FP32_FMA, CUDA_FOREACH_FP32_FMA, step_like_cuda_foreach_adam
from overlapckpt.format.entries import ROLE_OPTIM, ROLE_PARAM, TensorEntry
from overlapckpt.format.manifest_records import GroupArithmetic
from overlapckpt.fused_adam_math import CUDA_FP32_FMA, CUDA_FP32_FMA_L2_ROUNDED, step_like_cuda_fused_adam
from overlapckpt.protocol import GradientStep, ReplayLog, ReplayTables
from overlapckpt.train.consistency import replay_arithmetic as ra
from overlapckpt.writer.replay import replay_to_version

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "maximize": False}


@pytest.fixture(autouse=True)
def fresh_measurements(monkeypatch):
    monkeypatch.setattr(ra, "_measured", {})  # measured once per process and configuration: again in each test
    monkeypatch.setattr(ra, "_device_powers", {})


def _configuration(cls: type, path: str, dtype: torch.dtype = torch.float32, **hyper) -> ra._GroupConfiguration:
    flags = {"fused": path == FUSED, "foreach": path in (FOREACH, FOREACH_CAPTURABLE), "capturable": path == FOREACH_CAPTURABLE}
    hyperparameters = {**HYPER, **flags, **hyper}
    return ra._GroupConfiguration(cls, torch.device("cuda"), path, (dtype,), tuple(sorted(hyperparameters.items())))


def _stand_in(monkeypatch, device_computes):
    """The device's own steps computed by ``device_computes(configuration, start, grads)``, its powers by the CPU's pow;
    the CPU runs its own kernels."""
    real_state_after = ra._state_after
    monkeypatch.setattr(ra, "powers_on", lambda device, beta: powers_on(torch.device("cpu"), beta))

    def state_after(configuration, device, start, grads):
        if device.type == "cpu":
            return real_state_after(configuration, device, start, grads)
        return device_computes(configuration, start, grads)

    monkeypatch.setattr(ra, "_state_after", state_after)


def _emulating(name):
    return lambda configuration, start, grads: ra._state_by_emulation(configuration, start, grads, name)


def _cpu_kernel(configuration, start, grads):
    return ra._state_after(configuration, torch.device("cpu"), start, grads)


def test_cudas_fused_arithmetic_is_not_the_cpu_kernels_it_differs_by_the_float32_betas():
    # Why replay cannot use the CPU kernel for a GPU's fused steps: 1 - float32(0.999) is not float32(1 - 0.999).
    configuration = _configuration(torch.optim.AdamW, FUSED)
    start, grads = ra._probe_tensors(torch.float32)
    emulated = ra._state_by_emulation(configuration, start, grads[:3], CUDA_FP32_FMA)
    cpu_kernel = ra._state_after(configuration, torch.device("cpu"), start, grads[:3])
    relative = ((emulated[2] - cpu_kernel[2]).abs() / cpu_kernel[2]).nan_to_num().max().item()
    one_minus_beta2 = 1 - torch.tensor(0.999, dtype=torch.float32).item()
    assert relative == pytest.approx(abs(one_minus_beta2 - 0.001) / 0.001, rel=0.05)  # 1.29e-5
    assert not torch.equal(emulated[0], cpu_kernel[0])


def test_the_probe_never_steps_its_start_state_in_place():
    """Before: on the CPU, start.to("cpu") was start itself, so the step changed the probe's start state and every
    candidate measured after it started from the stepped state."""
    configuration = _configuration(torch.optim.AdamW, FUSED)
    start, grads = ra._probe_tensors(torch.float32)
    kept = (start.clone(), [g.clone() for g in grads])
    first = ra._state_after(configuration, torch.device("cpu"), start, grads)
    assert torch.equal(start, kept[0]) and all(torch.equal(g, k) for g, k in zip(grads, kept[1]))
    again = ra._state_after(configuration, torch.device("cpu"), start, grads)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("path", [FUSED, FOREACH])
def test_the_measurement_picks_the_cpu_kernel_where_the_cpu_kernel_ran(monkeypatch, cls, path):
    _stand_in(monkeypatch, _cpu_kernel)
    assert ra.measure(_configuration(cls, path))[:2] == (None, 0)


@pytest.mark.parametrize(
    "cls, path, device_computes",
    [
        (torch.optim.AdamW, FUSED, CUDA_FP32_FMA),
        (torch.optim.Adam, FUSED, CUDA_FP32_FMA),
        (torch.optim.Adam, FUSED, CUDA_FP32_FMA_L2_ROUNDED),
        (torch.optim.AdamW, FOREACH, CUDA_FOREACH_FP32_FMA),
        (torch.optim.Adam, FOREACH, CUDA_FOREACH_FP32_FMA),
        (torch.optim.AdamW, FOREACH_CAPTURABLE, CUDA_FOREACH_CAPTURABLE_FP32_FMA),
        (torch.optim.Adam, FOREACH_CAPTURABLE, CUDA_FOREACH_CAPTURABLE_FP32_FMA),
    ],
)
@pytest.mark.parametrize("variant", [{}, {"amsgrad": True}, {"maximize": True}, {"weight_decay": 0.0}])
def test_the_measurement_picks_the_arithmetic_the_device_computes(monkeypatch, cls, path, device_computes, variant):
    _stand_in(monkeypatch, _emulating(device_computes))
    best, differing, total = ra.measure(_configuration(cls, path, **variant))
    if cls is torch.optim.AdamW or variant.get("weight_decay") == 0.0:
        # Adam's L2 line never runs: both fused emulations are the same, and the tie goes to the first listed.
        device_computes = {CUDA_FP32_FMA_L2_ROUNDED: CUDA_FP32_FMA}.get(device_computes, device_computes)
    assert (best, differing) == (device_computes, 0)
    assert total == (4 if variant.get("amsgrad") else 3) * ra._PROBE_ELEMENTS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_foreach_measurement_holds_for_half_precision_parameters(monkeypatch, dtype):
    _stand_in(monkeypatch, _emulating(CUDA_FOREACH_FP32_FMA))
    assert ra.measure(_configuration(torch.optim.AdamW, FOREACH, dtype))[:2] == (CUDA_FOREACH_FP32_FMA, 0)


def _differs_from_step(count: int, then_computes):
    """The foreach emulation up to step ``count - 1``, then ``then_computes`` for the remaining steps: a device whose
    arithmetic only shows far from the first steps."""

    def computes(configuration, start, grads):
        param = torch.nn.Parameter(start.clone())
        optimizer = configuration.torch_cls([param], **{**dict(configuration.hyperparameters), "foreach": False})
        for k, g in enumerate(grads):
            if k == ra._FIRST_STEPS:
                optimizer.state[param]["step"].fill_(ra._JUMP_TO_STEP)
            param.grad = g.clone()
            step_count = float(optimizer.state[param]["step"]) + 1 if optimizer.state[param] else 1.0
            if step_count >= count:
                then_computes(optimizer)
            else:
                step_like_the_device(optimizer, [CUDA_FOREACH_FP32_FMA])
        names = ra._state_names(optimizer.param_groups[0])
        return [param.detach().clone()] + [optimizer.state[param][n].clone() for n in names]

    return computes


def test_the_probe_steps_far_step_counts(monkeypatch):
    # A device that computes as the emulation for the first steps and otherwise later (here: as the CPU's kernel
    # from step 9,999 on, as a device whose bias corrections round otherwise far from 1 would): only the
    # probe's later steps can see it, and no candidate is then exact.
    _stand_in(monkeypatch, _differs_from_step(ra._JUMP_TO_STEP + 1, lambda optimizer: optimizer.step()))
    assert ra.measure(_configuration(torch.optim.AdamW, FOREACH))[1] > 0
    monkeypatch.setattr(ra, "_LATER_STEPS", 0)  # the probe without them sees nothing
    assert ra.measure(_configuration(torch.optim.AdamW, FOREACH))[:2] == (CUDA_FOREACH_FP32_FMA, 0)


def test_the_probe_steps_subnormal_gradients_a_flushing_device_shows(monkeypatch):
    # A device that flushes subnormal gradients to zero (FTZ) computes otherwise only on those elements.
    def flushing(configuration, start, grads):
        flushed = [torch.where(g.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(g), g) for g in grads]
        return ra._state_by_emulation(configuration, start, flushed, CUDA_FOREACH_FP32_FMA)

    _stand_in(monkeypatch, flushing)
    best, differing, _ = ra.measure(_configuration(torch.optim.AdamW, FOREACH))
    assert best == CUDA_FOREACH_FP32_FMA and 0 < differing


def _meta_groups(*groups: dict) -> list[dict]:
    return [{**HYPER, "foreach": None, "fused": None, "capturable": False, "differentiable": False, **g} for g in groups]


def test_each_param_group_gets_its_own_arithmetic_and_an_approximate_one_is_warned_of_by_name(monkeypatch, caplog):
    def device(configuration, start, grads):  # fused: CUDA's; foreach: CUDA's; the for-loop: nothing the CPU computes
        if configuration.path == FOR_LOOP:
            exact = ra._state_after(configuration, torch.device("cpu"), start, grads)
            return [t.nextafter(torch.full_like(t, float("inf"))) for t in exact]
        return ra._state_by_emulation(configuration, start, grads, ra.candidates_of(configuration.path)[1])

    _stand_in(monkeypatch, device)
    meta = {"device": "meta"}
    groups = _meta_groups(
        {"params": [torch.zeros(3, **meta)], "fused": True},
        {"params": [torch.zeros(3, **meta)], "foreach": True},
        {"params": [torch.zeros(3, **meta)], "foreach": False},
        {"params": [torch.zeros(3)]},
        {"params": [torch.zeros(3, dtype=torch.float64, **meta)], "foreach": True},
    )
    with caplog.at_level("INFO", logger="overlapckpt"):
        got, _ = ra.group_arithmetics(torch.optim.AdamW, groups)
    assert [(a.group, a.device, a.path, a.arithmetic, a.exact) for a in got] == [
        (0, "meta", FUSED, CUDA_FP32_FMA, True),
        (1, "meta", FOREACH, CUDA_FOREACH_FP32_FMA, True),
        (2, "meta", FOR_LOOP, None, False),
        (3, "cpu", FOR_LOOP, None, True),
        (4, "meta", FOREACH, None, False),
    ]
    assert got[3].evidence == "trained on the CPU: replay runs the same kernel"
    assert got[0].evidence.startswith(f"the probe: {3 * ra._PROBE_ELEMENTS} elements bit for bit")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "AdamW param group 2 (for-loop on meta) is approximate" in warnings[0], warnings
    assert f"{3 * ra._PROBE_ELEMENTS} of {3 * ra._PROBE_ELEMENTS} probe elements differ" in warnings[0]
    # Measured once per configuration and process: a second optimizer of the same groups steps nothing on the device.
    monkeypatch.setattr(ra, "_state_after", None)
    assert ra.group_arithmetics(torch.optim.AdamW, groups)[0] == got


def test_a_device_whose_step_cannot_be_measured_leaves_the_cpu_kernel_with_a_warning(caplog):
    # The meta device runs no kernel: the measurement fails, and the Checkpointer must still build.
    groups = _meta_groups({"params": [torch.zeros(4, device="meta")], "fused": True})
    with caplog.at_level("WARNING", logger="overlapckpt"):
        (got,), _ = ra.group_arithmetics(torch.optim.AdamW, groups)
    assert (got.arithmetic, got.exact, got.evidence) == (None, False, "the device's arithmetic could not be measured")
    assert "AdamW param group 0 (fused on meta): could not measure the device's arithmetic" in caplog.text


def test_a_subclass_with_its_own_step_is_never_measured_and_is_warned_of_on_a_device(caplog, monkeypatch):
    class CountingAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    monkeypatch.setattr(ra, "_state_after", None)  # nothing is stepped on the device
    with caplog.at_level("WARNING", logger="overlapckpt"):
        (got,), _ = ra.group_arithmetics(CountingAdamW, _meta_groups({"params": [torch.zeros(4, device="meta")]}))
        (sgd,), _ = ra.group_arithmetics(torch.optim.SGD, [{"params": [torch.zeros(4)], "lr": 0.1}])
    assert (got.path, got.arithmetic, got.exact) == ("own-step", None, False)
    assert "replay of CountingAdamW param group 0 on meta is approximate: not Adam or AdamW with torch's own step()" in caplog.text
    assert (sgd.path, sgd.exact) == ("own-step", True)  # on the CPU: the same kernel, whatever the class
    with caplog.at_level("WARNING", logger="overlapckpt"):
        (mixed,), _ = ra.group_arithmetics(torch.optim.AdamW, _meta_groups({"params": [torch.zeros(1), torch.zeros(1, device="meta")]}))
    assert not mixed.exact and "its parameters are on ['cpu', 'meta']" in caplog.text


def test_the_default_foreach_flag_resolves_as_torch_resolves_it():
    on_cpu, on_meta = [torch.zeros(1)], [torch.zeros(1, device="meta")]
    assert ra.step_path({"foreach": None}, on_cpu) == FOR_LOOP  # the CPU has no foreach default
    assert ra.step_path({"foreach": None, "fused": True}, on_cpu) == FUSED
    assert ra.step_path({"foreach": True, "differentiable": True}, on_cpu) == FOR_LOOP
    assert ra.step_path({"foreach": True}, on_meta) == FOREACH


def _mixed_optimizer(cls: type) -> tuple[torch.optim.Optimizer, dict[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(5)
    start = torch.randn(64, generator=generator) * torch.logspace(-3, 1, 64)
    grads = [torch.randn(64, generator=generator) * torch.logspace(-4, 0, 64) for _ in range(2)]
    params = {
        "fused32": torch.nn.Parameter(start.clone()),
        "fused64": torch.nn.Parameter(start.double()),
        "fused_no_grad": torch.nn.Parameter(start.clone() * 2),
        "foreach32": torch.nn.Parameter(start.clone() * 3),
        "plain": torch.nn.Parameter(start.clone() * 4),
    }
    optimizer = cls(
        [{"params": [params["fused32"], params["fused64"], params["fused_no_grad"]], "fused": True, "amsgrad": True},
         {"params": [params["foreach32"]], "foreach": True},
         {"params": [params["plain"]], "foreach": False}],
        lr=1e-3, weight_decay=0.01,
    )
    params["fused32"].grad = grads[0].clone()
    params["fused64"].grad = grads[0].double()
    params["foreach32"].grad = grads[1].clone()
    params["plain"].grad = grads[1].clone() * 2
    return optimizer, params


def test_the_writer_steps_each_group_by_its_arithmetic_and_everything_else_with_the_optimizer():
    replayed, params = _mixed_optimizer(torch.optim.AdamW)
    step_like_the_device(replayed, [CUDA_FP32_FMA, CUDA_FOREACH_FP32_FMA, None])
    stock, stock_params = _mixed_optimizer(torch.optim.AdamW)
    stock.step()  # the CPU's kernels throughout
    # The float32 fused parameter: the fused emulation, with its amsgrad state made as torch makes it.
    expected = {name: torch.nn.Parameter(p.detach().clone()) for name, p in _mixed_optimizer(torch.optim.AdamW)[1].items()}
    fused_state = {"step": torch.zeros(()), "exp_avg": torch.zeros(64), "exp_avg_sq": torch.zeros(64), "max_exp_avg_sq": torch.zeros(64)}
    step_like_cuda_fused_adam(
        AdamGroupTensors(
            [expected["fused32"]], [params["fused32"].grad], [fused_state["exp_avg"]], [fused_state["exp_avg_sq"]],
            [fused_state["max_exp_avg_sq"]], [fused_state["step"]],
        ),
        AdamHyperparameters(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False, decoupled_weight_decay=True),
    )
    foreach_state = {"step": torch.zeros(()), "exp_avg": torch.zeros(64), "exp_avg_sq": torch.zeros(64)}
    step_like_cuda_foreach_adam(
        AdamGroupTensors(
            [expected["foreach32"]], [params["foreach32"].grad], [foreach_state["exp_avg"]], [foreach_state["exp_avg_sq"]], None,
            [foreach_state["step"]],
        ),
        AdamHyperparameters(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False, decoupled_weight_decay=True),
    )
    for name, state in (("fused32", fused_state), ("foreach32", foreach_state)):
        assert torch.equal(params[name], expected[name]), name
        assert replayed.state[params[name]].keys() == state.keys()
        for k, v in state.items():
            assert torch.equal(replayed.state[params[name]][k], v), (name, k)
        assert not torch.equal(params[name], stock_params[name]), name  # so the lines above can tell them apart
    # Float64, the for-loop group, and the parameter without a gradient: as the optimizer itself steps them.
    for name in ("fused64", "plain", "fused_no_grad"):
        assert torch.equal(params[name], stock_params[name]), name
        assert replayed.state[params[name]].keys() == stock.state[stock_params[name]].keys(), name
        for k, v in stock.state[stock_params[name]].items():
            assert torch.equal(replayed.state[params[name]][k], v), (name, k)
    assert not replayed.state[params["fused_no_grad"]]


def test_a_subclass_with_its_own_step_is_replayed_by_that_step():
    class CountingAdamW(torch.optim.AdamW):
        steps = 0

        def step(self, closure=None):
            CountingAdamW.steps += 1
            return super().step(closure)

    replayed, params = _mixed_optimizer(CountingAdamW)
    step_like_the_device(replayed, [CUDA_FP32_FMA, CUDA_FOREACH_FP32_FMA, None])
    stock, stock_params = _mixed_optimizer(torch.optim.AdamW)
    stock.step()
    assert CountingAdamW.steps == 1
    for name in params:
        assert torch.equal(params[name], stock_params[name]), name


def test_the_record_round_trips_through_json_and_describes_itself():
    record = GroupArithmetic(1, "cuda:0", FOREACH, CUDA_FOREACH_FP32_FMA, True, "the probe: 12 elements bit for bit")
    assert GroupArithmetic.from_json(record.to_json(), "test") == record
    assert record.describe() == ("param group 1 (foreach on cuda:0): cuda-foreach-fp32-fma, bit for bit "
                                 "(the probe: 12 elements bit for bit)")


def _nudged_powers(device, beta):
    """A device whose powf rounds every beta^k an ulp above the CPU's float32 pow."""
    cpu = torch.full((table_length(beta),), beta, dtype=torch.float32).pow(torch.arange(1, table_length(beta) + 1, dtype=torch.float32))
    return torch.nextafter(cpu, torch.full_like(cpu, 2.0))


@pytest.mark.parametrize("path, device_computes", [(FUSED, CUDA_FP32_FMA), (FOREACH_CAPTURABLE, CUDA_FOREACH_CAPTURABLE_FP32_FMA)])
def test_the_devices_own_powers_make_bias_corrections_exact_and_travel_with_the_log(monkeypatch, path, device_computes):
    """A device whose pow rounds otherwise than the CPU's: its table is computed on it, the probe's emulation takes it
    and matches, and the tables group_arithmetics returns (which the replay log carries) are that device's."""
    device_powers = BetaPowerTables()
    for beta in HYPER["betas"]:
        device_powers.add(beta, _nudged_powers(None, beta))

    def device(configuration, start, grads):
        return ra._state_by_emulation(configuration, start, grads, device_computes, device_powers)

    _stand_in(monkeypatch, device)
    monkeypatch.setattr(ra, "powers_on", _nudged_powers)
    flags = {"fused": True} if path == FUSED else {"foreach": True, "capturable": True}
    groups = _meta_groups({"params": [torch.zeros(3, device="meta")], **flags})
    (got,), powers = ra.group_arithmetics(torch.optim.AdamW, groups)
    assert (got.path, got.arithmetic, got.exact) == (path, device_computes, True)
    assert powers.tables == device_powers.tables
    # Without the device's table the same emulation is not exact: the table is what made it so.
    monkeypatch.setattr(ra, "_measured", {})
    assert ra.measure(_configuration(torch.optim.AdamW, path), None)[1] > 0


def test_the_writer_replays_with_the_powers_the_log_carries():
    """The writer's replay of one logged step takes the device's powers from the log: a log with the nudged table
    replays to the state the emulation computes with it, which is not the CPU pow's."""
    generator = torch.Generator().manual_seed(3)
    start, grads = torch.randn(64, generator=generator), [torch.randn(64, generator=generator) for _ in range(2)]
    live = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.AdamW([live], lr=1e-3, weight_decay=0.01, fused=True)
    live.grad = grads[0]
    optimizer.step()  # the state at the copy: step 1
    names = ["step", "exp_avg", "exp_avg_sq"]
    copied = [live.detach().clone()] + [optimizer.state[live][n].clone() for n in names]
    nudged = BetaPowerTables()
    for beta in (0.9, 0.999):
        nudged.add(beta, _nudged_powers(None, beta))
    entries = [TensorEntry("model.w", ("model", "w"), ROLE_PARAM, "w", torch.float32, (64,), 256)] + [
        TensorEntry(f"optim.w.{n}", ("optim", "w", n), ROLE_OPTIM, "w", t.dtype, tuple(t.shape), t.nbytes) for n, t in zip(names, copied[1:])
    ]
    hyperparameters = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    replayed = {}
    for table in (nudged, None):
        tensors = [t.clone() for t in copied]
        log = ReplayLog(
            optimizer_class=("torch.optim.adamw", "AdamW"), grad_buffer_id=0, base_step=1, group_versions=[1],
            steps=[GradientStep(step=2, groups=[0], hyperparameters=[hyperparameters], grad_none=[])],
            group_arithmetics=[GroupArithmetic(0, "cuda:0", FUSED, CUDA_FP32_FMA, True, "named by the test")],
            beta_powers=table.tables if table is not None else {},
        )
        tables = ReplayTables(grad_offsets={(1, "w"): 0}, grad_nbytes=256, param_group_of={"w": 0}, copy_group_of={"w": 0})
        replay_to_version(entries, tensors, log, tables, grads[1].view(torch.uint8).clone())
        expected = [t.clone() for t in copied]
        step_like_cuda_fused_adam(
            AdamGroupTensors([expected[0]], [grads[1]], [expected[2]], [expected[3]], None, [expected[1]]),
            AdamHyperparameters(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False, decoupled_weight_decay=True),
            powers=table,
        )
        assert all(torch.equal(a, b) for a, b in zip(tensors, expected)), table
        replayed[table is None] = tensors[0]
    assert not torch.equal(replayed[False], replayed[True])
