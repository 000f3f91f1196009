"""examples/demo.py: it deletes its root before it starts, so it refuses a --path that holds anything but checkpoints.

Before: ``demo.py --path X`` removed X, whatever X held, without a word.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def test_a_path_holding_other_files_is_refused_and_kept(tmp_path):
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "step-000000001").mkdir()
    done = subprocess.run([sys.executable, str(DEMO), "--path", str(tmp_path), "--steps", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"--path {str(tmp_path)!r} holds notes.txt, which are not checkpoints" in done.stderr
    assert (tmp_path / "notes.txt").read_text() == "my notes" and (tmp_path / "step-000000001").is_dir()


def test_an_earlier_demos_checkpoints_are_cleared(tmp_path):
    sys.path.insert(0, str(DEMO.parent))
    try:
        from demo import clear_previous_demo
    finally:
        sys.path.remove(str(DEMO.parent))
    root = tmp_path / "demo-checkpoints"
    (root / "step-000000050").mkdir(parents=True)
    (root / "latest").write_text("step-000000050")
    (root / ".overlapckpt-lease").write_text("{}")
    clear_previous_demo(str(root))
    assert not root.exists()
