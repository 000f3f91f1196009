"""Checking the Checkpointer's arguments: each refusal is a ConfigError naming the value and the fix."""

from __future__ import annotations

from typing import Any

import torch

from .errors import ConfigError, UnsupportedOptimizerError
from .format.extra_state import encode
from .format.key_layout import GET_STATE_DICT, KEY_LAYOUTS
from .format.storage import CheckpointStore
from .protocol import EXPORT_FORMATS
from .train.autowindow import AUTO_WINDOW
from .train.gradlog import REPLAYABLE_OPTIMIZERS
from .train.optimizer_group import describe_optimizer, update_rule_class

CONSISTENCY_MODES = ("replay", "stage")


def check_positive_int(name: str, value: Any, meaning: str, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is invalid; pass an integer >= 1 ({meaning})")


def check_stateful(stateful: dict[str, Any]) -> None:
    if not isinstance(stateful, dict):
        raise ConfigError(f"stateful={stateful!r} is invalid; pass a dict mapping names to objects with state_dict()/load_state_dict()")
    for name, obj in stateful.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"stateful key {name!r} is invalid; use a non-empty string name")
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise ConfigError(
                    f"stateful[{name!r}] is a {type(obj).__name__} without {method}(); pass an object that "
                    "implements the Stateful protocol (state_dict() and load_state_dict())"
                )
        encode(obj.state_dict(), f"stateful[{name!r}].state_dict()")


def check_window(window: Any, max_window: Any) -> None:
    if window != AUTO_WINDOW:
        check_positive_int(
            "window", window, "the number of optimizer steps the copy is spread over, or 'auto'", allow_none=False
        )
    check_positive_int("max_window", max_window, "the widest window window='auto' may choose", allow_none=False)


def check_optimizer_for_mode(optimizer: torch.optim.Optimizer, window: int | str, consistency: str) -> None:
    may_replay = window == AUTO_WINDOW or window > 1  # type: ignore[operator]
    if not (may_replay and consistency == "replay"):
        return
    rule = update_rule_class(optimizer)
    if rule is None:
        raise UnsupportedOptimizerError(
            f"{describe_optimizer(optimizer)} cannot be replayed: replay steps one optimizer class over the state, and these "
            "differ. Use window=1, or window>1 or 'auto' with consistency='stage'"
        )
    if rule.__name__ not in REPLAYABLE_OPTIMIZERS:
        raise UnsupportedOptimizerError(
            f"{rule.__module__}.{rule.__qualname__} cannot be replayed: replay needs an "
            "elementwise, per-tensor update rule (SGD, Adam, AdamW, Adagrad, RMSprop, ...). Use window=1, "
            "or window>1 or 'auto' with consistency='stage'"
        )


def check_options(
    *,
    window: Any,
    max_window: Any,
    every: Any,
    keep: Any,
    max_writer_restarts: Any,
    max_inflight: Any,
    consistency: Any,
    stage_budget_bytes: Any,
    store_class: Any,
    collective_timeout_s: Any,
    agreement_timeout_s: Any,
    writer_threads: Any = None,
    key_layout: Any = GET_STATE_DICT,
) -> None:
    """The Checkpointer's plain arguments (the model, optimizer and stateful objects are checked with them)."""
    check_window(window, max_window)
    check_positive_int("every", every, "checkpoint after every N-th optimizer step, or None")
    check_positive_int("keep", keep, "the number of newest committed checkpoints to keep, or None")
    check_positive_int(
        "writer_threads", writer_threads, "the writer process's threads (replay kernels, one shard file each), or None for the default"
    )
    if isinstance(max_writer_restarts, bool) or not isinstance(max_writer_restarts, int) or max_writer_restarts < 0:
        raise ConfigError(
            f"max_writer_restarts={max_writer_restarts!r} is invalid; pass an integer >= 0 (0: a dead writer is raised at once)"
        )
    check_positive_int("max_inflight", max_inflight, "snapshots in flight at once; each costs one state of host memory", allow_none=False)
    if key_layout not in KEY_LAYOUTS:
        raise ConfigError(
            f"key_layout={key_layout!r} is invalid; use {KEY_LAYOUTS[0]!r} (torch's get_state_dict names) or "
            f"{KEY_LAYOUTS[1]!r} (TorchTitan's CheckpointManager names)"
        )
    if consistency not in CONSISTENCY_MODES:
        raise ConfigError(f"consistency={consistency!r} is invalid; use 'replay' or 'stage'")
    if stage_budget_bytes is not None and (isinstance(stage_budget_bytes, bool) or not isinstance(stage_budget_bytes, int) or stage_budget_bytes < 0):
        raise ConfigError(f"stage_budget_bytes={stage_budget_bytes!r} is invalid; pass a byte count >= 0 or None")
    if not (isinstance(store_class, type) and issubclass(store_class, CheckpointStore)):
        raise ConfigError(f"store_class={store_class!r} is invalid; pass CheckpointStore or a subclass of it")
    if store_class.__module__ == "__main__":
        raise ConfigError(
            f"store_class {store_class.__qualname__} is defined in __main__, which the writer process cannot "
            "import; define it in an importable module"
        )

    for name, value in (("collective_timeout_s", collective_timeout_s), ("agreement_timeout_s", agreement_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{name}={value!r} is invalid; pass a number of seconds > 0")


def check_export_formats(formats: Any, path: Any, process_group: Any) -> None:
    """Framework files written next to DCP's: known formats, one process, a local root (the framework reads files)."""
    import os

    import torch.distributed as dist

    if isinstance(formats, str) or not all(f in EXPORT_FORMATS for f in formats):
        raise ConfigError(f"export_formats={formats!r} is invalid; pass a tuple of {EXPORT_FORMATS}, or ()")
    if not formats:
        return
    if "://" in os.fspath(path) and not os.fspath(path).startswith("file://"):
        raise ConfigError(f"export_formats={formats!r} writes files a framework reads from a local directory; {path!r} is not one")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        raise ConfigError(f"export_formats={formats!r} is for one process: a rank's writer holds only its share of the state")
