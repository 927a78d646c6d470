"""LoRA kernels: the shrink/expand apply op over a batch of per-token adapter slots.

``lora_apply`` is the public op (``lora_delta``: the LoRA term alone, written into its own buffer);
``lora_slices`` describes a layer's fused projection in the pool (once), ``build_lora_plan`` builds the per-step
metadata (``chunk_table`` / ``fill_chunk_table`` its chunk table).
The torch backend (``lora_apply_torch``) serves the CPU and is the test oracle; ``resolve_backend`` picks it
or the Triton kernels (``triton_sgmv``).
"""

from __future__ import annotations

# This folder is the package ``multilora.kernels`` (pyproject maps it). With the repository root on sys.path
# (``python -m pytest`` or ``python -c`` run from a checkout, Ray workers started from one) it is also visible as a
# bare top-level ``kernels``: the name of Hugging Face's kernel hub package, which transformers (>= 5.25) imports
# whenever it loads a config or a tokenizer. Imported under that name, this module hands the name to the installed
# package of that name where there is one (``_yield_the_name``), else stays empty instead of failing.
if __name__ == "multilora.kernels":
    from multilora.kernels.lora import (LoRAModuleView, LoRAPlan, LoRASlices, block_m_for, build_lora_plan,
                                        chunk_table, fill_chunk_table, gather_adapter, lora_apply, lora_apply_torch,
                                        lora_delta, lora_slices, resolve_backend)

    __all__ = ["LoRAModuleView", "LoRAPlan", "LoRASlices", "block_m_for", "build_lora_plan", "chunk_table",
               "fill_chunk_table", "gather_adapter", "lora_apply", "lora_apply_torch", "lora_delta", "lora_slices",
               "resolve_backend"]
else:
    def _yield_the_name() -> None:
        """Replace this module in ``sys.modules`` with the ``kernels`` package found on sys.path outside this
        checkout (the import statement that loaded this file then returns that one: importlib reads the module back
        from ``sys.modules`` after executing it); do nothing where there is none."""
        import importlib.machinery
        import importlib.util
        import os
        import sys

        here = os.path.dirname(os.path.abspath(__file__))
        root = os.path.dirname(here)
        for entry in list(sys.path):
            try:
                if os.path.samefile(entry or os.curdir, root):
                    continue
            except OSError:  # a missing directory, a zip file: not the checkout
                pass
            spec = importlib.machinery.PathFinder.find_spec(__name__, [entry])
            if spec is None or spec.origin is None or os.path.dirname(os.path.abspath(spec.origin)) == here:
                continue
            module = importlib.util.module_from_spec(spec)
            sys.modules[__name__] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(__name__, None)
                raise
            return

    _yield_the_name()
