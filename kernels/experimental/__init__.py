"""Kernels that were tried (or are waiting to be measured), are tested, and are not used by the product (each
module says why).

- ``lora_fused``: LoRA shrink + expand in one launch (slower than the two launches of ``triton_sgmv`` on every
  H200 decode case measured).
- ``expand_glu``: the gate/up expand fused into the gated activation, for prefill (session 31; measured slower than
  the engine's path in session 32, ``bench/bench_expand_glu.py``: the engine's switch for it was removed).
- ``gemm_lora``: the base GEMM with the LoRA expand in its epilogue, for prefill (session 34, written without a GPU;
  ``bench/bench_gemm_lora.py`` measures it against cuBLAS and the engine's path).
"""
