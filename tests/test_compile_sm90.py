"""Every kernel variant compiles for Hopper (sm_90) with the table's configs, checked without a GPU.

Runs scripts/compile_check.py in a subprocess (it swaps Triton's driver for an sm_90 target and
compiles instead of launching); catches kernels that the interpreter runs but the GPU compiler
rejects, and configs over the shared-memory limit.
"""

import os
import subprocess
import sys

import pytest
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton's bundled ptxas is missing")
def test_every_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = os.path.join(ROOT, ".triton-cache-sm90")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_check.py")], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 failure(s)" in proc.stdout
