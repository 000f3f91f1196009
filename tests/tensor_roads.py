"""Run a test on both roads of ``tensor_passes``: the native extension and its Python twins."""

from __future__ import annotations

import pytest

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
