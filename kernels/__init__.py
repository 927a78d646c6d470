"""LoRA kernels: the shrink/expand apply op over a batch of per-token adapter slots.

``lora_apply`` is the public op; ``lora_slices`` describes a layer's fused projection in the pool (once),
``build_lora_plan`` builds the per-step metadata (``chunk_table`` / ``fill_chunk_table`` its chunk table).
The torch backend (``lora_apply_torch``) serves the CPU and is the test oracle; ``resolve_backend`` picks it
or the Triton kernels (``triton_sgmv``).
"""

from __future__ import annotations

# This folder is the package ``multilora.kernels`` (pyproject maps it). With the repository root on
# sys.path it is also visible as a bare top-level ``kernels``, a name transformers probes for (an
# unrelated PyPI package): imported under that name it stays empty instead of failing.
if __name__ == "multilora.kernels":
    from multilora.kernels.lora import (LoRAModuleView, LoRAPlan, LoRASlices, block_m_for, build_lora_plan,
                                        chunk_table, fill_chunk_table, gather_adapter, lora_apply, lora_apply_torch,
                                        lora_slices, resolve_backend)

    __all__ = ["LoRAModuleView", "LoRAPlan", "LoRASlices", "block_m_for", "build_lora_plan", "chunk_table",
               "fill_chunk_table", "gather_adapter", "lora_apply", "lora_apply_torch", "lora_slices",
               "resolve_backend"]
