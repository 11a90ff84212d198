"""Run a Triton kernel check in a fresh interpreter with TRITON_INTERPRET=1 (CPU).

The variable is read when @triton.jit decorates a kernel, i.e. at import, and other tests
of this process may have imported the kernels already: hence a subprocess.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import importlib, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
    check = getattr(importlib.import_module(sys.argv[2]), sys.argv[3])
    print("cases ok", check("cpu", *map(float, sys.argv[4:])))
""")


def run_interpreted_check(module: str, function: str, *args: float) -> int:
    """Call tests/`module`.`function`("cpu", *args), which returns its count of cases checked,
    under the Triton interpreter; fail with its output unless it ran them all."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO_ROOT), module, function,
                           *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cases ok" in proc.stdout, proc.stdout
    return int(proc.stdout.split("cases ok")[-1].split()[0])
