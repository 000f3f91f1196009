"""Where overlapckpt's work sits inside ``optimizer.step()``: its hooks, and the point right before the update.

``optimizer.step()`` runs, in this order: the global step pre-hooks, the
per-instance pre-hooks, the step function (which calls the closure first, if it
was given one: ``zero_grad``, forward, backward, clipping), then the post-hooks.
Two things must happen *right before the update*:

* the copies started after the previous step are fenced before the update
  mutates what they read (the later, the more of forward and backward they overlap);
* replay logs the gradients exactly as the update consumes them: after the
  closure's backward and any clipping or unscaling before the update.

So:

1. Ours is a *global* pre-hook, moved to the front: it runs before every other
   pre-hook (global pre-hooks run before per-instance ones).
2. It hands the step a closure: the caller's, wrapped, or one of its own when the
   caller gave none. Every ``torch.optim`` optimizer calls its closure before it
   updates anything, and after every pre-hook, so the "before update" work runs
   right after the caller's closure returns (once, however often the step calls it).
3. When another pre-hook runs after ours, it may write state in place before the
   closure (a weight projection, MoE load balancing, lazily created state): the
   fence then runs in our pre-hook, before that hook. The snapshot stays exact;
   with a closure, its copy no longer overlaps forward and backward.
4. An optimizer whose ``step()`` has no ``closure`` parameter gets all the work in
   the pre-hook.
5. An optimizer that takes a closure and never calls it is found at the
   post-hook: the engine is told (its copies may have been torn) and the work
   moves to the pre-hook from then on.

Frameworks with their own "right before the update" callback call
``Checkpointer.before_update()`` (``StepPoint.before_update`` here); it is
idempotent with the above.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ...optimizers import OptimizerGroup, step_owner


def _closure_position(optimizer: Any) -> int | None:
    """The index of ``closure`` in ``step``'s positional arguments (self is 0), or None if it takes none."""
    if isinstance(optimizer, OptimizerGroup):
        return None  # a container steps its optimizers without a closure (TorchTitan's asserts there is none)
    try:
        parameters = list(inspect.signature(type(optimizer).step).parameters.values())
    except (TypeError, ValueError):
        return None
    for index, p in enumerate(parameters):
        if p.name == "closure" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return index if p.kind == p.POSITIONAL_OR_KEYWORD else -1
    return None


class StepPoint:
    """Installs the step hooks and runs ``before_update`` right before each update (see the module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        on_step_start: Callable[[bool], None],
        before_update: Callable[[], None],
        on_step_end: Callable[[bool], None],
    ) -> None:
        self.optimizer = optimizer
        self._owner = step_owner(optimizer)  # whose step() fires the hooks
        self._on_step_start = on_step_start  # argument: fence now (another pre-hook follows ours)
        self._before_update = before_update
        self._on_step_end = on_step_end  # argument: before_update ran inside this step
        self._closure_at = _closure_position(optimizer)
        self._update_point_ran = False
        self._handles: list[RemovableHandle] = []

    @property
    def post_hook_id(self) -> int | None:
        return self._handles[1].id if self._handles else None

    def install(self) -> None:
        if self._handles:
            return
        pre = register_optimizer_step_pre_hook(self._pre_hook)
        # Before every other pre-hook (1); torch keeps its hooks in an OrderedDict.
        cast("OrderedDict[int, object]", _global_optimizer_pre_hooks).move_to_end(pre.id, last=False)
        post = self._owner.register_step_post_hook(self._post_hook)
        self._handles = [pre, post]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def others_follow(self) -> bool:
        """Another pre-hook runs after ours, before the update (3)."""
        return len(_global_optimizer_pre_hooks) > 1 or bool(self._owner._optimizer_step_pre_hooks)

    def other_pre_hook_names(self) -> list[str]:
        ours = self._handles[0].id if self._handles else None
        hooks = [h for k, h in _global_optimizer_pre_hooks.items() if k != ours]
        hooks += list(self._owner._optimizer_step_pre_hooks.values())
        return [getattr(h, "__qualname__", type(h).__qualname__) for h in hooks]

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if optimizer is not self._owner:
            return None  # a global hook sees every optimizer's step
        self._update_point_ran = False
        self._on_step_start(self.others_follow())
        if self._closure_at is None:
            self._run_update_point()  # (4)
            return None
        return self._with_wrapped_closure(args, kwargs)

    def _with_wrapped_closure(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        position = -1 if self._closure_at is None else self._closure_at
        if 0 < position < len(args):
            caller_closure = args[position]
        else:
            caller_closure = kwargs.get("closure")

        def closure_then_update_point() -> Any:
            loss = caller_closure() if caller_closure is not None else None
            if not self._update_point_ran:  # (2): LBFGS calls the closure again after updating
                self._run_update_point()
            return loss

        if 0 < position < len(args):
            return (*args[:position], closure_then_update_point, *args[position + 1 :]), kwargs
        return args, {**kwargs, "closure": closure_then_update_point}

    def _run_update_point(self) -> None:
        self._update_point_ran = True
        self._before_update()

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ran = self._update_point_ran
        if not ran and self._closure_at is not None:
            self._closure_at = None  # (5): this step never called its closure; use the pre-hook from now on
        self._on_step_end(ran)
