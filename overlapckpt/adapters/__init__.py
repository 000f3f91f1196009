"""Framework adapters (Lightning, Hugging Face, TorchTitan): thin layers over ``Checkpointer``, each importing its framework lazily."""

from __future__ import annotations

import importlib
from types import ModuleType

# What each adapter needs, in the order it is tried, and the extra that installs it.
_FRAMEWORKS = {
    "lightning": (("pytorch_lightning", "lightning.pytorch"), "lightning"),
    "hf": (("transformers",), "hf"),
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
