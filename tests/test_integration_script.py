"""scripts/integration_gpu.py --tiny runs end to end (torch.compile with inductor, and when transformers is
installed the sdpa-vs-tritonattn training comparison) and writes its markdown report. About 65 s on a
2-core CPU under the interpreter."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_integration_script_tiny(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "integration_gpu.py"), "--tiny"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    for section in ("# tritonattn integration check", "## 1. torch.compile (inductor, fullgraph=True) vs eager",
                    "## 2. Convergence: Hugging Face Llama, sdpa vs tritonattn", "## Result"):
        assert section in out
    for entry in ("flash_attn_func", "scaled_dot_product_attention"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {entry} |"))
        assert row.endswith("| PASS |"), row
        assert row.split("|")[5].strip() == "0"  # graph breaks
    if importlib.util.find_spec("transformers") is not None:
        assert "| sdpa |" in out and "| tritonattn |" in out
        assert "Final loss relative difference" in out and "**PASS**" in out
    else:
        assert "skipped: transformers not installed" in out
    assert "\nPASS (0 failure(s)" in out
    assert (tmp_path / "integration.md").read_text().strip() == out.strip()
