"""No import cycle among the modules of deepinfer/, as counted by the shared tool
(../shared/tools/import_cycles.py beside the clone: module-level, function-level and
TYPE_CHECKING imports alike)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT.parent / "shared" / "tools" / "import_cycles.py"


@pytest.mark.skipif(not TOOL.is_file(), reason=f"the shared import-cycle tool is not at {TOOL} "
                                               "(CI puts a read-only copy of shared/ beside the clone)")
def test_no_import_cycles_in_deepinfer() -> None:
    proc = subprocess.run([sys.executable, str(TOOL), str(ROOT / "deepinfer")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("0 import cycles"), (
        "import cycles in deepinfer/ (move what both sides need to a module below them):\n" + proc.stdout)
