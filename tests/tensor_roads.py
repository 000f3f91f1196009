"""Run a test on both roads: the native extension of ``tensor_passes`` and its Python twins, and the C pass of
replay's CUDA arithmetic (``cuda_adam_native``) and its torch twin."""

from __future__ import annotations

import shutil

import pytest

from overlapckpt import cuda_adam_native
from overlapckpt.train.copying import tensor_passes

ROADS = ["native", "python"]


def can_build() -> bool:
    """A C++ compiler and Python's headers are here, as ``build()`` looks for them: ``make install`` built the extension."""
    return tensor_passes.toolchain() is not None


def take_road(road: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if road == "python":
        monkeypatch.setattr(tensor_passes, "passes", lambda: None)
    elif not can_build():
        pytest.skip("no C++ compiler or Python headers here: the extension cannot be built")
    else:
        assert tensor_passes.build() is not None and tensor_passes.passes() is not None, (
            "a C++ compiler and Python's headers are on this machine, yet the extension did not build or load"
        )


def take_cuda_adam_road(road: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The C loop (csrc/cuda_adam.c) or its torch twin; where a C compiler exists the C loop must load: no silent twin."""
    if road == "python":
        monkeypatch.setenv("OVERLAPCKPT_NATIVE", "0")
    elif shutil.which("cc") or shutil.which("gcc"):
        assert cuda_adam_native.library() is not None
    else:
        pytest.skip("no C compiler: the native road is not built here")
    return road
