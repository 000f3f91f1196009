"""Framework adapters (Lightning, Hugging Face, TorchTitan): thin layers over ``Checkpointer``, each importing its framework lazily."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ..errors import ConfigError

# What each adapter needs, in the order it is tried, and the extra that installs it.
_FRAMEWORKS = {
    "lightning": (("pytorch_lightning", "lightning.pytorch"), "lightning"),
    "hf": (("transformers",), "hf"),
    "titan": (("torchtitan.components.checkpointer",), "titan"),
}


def require(framework: str) -> ModuleType:
    """The framework's module, or an ImportError that names the extra to install."""
    modules, extra = _FRAMEWORKS[framework]
    errors = []
    for name in modules:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError(
        f"overlapckpt's {framework} adapter needs {' or '.join(modules)}, which cannot be imported "
        f"({'; '.join(errors)}); install it with pip install 'overlapckpt[{extra}]'"
    )


@dataclass(frozen=True)
class AdapterSettings:
    """What an adapter passes to the ``Checkpointer`` it builds, checked once at the callback's construction."""

    root: str
    every: int | None
    window: int | str = 1
    consistency: str = "replay"
    keep: int | None = None
    save_on_train_end: bool = True
    options: dict[str, Any] = field(default_factory=dict)  # any other Checkpointer argument

    @classmethod
    def checked(cls, owner: str, root_name: str, root: Any, reserved: tuple[str, ...], **given: Any) -> AdapterSettings:
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise ConfigError(f"{root_name}={root!r} is invalid; pass the checkpoint root, a directory path or a URL")
        options = given.pop("options")
        for name in ("model", "optimizer", "path", "every", "stateful") + reserved:
            if name in options:
                raise ConfigError(f"{owner} sets {name!r} itself; remove it from the options")
        return cls(root=os.fspath(root), options=options, **given)

    def checkpointer_kwargs(self) -> dict[str, Any]:
        return {"window": self.window, "consistency": self.consistency, "every": self.every, "keep": self.keep, **self.options}


def finish(ckpt: Any, save_on_train_end: bool) -> None:
    """At the end of training: checkpoint the final step (answered by one that holds it, if any), wait, close."""
    if save_on_train_end and ckpt.step_count > 0:
        ckpt.request()
        ckpt.step()
    ckpt.close()


def metric_figures(figures: dict[str, Any]) -> dict[str, float]:
    """One commit's figures as a framework's loggers take them: numbers only, under ``overlapckpt/``."""
    return {f"overlapckpt/{k}": float(v) for k, v in figures.items() if isinstance(v, (int, float))}
