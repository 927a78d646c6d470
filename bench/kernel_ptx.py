"""Global load / store widths of the SGMV kernels as compiled for an H100/H200 (sm_90), on any machine.

Triton compiles for a GPU target without a GPU (its wheel carries ptxas), so the PTX of the shrink and expand
kernels can be read here: whether the A / B^T rows and the y tile move in 16-byte vectors (``ld.global.v4``,
``st.global.v4``, or ``cp.async`` into shared memory) or element by element (``ld.global.b16`` for bf16). An
interface change once lost the vectors (per-slice offsets read from a table carry no divisibility the compiler
can see) and the kernels ran 1.5-2.9x slower on an H200; ``tests/test_kernel_codegen.py`` runs this script.

    python bench/kernel_ptx.py            # a table of instruction counts per kernel and ALIGN
    python bench/kernel_ptx.py --json     # the same as JSON (what the test reads)
    python bench/kernel_ptx.py --fingerprints OUT.json   # md5 of each variant's instructions, 80 configurations

``--fingerprints`` hashes the PTX of every (kernel, BLOCK_M 16/64, ALIGN 1/16, 1 or 3 slices, split-K 1/4, BLOCK_N
128/256, 2/4 warps) with debug info, labels and line records left out: two trees whose fingerprints agree compile to
the same instructions (session 15 checked that way that gating a kernel change on BLOCK_M left the prefill
variants exactly as they were). Run it with each tree on ``PYTHONPATH`` and compare the two files.

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
        "scal_ptr": "*fp32", "tab_ptr": "*i64", "v_ptr": "*fp32", "chunks_ptr": "*i32", "slots_ptr": "*i32"}
DIV16 = {"T", "d_in", "k_per_split", "stride_xm", "stride_ym", "stride_c"}
KERNELS = {
    "shrink": ("_sgmv_shrink_kernel", dict(NUM_SLICES=3, RMAX=16, BLOCK_M=16, BLOCK_R=16, BLOCK_K=128, IEEE=False,
                                           PDL=False, PDL_TRIGGER=True)),
    "expand": ("_sgmv_expand_kernel", dict(NUM_SLICES=3, SPLIT_K=2, RMAX=16, BLOCK_M=16, BLOCK_N=256, BLOCK_R=16,
                                           IEEE=False, PDL=False, PDL_TRIGGER=True, TILES=1, OVERWRITE=False)),
    # ``lora_delta``'s expand: the term written, zeros for rows of slot -1 (the decode default's looped tiles)
    "expand_write": ("_sgmv_expand_kernel", dict(NUM_SLICES=3, SPLIT_K=2, RMAX=16, BLOCK_M=16, BLOCK_N=128, BLOCK_R=16,
                                                 IEEE=False, PDL=False, PDL_TRIGGER=True, TILES=4, OVERWRITE=True)),
}


def memory_ops(kernel: str, align: int) -> dict[str, int]:
    """Counts of each global load / store / async-copy instruction form in the PTX of ``kernel`` ("shrink" or
    "expand") compiled with ``ALIGN = align``."""
    ptx = _compile_ptx(kernel, {**KERNELS[kernel][1], "ALIGN": align}, 4)
    return dict(Counter(re.findall(r"(?:ld|st)\.global(?:\.[a-z0-9]+)*|cp\.async\.[a-z0-9.]+", ptx)))


def _compile_ptx(kernel: str, consts: dict, num_warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from multilora.kernels import triton_sgmv

    name = KERNELS[kernel][0]
    fn = getattr(triton_sgmv, name)
    names = fn.arg_names
    sig = {n: PTRS.get(n) or ("constexpr" if n in consts else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in PTRS or n in DIV16}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": 2}).asm["ptx"]


_NOT_CODE = re.compile(r"\s*(//|\.loc|\.file|\.b8|\.b32 |\.b64 |\$L__tmp|\.section|\})")


def fingerprints() -> dict[str, str]:
    """``{configuration: md5 of its PTX instructions}`` (debug sections, labels and line records dropped)."""
    import hashlib
    import itertools

    out = {}
    for kernel, (_, base) in KERNELS.items():
        for bm, align, ns, sk, bn, warps in itertools.product((16, 64), (1, 16), (1, 3), (1, 4), (128, 256), (2, 4)):
            if kernel == "shrink" and (sk != 1 or bn != 128):  # the shrink has neither
                continue
            consts = {**base, "ALIGN": align, "BLOCK_M": bm, "NUM_SLICES": ns}
            if kernel == "expand":
                consts.update(SPLIT_K=sk, BLOCK_N=bn)
            ptx = _compile_ptx(kernel, consts, warps)
            body = "\n".join(line for line in ptx.splitlines() if not _NOT_CODE.match(line) and "DW_" not in line
                             and "debug" not in line)
            out[f"{kernel} block_m={bm} align={align} slices={ns} split_k={sk} block_n={bn} warps={warps}"] = \
                hashlib.md5(body.encode()).hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fingerprints", metavar="OUT", help="write the md5 of every variant's instructions to OUT (JSON)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter replaces the kernels")
    if args.fingerprints:
        fp = fingerprints()
        with open(args.fingerprints, "w") as f:
            json.dump(fp, f, indent=1)
        print(f"{len(fp)} variants -> {args.fingerprints}")
        return 0
    out = {f"{k}/align{a}": memory_ops(k, a) for k in KERNELS for a in (1, 16)}
    if args.json:
        print(json.dumps(out))
    else:
        for key, ops in out.items():
            print(f"{key:16s} " + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
