"""Shared test setup. Kernel tests run the real Triton kernels on the CPU under TRITON_INTERPRET=1,
which must be set before triton is first imported.

One process either interprets Triton kernels (CPU tensors) or compiles them (CUDA tensors), never both. So on a
machine with a CUDA GPU, where the interpreter stays off, the tests not marked ``gpu`` (written for the interpreter,
on CPU tensors) are skipped with a reason that says how to run them; ``scripts/test.sh`` runs both halves, each in
its own process: ``CUDA_VISIBLE_DEVICES= pytest -m "not gpu"`` (what CI runs) and ``pytest -m gpu``."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")


CPU_HALF = ('CPU test (Triton interpreter, CPU tensors) on a machine with a CUDA GPU, where kernels compile for the '
            'GPU; run this half alone: CUDA_VISIBLE_DEVICES= python -m pytest -m "not gpu" (scripts/test.sh runs '
            'both halves)')
GPU_HALF = ("GPU test under TRITON_INTERPRET=1 (kernels would be interpreted, not compiled); run it without "
            "TRITON_INTERPRET: python -m pytest -m gpu")


def pytest_collection_modifyitems(config, items):
    """Skip, with a reason, the half of the suite that cannot run in this process (module docstring)."""
    if not torch.cuda.is_available():
        return  # a CPU machine: gpu tests skip themselves (requires_gpu and the files' own skipif marks)
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    mark = pytest.mark.skip(reason=GPU_HALF if interpreting else CPU_HALF)
    for item in items:
        if (item.get_closest_marker("gpu") is not None) == interpreting:
            item.add_marker(mark)
