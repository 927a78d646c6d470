"""Kernels that were tried, are tested, and are not used by the product (each module says why).

- ``lora_fused``: LoRA shrink + expand in one launch (slower than the two launches of ``triton_sgmv`` on every
  H200 decode case measured).
"""
