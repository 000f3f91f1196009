"""Objects named by (module, qualified name): how a class crosses the process boundary without pickling code."""

from __future__ import annotations

import importlib
from typing import Any


def import_qualified(module_name: str, qualname: str) -> Any:
    """The object ``qualname`` (dotted, for nested classes) of module ``module_name``."""
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
