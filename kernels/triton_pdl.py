"""Programmatic dependent launch (PDL) for the Triton kernels of a step, on GPUs of compute capability 9.0+.

A kernel launched with PDL (``launch_pdl=True``) may start while the kernel before it on the stream is still
running: its programs are placed on free SMs as soon as every program of the kernel before has let it
(``griddepcontrol.launch_dependents``) or exited, instead of after that kernel has completed and the launch
latency has passed. Each program must then wait (``griddepcontrol.wait``, :func:`pdl_wait`) before it reads
anything another kernel of the step writes and before it writes anything: the wait returns when every kernel it
depends on has completed and its writes are visible. Reads of what no kernel writes (weights, norm weights, the
LoRA plan) may come before the wait.

The rule every PDL kernel of multilora keeps: wait first, then trigger (``pdl_wait`` does both, in that order).
A program thus lets the next kernel launch only once everything before it on the stream has completed, so a
kernel launched early after it sees all of that too, whichever kernels in the chain used PDL. CUDA graphs
captured from such launches keep programmatic edges (tested against plain launches, bit for bit, on an H200:
``tests/test_kernels.py::test_pdl_launches_equal_plain_launches``,
``tests/test_engine_gpu.py::test_step_kernels_with_pdl_equal_plain_launches``,
``tests/test_fp8_gpu.py::test_fp8_gemms_with_pdl_equal_plain_launches`` and
``::test_engine_fp8_with_pdl_equals_plain_launches``).

``ENABLED`` switches PDL for the step's kernels: RMSNorm (+ residual), RoPE + KV write, SiLU/GELU * up, the
paged attention and its split combine, the fp8 GEMVs and the per-token quantization. The LoRA shrink and expand
have their own switch and rule (``triton_sgmv.PDL``, ``_use_pdl``). Source: PTX ISA, ``griddepcontrol``; CUDA
Programming Guide, "Programmatic Dependent Launch and Synchronization".
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

#: Launch the step's Triton kernels (module docstring) with PDL where the device has it. False: plain launches
#: (what ran before session 21). The ``bench_generate.py`` providers ``multilora-plain`` / ``multilora-fp8-plain``
#: set it (and ``triton_sgmv.PDL``) False for the A/B. H200, Llama-3-8B shape, the engine's median full-batch decode
#: step, median of 3 rounds, PDL vs plain (bench/results/session21/call2): bf16 batch 1 5.08 vs 5.19 ms, batch 64
#: 7.44 vs 7.49; with 64 rank-16 adapters batch 1 5.18 vs 5.28, batch 64 9.25 vs 9.58; fp8 weights batch 1 3.45 vs
#: 3.76 (a GEMV follows each norm and SiLU * up there: all Triton), batch 64 5.76 vs 5.90.
ENABLED = True


@triton.jit
def pdl_wait(TRIGGER: tl.constexpr):
    """Wait until the kernels this one depends on have completed and their writes are visible
    (``griddepcontrol.wait``; returns at once when the kernel was not launched with PDL), then let the next kernel
    launch (``griddepcontrol.launch_dependents``) unless ``TRIGGER`` is False (then it launches as each program
    exits). Every program of a PDL kernel calls it, programs with nothing to do included, before its first read
    of another kernel's output and its first write."""
    tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def capability(index: int | None) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (None: the current one), read once per device."""
    return torch.cuda.get_device_capability(index)


def has_pdl(device: torch.device) -> bool:
    """Whether ``device`` can launch with PDL: an NVIDIA CUDA device of compute capability >= 9.0 (Hopper, Blackwell).
    Not a ROCm build's GPU, whose "capability" (MI300: 9.4) is not CUDA's and has no ``griddepcontrol``."""
    return device.type == "cuda" and torch.version.hip is None and capability(device.index)[0] >= 9


def launch_args(device: torch.device) -> dict:
    """Extra launch arguments of a step kernel on ``device``: ``PDL=True`` (the kernel's constexpr) and
    ``launch_pdl=True`` when ``ENABLED`` and the device has PDL (``has_pdl``), else none (a plain launch, and
    the kernel compiled without the wait)."""
    return {"PDL": True, "launch_pdl": True} if ENABLED and has_pdl(device) else {}
