"""Global load / store widths of the SGMV kernels as compiled for an H100/H200 (sm_90), on any machine.

Triton compiles for a GPU target without a GPU (its wheel carries ptxas), so the PTX of the shrink and expand
kernels can be read here: whether the A / B^T rows and the y tile move in 16-byte vectors (``ld.global.v4``,
``st.global.v4``, or ``cp.async`` into shared memory) or element by element (``ld.global.b16`` for bf16). An
interface change once lost the vectors (per-slice offsets read from a table carry no divisibility the compiler
can see) and the kernels ran 1.5-2.9x slower on an H200; ``tests/test_kernel_codegen.py`` runs this script.

    python bench/kernel_ptx.py            # a table of instruction counts per kernel and ALIGN
    python bench/kernel_ptx.py --json     # the same as JSON (what the test reads)

Shapes: bf16, 3 slices (q/k/v), rank tiles of 16, BLOCK_M 16 (decode), BLOCK_N 256, BLOCK_K 128, split-K 2;
integer arguments marked divisible by 16 as Triton's launcher marks them at Llama shapes. Must run without
``TRITON_INTERPRET`` (the interpreter replaces the kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter

PTRS = {"x_ptr": "*bf16", "y_ptr": "*bf16", "buf_ptr": "*bf16", "offa_ptr": "*i64", "offb_ptr": "*i64", "ranks_ptr": "*i32",
        "scal_ptr": "*fp32", "tab_ptr": "*i64", "v_ptr": "*fp32", "chunks_ptr": "*i32"}
DIV16 = {"T", "d_in", "k_per_split", "stride_xm", "stride_ym", "stride_c"}
KERNELS = {
    "shrink": ("_sgmv_shrink_kernel", dict(NUM_SLICES=3, RMAX=16, BLOCK_M=16, BLOCK_R=16, BLOCK_K=128, IEEE=False)),
    "expand": ("_sgmv_expand_kernel", dict(NUM_SLICES=3, SPLIT_K=2, RMAX=16, BLOCK_M=16, BLOCK_N=256, BLOCK_R=16,
                                           IEEE=False)),
}


def memory_ops(kernel: str, align: int) -> dict[str, int]:
    """Counts of each global load / store / async-copy instruction form in the PTX of ``kernel`` ("shrink" or
    "expand") compiled with ``ALIGN = align``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from multilora.kernels import triton_sgmv

    name, consts = KERNELS[kernel]
    fn = getattr(triton_sgmv, name)
    consts = {**consts, "ALIGN": align}
    names = fn.arg_names
    sig = {n: PTRS.get(n) or ("constexpr" if n in consts else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in PTRS or n in DIV16}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2}).asm["ptx"]
    return dict(Counter(re.findall(r"(?:ld|st)\.global(?:\.[a-z0-9]+)*|cp\.async\.[a-z0-9.]+", ptx)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter replaces the kernels")
    out = {f"{k}/align{a}": memory_ops(k, a) for k in KERNELS for a in (1, 16)}
    if args.json:
        print(json.dumps(out))
    else:
        for key, ops in out.items():
            print(f"{key:16s} " + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
