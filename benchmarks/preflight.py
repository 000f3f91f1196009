"""The GPU run's pre-flight, in seconds: what would stop everything after it, found before it starts.

    PYTHONPATH=. python3 benchmarks/preflight.py [--emulate]

Checks, in order, and stops at the first that fails, printing what is wrong and how to fix it:

1. torch imports (``python3 -I``, as the writer process imports it: no cwd, no PYTHONPATH);
2. a CUDA device is visible (skipped with ``--emulate``, which rehearses on the CPU);
3. a writer process starts from this source checkout and commits one checkpoint of a
   tiny model (on the device), with nothing installed: the writer finds the package
   only through the directory the trainer imported it from;
4. this torch's DCP writes small tensors through overlapckpt's templates
   (``format/tensor_blob.py``), and every blob equals this torch's own ``torch.save``.
   Where DCP's module does not route through them, it says so and goes on (``torch.save``
   writes every blob); a blob that differs stops the run.

Exits 0 when all pass, 1 otherwise. /dev/shm is checked by gpu.sh, only where needed.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))


def _fail(what: str, fix: str) -> int:
    print(f"preflight: FAILED: {what}; {fix}", flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--emulate", action="store_true", help="rehearse on the CPU: no CUDA check, the emulated device")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    isolated = subprocess.run([sys.executable, "-I", "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    if isolated.returncode != 0:
        return _fail(f"'{sys.executable} -I -c \"import torch\"' failed: {isolated.stderr.strip()[-500:]}",
                     "install torch for this interpreter; the writer process imports it in isolated mode")
    print(f"preflight: torch {isolated.stdout.strip()} imports in isolated mode", flush=True)

    import torch

    if not args.emulate:
        if not torch.cuda.is_available():
            return _fail("no CUDA device is visible (torch.cuda.is_available() is False)",
                         "check CUDA_VISIBLE_DEVICES and the driver, or pass --emulate to rehearse on the CPU")
        print(f"preflight: CUDA device {torch.cuda.get_device_name()} (torch CUDA {torch.version.cuda})", flush=True)

    from overlapckpt.seams import Checkpointer
    from overlapckpt.train.copying.emulated_device import EmulatedDevice
    from overlapckpt.train.copying.stream_copier import StreamCopier

    device = torch.device("cpu" if args.emulate else "cuda")
    model = torch.nn.Linear(64, 64).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64, device=device)).sum().backward()
    opt.step()
    copier = StreamCopier(EmulatedDevice()) if args.emulate else None
    try:
        with tempfile.TemporaryDirectory() as root, Checkpointer(model, opt, root, copier=copier) as ckpt:
            ckpt.request()
            (info,) = ckpt.wait(timeout_s=120)
            if not os.path.exists(os.path.join(info.path, ".metadata")):
                return _fail(f"the writer answered committed but {info.path}/.metadata is missing", "this is a bug in overlapckpt")
    except Exception as e:  # any failure here stops the run: say what it was
        return _fail(f"a writer did not start and commit: {type(e).__name__}: {e}",
                     "run from the repository root with PYTHONPATH=. and read the writer's stderr above")
    print(f"preflight: a writer started from {os.path.dirname(_HERE)} and committed a checkpoint", flush=True)
    failure = _templates_check()
    if failure is not None:
        return failure
    print(f"preflight: all checks passed in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


def _templates_check() -> int | None:
    """Small tensors saved by DCP as the writer saves them (zip CRCs off, templates installed), each blob against torch.save."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem

    from overlapckpt.format import tensor_blob
    from overlapckpt.format.storage import CheckpointStore

    crc_before = torch.serialization.get_crc32_options()
    module_torch = filesystem.torch
    torch.serialization.set_crc32_options(False)
    try:
        if not tensor_blob.install():
            print("preflight: this torch's DCP does not call torch.save through a module global: every blob by torch.save", flush=True)
            return None
        g = torch.Generator().manual_seed(0)
        state = {f"t{i}": torch.randn(3, 5, generator=g) if i % 2 else torch.randn(7, generator=g).to(torch.bfloat16) for i in range(12)}
        with tempfile.TemporaryDirectory() as root:
            writer = CheckpointStore(root).make_writer("templates", before_commit=lambda *args: None)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
                dcp.save(state, storage_writer=writer, no_dist=True)
            metadata = dcp.FileSystemReader(os.path.join(root, "templates")).read_metadata()
            templated = sum(1 for t in tensor_blob._templates._templates.values() if t is not None and t.verified >= tensor_blob.VERIFY_SAMPLES)
            for index, where in metadata.storage_data.items():
                with open(os.path.join(root, "templates", where.relative_path), "rb") as f:
                    f.seek(where.offset)
                    blob = f.read(where.length)
                expected = io.BytesIO()
                torch.save(state[index.fqn], expected)
                if blob != expected.getvalue():
                    return _fail(f"the blob of {index.fqn} written through the tensor templates differs from torch.save's",
                                 "run with OVERLAPCKPT_TENSOR_TEMPLATES=0 and report it: this is a bug in overlapckpt")
    finally:
        torch.serialization.set_crc32_options(crc_before)
        filesystem.torch = module_torch
    print(f"preflight: 12 small tensors saved by DCP equal torch.save's bytes, {templated} of 2 keys from templates", flush=True)
    return None


if __name__ == "__main__":
    sys.exit(main())
