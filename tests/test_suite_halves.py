"""The suite's split on a machine with a CUDA GPU (tests/conftest.py): one process interprets Triton kernels or
compiles them, so each half skips the other's tests with a reason that says how to run them. A GPU is faked here by
patching ``torch.cuda.is_available`` in a child pytest's conftest, ahead of the project's conftest."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

TESTS = '''
import pytest

def test_cpu_half():
    pass

@pytest.mark.gpu
def test_gpu_half():
    pass
'''


def _run(tmp_path: Path, cuda: bool, interpret: bool | None, *args: str) -> tuple[dict[str, str], str]:
    """Run the two tests above under the project's conftest with CUDA faked present or absent; returns each test's
    outcome ("passed", "skipped" or "not run") and the output."""
    d = tmp_path / f"cuda{cuda}_interp{interpret}"
    d.mkdir()
    patch = f"import torch\ntorch.cuda.is_available = lambda: {cuda}\n"
    (d / "conftest.py").write_text(patch + (HERE / "conftest.py").read_text())
    (d / "test_two.py").write_text(TESTS)
    shutil.copy(HERE.parent / "pyproject.toml", d / "pyproject.toml")  # the gpu marker's registration
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = "1" if interpret else "0"
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", *args, str(d)],
                         cwd=d, env=env, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode in (0, 5), text  # 5: every test deselected
    result = {}
    for name in ("test_cpu_half", "test_gpu_half"):
        m = re.search(rf"test_two.py::{name} (PASSED|SKIPPED)", text)
        result[name] = m.group(1).lower() if m else "not run"
    return result, text


def test_a_cpu_machine_runs_the_cpu_half_and_skips_nothing_else(tmp_path):
    result, text = _run(tmp_path, cuda=False, interpret=None)
    assert result["test_cpu_half"] == "passed", text
    # the toy gpu test has no skipif of its own: on a CPU machine the project's gpu tests carry requires_gpu
    assert result["test_gpu_half"] == "passed", text


def test_a_gpu_machine_skips_the_cpu_half_with_how_to_run_it(tmp_path):
    result, text = _run(tmp_path, cuda=True, interpret=None)
    assert result["test_gpu_half"] == "passed", text
    assert result["test_cpu_half"] == "skipped", text
    assert 'CUDA_VISIBLE_DEVICES= python -m pytest -m "not gpu"' in text


def test_a_gpu_machine_with_the_interpreter_on_skips_the_gpu_half(tmp_path):
    result, text = _run(tmp_path, cuda=True, interpret=True)
    assert result["test_cpu_half"] == "passed", text
    assert result["test_gpu_half"] == "skipped", text
    assert "without TRITON_INTERPRET" in text


@pytest.mark.parametrize("marks, ran", [("gpu", "test_gpu_half"), ("not gpu", None)])
def test_selecting_a_half_on_a_gpu_machine(tmp_path, marks, ran):
    """``-m gpu`` (the device machine's command) runs the gpu test; ``-m "not gpu"`` with CUDA still visible runs
    nothing but says why (scripts/test.sh hides CUDA for that half)."""
    result, text = _run(tmp_path, True, None, "-m", marks)
    if ran:
        assert result[ran] == "passed" and result["test_cpu_half"] == "not run", text
    else:
        assert result["test_cpu_half"] == "skipped" and result["test_gpu_half"] == "not run", text
