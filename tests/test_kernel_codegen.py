"""What the SGMV kernels compile to for an H100/H200 (sm_90), checked on any machine (``bench/kernel_ptx.py``).

At Llama shapes every offset and width is a multiple of 16 elements (``LoRASlices.align == 16``), so the A / B^T
rows and the y tile must move in 16-byte vectors: not one 2-byte (``b16``) global load or store of bf16 data.
Without the declared alignment they do (the ALIGN=1 rows: the check can fail), which cost 1.5-2.9x on an H200.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ops():
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_ptx.py"), "--json"], capture_output=True,
                       text=True, timeout=600, env=env)
    if p.returncode != 0 and "ptxas" in p.stderr:
        pytest.skip(f"no ptxas for sm_90 here: {p.stderr[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _scalar_halves(counts: dict[str, int]) -> int:
    return sum(n for op, n in counts.items() if op.endswith(".b16") and op.startswith(("ld.global", "st.global")))


def test_expand_moves_b_rows_and_y_in_vectors(ops):
    assert _scalar_halves(ops["expand/align16"]) == 0, ops["expand/align16"]
    assert any(op.startswith("st.global.v4") for op in ops["expand/align16"]), ops["expand/align16"]
    assert _scalar_halves(ops["expand/align1"]) > 0  # the check sees the failure it guards against


def test_written_expand_stores_in_vectors(ops):
    """``lora_delta``'s expand (``OVERWRITE``): the term's stores and the zero rows of slot -1 in vectors too."""
    assert _scalar_halves(ops["expand_write/align16"]) == 0, ops["expand_write/align16"]
    assert any(op.startswith("st.global.v4") for op in ops["expand_write/align16"]), ops["expand_write/align16"]
    assert _scalar_halves(ops["expand_write/align1"]) > 0


def test_shrink_reads_a_rows_without_scalar_loads(ops):
    assert _scalar_halves(ops["shrink/align16"]) == 0, ops["shrink/align16"]
    assert _scalar_halves(ops["shrink/align1"]) > 0
