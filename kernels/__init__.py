"""LoRA kernels: the shrink/expand apply op over a batch of per-token adapter slots.

``lora_apply`` is the public op; ``build_lora_plan`` builds its per-step metadata. The torch backend
(``lora_apply_torch``) serves the CPU and is the test oracle; GPU backends register here.
"""

from __future__ import annotations

# This folder is the package ``multilora.kernels`` (pyproject maps it). With the repository root on
# sys.path it is also visible as a bare top-level ``kernels``, a name transformers probes for (an
# unrelated PyPI package): imported under that name it stays empty instead of failing.
if __name__ == "multilora.kernels":
    from multilora.kernels.backends import resolve_backend
    from multilora.kernels.lora import LoRAPlan, build_lora_plan, gather_adapter, lora_apply, lora_apply_torch

    __all__ = ["LoRAPlan", "build_lora_plan", "gather_adapter", "lora_apply", "lora_apply_torch", "resolve_backend"]
