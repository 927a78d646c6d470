"""Shared test setup. Kernel tests run the real Triton kernels on the CPU under TRITON_INTERPRET=1,
which must be set before triton is first imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
