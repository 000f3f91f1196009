"""The install users get is the fast one: a wheel built from the repository ships the native helpers' sources.

Before, ``csrc/`` sat beside the package: a ``pip install ./overlapckpt`` held no source, every
helper's ``library_path()`` was None, and a pip user ran the hooks' Python twins, slower
than the README's figures. The wheel is built here without network (``--no-build-isolation``)
and installed into a fresh virtual environment that sees this environment's torch through a
path entry only (not as a site directory, so the editable install of the repository stays
out of it), and run from outside the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

from overlapckpt.train.copying import tensor_passes

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("overlapckpt/csrc/gather_values.c", "overlapckpt/csrc/tensor_passes.cpp", "overlapckpt/csrc/cuda_adam.c")

CHECK = r"""
import json, sys
import overlapckpt
from overlapckpt import cuda_adam_native
from overlapckpt.train.copying import native, tensor_passes
tensor_passes.build()
print(json.dumps({
    "package": overlapckpt.__file__,
    "gather_values": native.gather_library() is not None,
    "cuda_adam": cuda_adam_native.library() is not None,
    "tensor_passes": tensor_passes.passes() is not None,
    "sources": [str(native.SOURCE), str(tensor_passes.SOURCE), str(cuda_adam_native.SOURCE)],
}))
"""


def test_a_wheel_ships_the_native_sources_and_all_three_helpers_load_from_a_fresh_venv(tmp_path):
    # From a copy: a build writes build/ and *.egg-info beside its sources, and the repository is not the test's to change.
    src = tmp_path / "src"
    shutil.copytree(REPO / "overlapckpt", src / "overlapckpt", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        check=True, capture_output=True, timeout=300, cwd=tmp_path,
    )
    (wheel,) = dist.glob("overlapckpt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert all(source in names for source in SOURCES), sorted(n for n in names if "csrc" in n)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # torch (and fsspec, numpy, crc32c) from this environment, as a plain path entry after the venv's own.
    (site / "outer.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")
    cache = tmp_path / "cache"
    # The hooks' extension takes about 20 s to compile against torch's headers: the one make install
    # built from the same source (its name is the source's hash) is reused, and must load from the
    # wheel's path; the two C helpers are built from the wheel's sources here.
    # Only this torch's build: the cache may hold others (another torch, another compiler).
    (cache / "overlapckpt").mkdir(parents=True)
    existing = tensor_passes.library_path()
    record = Path(f"{existing}.sha256")  # a library is loaded only beside its size and SHA-256 (cbuild.py)
    if existing is not None and existing.is_file() and record.is_file():
        (cache / "overlapckpt" / existing.name).write_bytes(existing.read_bytes())
        (cache / "overlapckpt" / record.name).write_bytes(record.read_bytes())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OVERLAPCKPT_NATIVE")}
    env["XDG_CACHE_HOME"] = str(cache)
    done = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["package"].startswith(str(site)), report  # the wheel's package, not the repository's
    assert all(source.startswith(str(site)) for source in report["sources"]), report
    assert report["gather_values"] and report["cuda_adam"] and report["tensor_passes"], report
    assert sorted(p.name.split("-")[0] for p in (cache / "overlapckpt").glob("*.so")) == ["cuda_adam", "gather_values", "tensor_passes"]
