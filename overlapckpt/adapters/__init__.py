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
    local_every: int | None = None  # the node-local tier's cadence (Checkpointer's local_every), under the framework's name

    @classmethod
    def checked(cls, owner: str, root_name: str, root: Any, reserved: tuple[str, ...], **given: Any) -> AdapterSettings:
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise ConfigError(f"{root_name}={root!r} is invalid; pass the checkpoint root, a directory path or a URL")
        options = given.pop("options")
        for name in ("model", "optimizer", "path", "every", "stateful", "local_every") + reserved:
            if name in options:
                raise ConfigError(f"{owner} sets {name!r} itself; remove it from the options")
        return cls(root=os.fspath(root), options=options, **given)

    def checkpointer_kwargs(self) -> dict[str, Any]:
        tier = {} if self.local_every is None else {"local_every": self.local_every}
        return {"window": self.window, "consistency": self.consistency, "every": self.every, "keep": self.keep, **tier, **self.options}

    def local_dir(self) -> str | None:
        """The local tier's directory the Checkpointer will use, or None without a local tier."""
        if self.local_every is None:
            return None
        from ..format.tiers import default_local_dir

        given = self.options.get("local_dir")
        return os.fspath(given) if given is not None else default_local_dir(self.root)


def finish(ckpt: Any, save_on_train_end: bool) -> None:
    """At the end of training: checkpoint the final step (answered by one that holds it, if any), wait, close."""
    if save_on_train_end and ckpt.step_count > 0:
        ckpt.request()
        ckpt.step()
    ckpt.close()


# The figures a user reads per commit, for the framework's loggers: which version, how long the loop
# waited for our hooks, and how long until it was durable; with the first commit after a resume, how
# long its restore took. The rest stay in ckpt.stats, restore_figures and the manifest.
LOGGED_FIGURES = ("step", "hook_host_s", "copy_s", "time_to_commit_s", "state_bytes", "restore_s")


def metric_figures(figures: dict[str, Any]) -> dict[str, float]:
    """One commit's figures as a framework's loggers take them: the few a user reads, numbers only, under ``overlapckpt/``."""
    return {f"overlapckpt/{k}": float(figures[k]) for k in LOGGED_FIGURES if isinstance(figures.get(k), (int, float))}


def commit_line(figures: dict[str, Any]) -> str:
    """One line per commit, for the framework's own log at the verbosity of its own checkpoint messages."""
    return (
        f"overlapckpt: checkpoint of step {figures.get('step')} durable at {figures.get('path')} "
        f"({(figures.get('state_bytes') or 0) / 2**20:.1f} MiB; the loop waited {1000 * (figures.get('hook_host_s') or 0):.1f} ms "
        f"for its hooks; {figures.get('time_to_commit_s') or 0:.2f} s from the request)"
    )
