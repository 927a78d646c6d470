"""The benchmark scripts run end to end on a tiny random model (CPU), so they do not rot between GPU runs.
Numbers from these runs mean nothing; the real ones come from the H200 (bench/results/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_adapter_throughput_bench_runs(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_adapter_throughput.py"), "--shape", "tiny", "--counts", "1,8",
           "--batch", "4", "--gen", "2", "--prompt-len", "4", "--pool-adapters", "2", "--host-adapters", "2",
           "--distinct-files", "3", "--adapter-dir", str(tmp_path / "adapters"), "--out", str(tmp_path / "out")]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    rows = json.loads((tmp_path / "out" / "adapter_throughput_tiny.json").read_text())
    assert {(r["adapters"], r["popularity"], r["phase"]) for r in rows} == {(n, p, ph) for n in (1, 8) for p in ("zipf", "uniform") for ph in ("cold", "warm")}
    assert all(r["tokens_per_s"] > 0 and r["shape"] == "tiny" for r in rows)
