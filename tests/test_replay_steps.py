"""Replay's steps of one tensor in one blocked pass (``cuda_adam_native.steps_deferred``, ``csrc/cuda_adam.c``'s ``_steps``).

Inside ``steps_deferred`` the C pass queues each tensor's updates and runs them when the block
ends, each block of elements carried through every step while it is in cache. Every element
meets the same operations in the same order, so the result must equal one call per step bit
for bit: fused and foreach, with and without amsgrad, maximize and weight decay of either kind,
a learning rate that changes per step, tensors that are not a multiple of the block, and
tensors split across the writer's threads.
"""

from __future__ import annotations

import pytest
import torch

from overlapckpt import cuda_adam_native
from overlapckpt.adam_step_arguments import AdamGroupTensors, AdamHyperparameters
from overlapckpt.foreach_adam_math import step_like_cuda_foreach_adam
from overlapckpt.format.entries import ROLE_OPTIM, ROLE_PARAM, TensorEntry
from overlapckpt.format.manifest_records import GroupArithmetic
from overlapckpt.fused_adam_math import step_like_cuda_fused_adam
from overlapckpt.protocol import GradientStep, ReplayLog, ReplayTables
from overlapckpt.writer.replay import replay_to_version

pytestmark = pytest.mark.skipif(cuda_adam_native.library() is None, reason="the native helper cannot be built here (no C compiler)")

STEP_LIKE = {"fused": step_like_cuda_fused_adam, "foreach": step_like_cuda_foreach_adam}


def _state(sizes: list[int], amsgrad: bool, seed: int) -> list[list[torch.Tensor]]:
    """Per tensor: param, exp_avg, exp_avg_sq, max_exp_avg_sq (or None), step count."""
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(n, generator=generator), torch.randn(n, generator=generator) * 1e-3, torch.rand(n, generator=generator) * 1e-6,
         torch.rand(n, generator=generator) * 1e-6 if amsgrad else None, torch.tensor(3.0)]
        for n in sizes
    ]


def _step(kind: str, state: list[list[torch.Tensor]], grads: list[torch.Tensor], lr: float, weight_decay: float, decoupled: bool,
          maximize: bool) -> None:
    amsgrad = state[0][3] is not None
    STEP_LIKE[kind](
        AdamGroupTensors(
            params=[s[0] for s in state], grads=grads, exp_avgs=[s[1] for s in state], exp_avg_sqs=[s[2] for s in state],
            max_exp_avg_sqs=[s[3] for s in state] if amsgrad else None, state_steps=[s[4] for s in state],  # type: ignore[misc]
        ),
        AdamHyperparameters(lr=lr, beta1=0.9, beta2=0.999, weight_decay=weight_decay, eps=1e-8, maximize=maximize,
                            decoupled_weight_decay=decoupled),
    )


def _bits(state: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t.view(torch.int32) for s in state for t in s if t is not None]


@pytest.mark.parametrize("kind", ["fused", "foreach"])
@pytest.mark.parametrize(("amsgrad", "maximize", "weight_decay", "decoupled"), [
    (False, False, 0.01, True), (True, False, 0.01, True), (False, True, 0.0, True), (True, True, 0.05, False),
])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_tensors_steps_in_one_blocked_pass_give_the_bits_of_one_call_a_step(monkeypatch, kind, amsgrad, maximize, weight_decay,
                                                                              decoupled, threads):
    monkeypatch.setattr(cuda_adam_native, "PARALLEL_MIN_ELEMENTS", 1000)
    monkeypatch.setattr(cuda_adam_native, "_threads", lambda: threads)
    sizes = [5_003, 10_007, 1]  # blocks of 2,048 elements: a short last block; three threads' chunks of 3,392; one element
    generator = torch.Generator().manual_seed(5)
    steps = [([torch.randn(n, generator=generator) * 10.0 ** -(k % 4) for n in sizes], 1e-3 * (0.9 ** k)) for k in range(8)]
    one_call_a_step, deferred = _state(sizes, amsgrad, 1), _state(sizes, amsgrad, 1)
    for grads, lr in steps:
        _step(kind, one_call_a_step, grads, lr, weight_decay, decoupled, maximize)
    with cuda_adam_native.steps_deferred():
        for grads, lr in steps:
            _step(kind, deferred, grads, lr, weight_decay, decoupled, maximize)
        untouched = _state(sizes, amsgrad, 1)
        for held, start in zip(deferred, untouched):  # queued: param and moments not yet stepped (the step counts are)
            assert all(torch.equal(a, b) for a, b in zip(held[:3], start[:3])) and held[4] == start[4] + len(steps)
    assert all(torch.equal(a, b) for a, b in zip(_bits(one_call_a_step), _bits(deferred)))
    assert not torch.equal(deferred[1][0], _state(sizes, amsgrad, 1)[1][0])  # the steps ran


def test_a_block_that_raises_drops_its_queued_steps_and_leaves_the_tensors_as_they_were():
    state = _state([4_099], amsgrad=False, seed=2)
    before = [t.clone() for t in state[0] if t is not None]
    with pytest.raises(RuntimeError, match="the replay failed"), cuda_adam_native.steps_deferred():
        _step("fused", state, [torch.ones(4_099)], 1e-3, 0.01, True, False)
        raise RuntimeError("the replay failed")
    assert torch.equal(state[0][0], before[0]) and torch.equal(state[0][1], before[1]) and torch.equal(state[0][2], before[2])
    _step("fused", state, [torch.ones(4_099)], 1e-3, 0.01, True, False)  # outside the block: at once
    assert not torch.equal(state[0][0], before[0])


@pytest.mark.parametrize(("path", "arithmetic"), [("fused", "cuda-fp32-fma"), ("foreach", "cuda-foreach-fp32-fma")])
def test_the_writers_replay_of_four_logged_steps_equals_the_emulation_one_step_at_a_time(path, arithmetic):
    """``replay_to_version`` steps a copy group through four logged steps inside ``steps_deferred``: two parameters
    (one has no gradient at the third step, so it is not stepped there) end bit for bit where the emulation, one
    call a step, takes them."""
    sizes = {"a": 6_000, "b": 300}
    generator = torch.Generator().manual_seed(9)
    names = ["step", "exp_avg", "exp_avg_sq"]
    copied = {f: [torch.randn(n, generator=generator), torch.tensor(1.0), torch.randn(n, generator=generator) * 1e-3,
                  torch.rand(n, generator=generator) * 1e-6] for f, n in sizes.items()}
    grads = {(s, f): torch.randn(n, generator=generator) for s in range(4) for f, n in sizes.items()}
    grad_none = {(2, "b")}
    hyperparameters = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, "maximize": False,
                       "foreach": path == "foreach", "fused": path == "fused", "capturable": False, "differentiable": False}
    entries, tensors, offsets, layout = [], [], {}, []
    for f, held in copied.items():
        entries.append(TensorEntry(f"model.{f}", ("model", f), ROLE_PARAM, f, torch.float32, tuple(held[0].shape), held[0].nbytes))
        entries += [TensorEntry(f"optim.{f}.{n}", ("optim", f, n), ROLE_OPTIM, f, t.dtype, tuple(t.shape), t.nbytes)
                    for n, t in zip(names, held[1:])]
        tensors += [t.clone() for t in held]
    for s in range(4):
        for f in sizes:
            if (s, f) not in grad_none:
                offsets[(s, f)] = sum(g.nbytes for g in layout)
                layout.append(grads[(s, f)])
    log = ReplayLog(
        optimizer_class=("torch.optim.adamw", "AdamW"), grad_buffer_id=0, base_step=1, group_versions=[1],
        steps=[GradientStep(step=2 + s, groups=[0], hyperparameters=[hyperparameters],
                            grad_none=[f for f in sizes if (s, f) in grad_none]) for s in range(4)],
        group_arithmetics=[GroupArithmetic(0, "cuda:0", path, arithmetic, True, "named by the test")],
        beta_powers={},
    )
    tables = ReplayTables(grad_offsets={(1 + s, f): o for (s, f), o in offsets.items()}, grad_nbytes=sum(g.nbytes for g in layout),
                          param_group_of=dict.fromkeys(sizes, 0), copy_group_of=dict.fromkeys(sizes, 0))
    replay_to_version(entries, tensors, log, tables, torch.cat(layout).view(torch.uint8).clone())

    for k, (f, held) in enumerate(copied.items()):
        expected = [t.clone() for t in held]  # param, step, exp_avg, exp_avg_sq
        for s in range(4):
            if (s, f) in grad_none:
                continue
            STEP_LIKE[path](
                AdamGroupTensors([expected[0]], [grads[(s, f)]], [expected[2]], [expected[3]], None, [expected[1]]),
                AdamHyperparameters(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False, decoupled_weight_decay=True),
            )
        replayed = tensors[4 * k: 4 * k + 4]
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(replayed, expected)), f
        assert not torch.equal(replayed[0], held[0]), f  # the replay moved it
    assert tensors[1] == 5.0 and tensors[5] == 4.0  # four steps for a, three for b
