"""The per-tensor passes of a snapshot's hooks: native where built (``csrc/tensor_passes.cpp``), else their Python twins.

Three passes run over every tracked tensor inside ``optimizer.step()``: the staleness
check at a snapshot's start (``live_identity.py``: identities, dict lengths, data
pointers), the host scalars' address check before they are gathered (``host_values.py``),
and each replay window step's gradient reads (``gradlog.py``). The twins are passes in C
already (``map``, ``itertools.chain``, ``operator.is_``), but each still costs a Python
call per tensor: about 4 ms at a snapshot's start and 3 ms per replay window step at
30,000 state tensors on a 2-core VM (benchmarks/hook_scaling.py). The extension makes each
one loop over the same objects.

Built ahead, never in a training step: compiling against torch's headers takes about 20 s.
``make install`` and ``overlapckpt build-native`` build it (``build()``); at run time
``passes()`` loads the built library if there is one for this source, this torch and this
Python. Where there is none (a ``pip install`` that nobody built for), the first
``passes()`` starts the build on a thread of its own (the compiler is a subprocess, so it
holds no GIL): the twins run meanwhile, with the same answers (tests/test_tensor_passes.py
holds both roads to them), and the hooks take up the extension once it is loaded, and every
later process at once. ``OVERLAPCKPT_NATIVE=0`` turns it off, as it turns off ``native.py``'s
helper.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import itertools
import logging
import operator
import os
import shutil
import sys
import sysconfig
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ...cbuild import compile_into, compiler_identity, reuse_or_remove, usable_cache_dir, verified_library_or_missing

log = logging.getLogger("overlapckpt")

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "tensor_passes.cpp"
MODULE_NAME = "overlapckpt_tensor_passes"  # its PyInit_ name
FLAGS = ["-O2", "-shared", "-fPIC", "-std=c++20"]
_chain = itertools.chain.from_iterable
_grad_of = operator.attrgetter("grad")
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}  # by torch version
_background_builds: dict[str, threading.Thread] = {}  # by torch version: the build passes() started, if any
_NOT_LOOKED_UP = object()


def library_path() -> Path | None:
    """Where the built extension for this source, torch and Python lives (None without the source: an installed wheel)."""
    tools = toolchain()
    if not SOURCE.is_file() or tools is None:
        return None
    cache = usable_cache_dir()
    if cache is None:
        return None
    key = hashlib.sha256(SOURCE.read_bytes())
    # Built against this torch's headers and libraries, for this interpreter's ABI, by this
    # compiler with these flags: any other gets its own file, and never loads one built otherwise.
    key.update(f"{torch.__version__}|{sys.implementation.cache_tag}|{sysconfig.get_config_var('SOABI')}".encode())
    key.update(f"{compiler_identity(tools[0])}|{' '.join(FLAGS)}".encode())
    return cache / f"tensor_passes-{key.hexdigest()[:16]}.so"


def toolchain() -> tuple[str, str] | None:
    """The C++ compiler (``$CXX``, else ``c++`` or ``g++``) and Python's header directory that ``build()`` uses, or None without them."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    python_headers = sysconfig.get_paths()["include"]
    if compiler is None or not os.path.isfile(os.path.join(python_headers, "Python.h")):
        return None
    return compiler, python_headers


def build(quiet: bool = True, target: Path | None = None) -> Path | None:
    """Compile the extension if it is not built yet (about 20 s); its path, or None where it cannot be built.

    ``target`` is the path to build (``library_path()`` by default): a background build
    builds the very path ``passes()`` looked up and found missing.
    """
    target = target or library_path()
    tools = toolchain()
    if tools is None:
        log.info("no C++ compiler or Python headers here: the hooks' passes run as their Python twins (%s)", SOURCE)
        return None
    if target is None:
        return None
    if reuse_or_remove(target):
        return target
    compiler, python_headers = tools
    from torch.utils.cpp_extension import include_paths, library_paths

    torch_lib = library_paths()[0]
    flags = [
        compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-isystem{p}" for p in [*include_paths(), python_headers]),
    ]
    libraries = [str(SOURCE), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
    if not compile_into(target, flags, libraries, SOURCE):
        return None
    if not quiet:
        log.info("built %s", target)
    return target


def passes() -> ModuleType | None:
    """The loaded extension, or None: disabled, or not built for this source, torch and Python (it is never built here).

    Called at every pass inside the hooks: after the first call it is a dict lookup (the
    source is hashed once per torch version, not per call).
    """
    if os.environ.get("OVERLAPCKPT_NATIVE", "1") == "0":
        return None
    key = torch.__version__
    loaded = _loaded.get(key, _NOT_LOOKED_UP)
    if loaded is not _NOT_LOOKED_UP:
        return loaded  # type: ignore[return-value]
    with _lock:
        if key not in _loaded:
            path = library_path()
            _loaded[key] = _load(path)
            if _loaded[key] is None and path is not None and not path.is_file() and toolchain() is not None:
                _build_in_background(key, path)
        return _loaded[key]


def _build_in_background(key: str, target: Path) -> None:
    """Build ``target`` on a thread (the compiler is a subprocess) and publish it to ``passes()`` once loaded."""

    def build_and_load() -> None:
        built = build(target=target)
        module = _load(built) if built is not None else None
        if module is not None:
            with _lock:
                _loaded[key] = module
            log.info("the hooks' native passes are built (%s) and in use from now on", built)

    log.info("building the hooks' native passes once, in the background (about 20 s; `overlapckpt build-native` builds "
             "them ahead): their Python twins run meanwhile")
    thread = threading.Thread(target=build_and_load, name="overlapckpt-build-native", daemon=True)
    _background_builds[key] = thread
    thread.start()


def _load(path: Path | None) -> ModuleType | None:
    if path is None or not path.is_file():
        log.info("the hooks' passes run as their Python twins: no extension built for this source and torch %s "
                 "(make install, or overlapckpt build-native, builds it)", torch.__version__)
        return None
    refusal = verified_library_or_missing(path)
    if refusal is not None:  # truncated, replaced or planted: never dlopen'ed (a truncated one dies of SIGBUS)
        log.warning("%s: not loaded; the hooks' passes run as their Python twins (`overlapckpt build-native` builds it again)", refusal)
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
        spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except (ImportError, OSError) as e:
        log.warning("loading %s failed (%s); the hooks' passes run as their Python twins", path, e)
        return None


# The twins: the same answers, from passes in C over Python calls.


def same_items_python(items: Sequence[Any], expected: Sequence[Any]) -> bool:
    return len(items) == len(expected) and all(map(operator.is_, items, expected))


def same_dict_contents_python(dicts: list[dict[Any, Any]], lengths: list[int], values: list[Any]) -> bool:
    # Equal lengths give equal counts (values were captured with lengths): one pass, no list.
    return list(map(len, dicts)) == lengths and sum(lengths) == len(values) and all(map(operator.is_, _chain(map(dict.values, dicts)), values))


def grads_of_python(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return list(map(_grad_of, params))


def same_items(items: list[Any], expected: list[Any]) -> bool:
    """Whether ``items`` holds the very objects of ``expected``, in order (by identity: no ``__eq__`` runs)."""
    native = passes()
    return native.same_items(items, expected) if native is not None else same_items_python(items, expected)


def same_dict_contents(dicts: list[dict[Any, Any]], lengths: list[int], values: list[Any]) -> bool:
    """Whether each dict has its captured length and their values, chained in order, are the very objects of ``values``."""
    native = passes()
    return native.same_dict_contents(dicts, lengths, values) if native is not None else same_dict_contents_python(dicts, lengths, values)


def grads_of(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each parameter's ``.grad``, None where it has none."""
    native = passes()
    return native.grads_of(params) if native is not None else grads_of_python(params)


class DataPointers:
    """The data pointers of some tensors when captured, to check that none has moved (``.data`` reassigned)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.values = list(map(torch.Tensor.data_ptr, tensors))
        self.array = torch.tensor(self.values, dtype=torch.int64)

    def unchanged(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors``' data pointers are, in order, the captured ones."""
        native = passes()
        if native is not None:
            return bool(native.data_ptrs_equal(tensors, self.array))
        return self.unchanged_python(tensors)

    def unchanged_python(self, tensors: list[torch.Tensor]) -> bool:
        return list(map(torch.Tensor.data_ptr, tensors)) == self.values
