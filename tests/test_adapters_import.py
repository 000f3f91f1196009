"""The core never imports a framework; an adapter whose framework is missing names the extra to install."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_core_imports_no_framework():
    done = _run(
        "import sys, overlapckpt, overlapckpt.cli, overlapckpt.restore\n"
        "loaded = [m for m in ('pytorch_lightning', 'lightning', 'transformers', 'accelerate', 'torchtitan') if m in sys.modules]\n"
        "print(loaded)"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_missing_framework_names_the_extra():
    # A None entry in sys.modules makes that import fail, as if the package were not installed.
    done = _run(
        "import sys\n"
        "sys.modules['pytorch_lightning'] = None\nsys.modules['lightning'] = None\nsys.modules['lightning.pytorch'] = None\n"
        "try:\n    import overlapckpt.lightning\nexcept ImportError as e:\n    print(type(e).__name__, e)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'overlapckpt[lightning]'" in done.stdout, done.stdout
    assert "pytorch_lightning or lightning.pytorch" in done.stdout


def test_a_missing_torchtitan_names_the_extra():
    done = _run(
        "import sys\nsys.modules['torchtitan'] = None\n"
        "try:\n    import overlapckpt.titan\nexcept ImportError as e:\n    print(type(e).__name__, e)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'overlapckpt[titan]'" in done.stdout, done.stdout
    assert "torchtitan.components.checkpointer, which cannot be imported" in done.stdout
