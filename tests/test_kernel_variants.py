"""One compiled Triton variant per kernel configuration, whatever the step's token count.

Triton compiles a kernel once per *specialisation* of its arguments: every integer argument equal to 1 becomes a
constant, every one divisible by 16 gets a divisibility hint, every pointer one for 16-byte alignment. A serving
step whose token count (or attention tile count, or fp8 row count) first fell in a new class compiled a new
variant inside the step, and every running request waited for it: on the H200 a cold-cache S1 row at N = 5
compiled 6 variants in 1.6 s mid-row, and its TTFT p50 was 0.67 s against 0.055 s with a warm cache
(bench/results/serving/). The per-step sizes are therefore ``do_not_specialize`` in the kernels.

These tests run the real launchers (Triton's interpreter on the CPU) at token counts in every class (1, multiples
of 16, the rest) within one block-size class, record each launch's specialisation key the way Triton's JIT
computes it (``native_specialize_impl`` with the kernel's own ``do_not_specialize`` list) and require one key per
kernel. The control case recomputes the keys as if nothing were exempt and requires several: the recorder sees
the difference it exists to catch.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the Triton launchers on the CPU: needs TRITON_INTERPRET=1")


class _Recorder:
    """Stands in for a Triton kernel object: records the specialisation key of each launch, then launches."""

    def __init__(self, kernel, keys: dict, ignore_exemptions: bool, launch: bool = True):
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl

        self.kernel, self.keys, self.ignore, self.launch = kernel, keys, ignore_exemptions, launch
        self._spec = lambda a, specialize: native_specialize_impl(BaseBackend, a, False, specialize, True)
        names = kernel.arg_names
        exempt = set((kernel.kwargs or {}).get("do_not_specialize") or ())
        self.exempt = {names.index(n) if isinstance(n, str) else n for n in exempt}
        self.name = kernel.fn.__name__

    def key(self, args, kwargs):
        def one(i, a):
            if isinstance(a, bool) or not isinstance(a, (int, torch.Tensor)):
                return repr(a)
            return self._spec(a, self.ignore or i not in self.exempt)
        return (tuple(one(i, a) for i, a in enumerate(args)), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys[self.name].add(self.key(args, kwargs))
            return self.kernel[grid](*args, **kwargs) if self.launch else None
        return launch


def _record(monkeypatch, module, names, ignore_exemptions=False, launch=True):
    keys: dict[str, set] = defaultdict(set)
    for n in names:
        kernel = getattr(module, n)
        kernel = kernel.kernel if isinstance(kernel, _Recorder) else kernel  # recording again: the real kernel
        monkeypatch.setattr(module, n, _Recorder(kernel, keys, ignore_exemptions, launch))
    return keys


@pytest.mark.parametrize("ignore", [False, True], ids=["kernels", "control-without-exemptions"])
def test_sgmv_one_variant_for_every_token_count(monkeypatch, ignore):
    from test_kernels import QKV, SMALL, run_case

    from multilora.kernels import triton_sgmv

    keys = _record(monkeypatch, triton_sgmv, ["_sgmv_shrink_kernel", "_sgmv_expand_kernel"], ignore)
    for T in (1, 2, 15, 16, 17, 32, 45):  # one block_m class (<= 512 tokens): the constexprs do not change
        run_case(SMALL, [4, 8], lambda slots, g, T=T: [slots[t % len(slots)] for t in range(T)], QKV,
                 device="cpu", dtype=torch.float32)
    counts = {k: len(v) for k, v in keys.items()}
    if ignore:  # T == 1, T % 16 == 0 and the rest would be three variants each
        assert counts == {"_sgmv_shrink_kernel": 3, "_sgmv_expand_kernel": 3}
    else:
        assert counts == {"_sgmv_shrink_kernel": 1, "_sgmv_expand_kernel": 1}


@pytest.mark.parametrize("ignore", [False, True], ids=["kernels", "control-without-exemptions"])
def test_attention_one_prefill_variant_for_every_tile_count(monkeypatch, ignore):
    from test_attention import make_batch

    from multilora.kernels import triton_attention

    keys = _record(monkeypatch, triton_attention, ["_paged_attention_kernel"], ignore)
    # prefill steps of 1, 2, 16 and 17 tiles and block tables 1, 2, 16 and 17 blocks wide (block_size 4)
    for q_lens, seq_lens in (([2], [4]), ([5, 2], [8, 7]), ([3] * 16, [64] + [3] * 15), ([3] * 17, [68] + [3] * 16)):
        b = make_batch(q_lens, seq_lens, H=4, Hkv=2, D=16, block_size=4, dtype=torch.float32, seed=len(q_lens))
        triton_attention.paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.25)
    n = len(keys["_paged_attention_kernel"])
    assert n == (3 if ignore else 1), keys["_paged_attention_kernel"]  # control: 1 / multiple of 16 / the rest


@pytest.mark.parametrize("ignore", [False, True], ids=["kernels", "control-without-exemptions"])
def test_fp8_gemv_one_variant_for_every_row_count(monkeypatch, ignore):
    from multilora.kernels import fp8, triton_fp8

    keys = _record(monkeypatch, triton_fp8, ["_w8_gemv_splitk_kernel", "_w8_gemv2_kernel"], ignore)
    w = fp8.quantize_weight(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)))
    for M in (2, 3, 16):  # the tensor-core path of both kernels (M = 1 takes the CUDA-core path: another variant)
        x = torch.randn(M, 64).half()
        triton_fp8.fp8_gemv_splitk(x, w.qweight, w.scale, block_n=16, block_k=32, use_dot=True)
        triton_fp8.fp8_gemv2(x, w.qweight, w.scale, block_n=16, block_k=32, use_dot=True)
    counts = {k: len(v) for k, v in keys.items()}
    if ignore:
        assert counts == {"_w8_gemv_splitk_kernel": 2, "_w8_gemv2_kernel": 2}  # M = 16 is another class
    else:
        assert counts == {"_w8_gemv_splitk_kernel": 1, "_w8_gemv2_kernel": 1}


@pytest.mark.parametrize("rank, pdl", [(8, False), (8, True), (64, True)],
                         ids=["r8", "r8-pdl", "r64-pdl"])
def test_warmup_token_counts_reach_every_lora_kernel_variant(monkeypatch, rank, pdl):
    """The LoRA kernels' compile-time constants still follow a step's token count T (block sizes above 512 tokens;
    the shrink's split count, which a GPU's rule halves as T doubles). With an H200's rule (132 SMs) on Llama-3-8B
    widths and 8 resident adapters, the variants of every T from 1 to 600 are exactly those of
    ``WARMUP_PROMPT_TOKENS`` up to 600, the prefill step sizes of ``Engine.warmup`` (the kernels are recorded, not
    run); and the tile constants that follow T (block sizes, split counts) of every T up to 4,096 (the default largest
    step) are those of the warm-up's step sizes, with pools of 8, 140 and 4,096 slots (with many slots a class can be
    a few tokens wide: 513-527). With PDL as on an H200 (``triton_sgmv._use_pdl``: on, but not in the wide-rank
    regime past one token) the variants of a rank-64 pool too."""
    from test_kernels import GATE_UP, LLAMA8B, QKV, make_pool

    from multilora.kernels import build_lora_plan, lora_slices, triton_sgmv
    from multilora.runtime.engine import WARMUP_PROMPT_TOKENS

    real = triton_sgmv._split_k
    monkeypatch.setattr(triton_sgmv, "num_sms", lambda index: 132)
    monkeypatch.setattr(triton_sgmv, "_split_k", lambda device, *a, **k: real(torch.device("cuda", 0), *a, **k))
    if pdl:  # (recorded, not launched: the interpreter has no PDL)
        monkeypatch.setattr(triton_sgmv, "_pdl", lambda device: True)
    pool, slots = make_pool(LLAMA8B, [rank] * 8, dtype=torch.float32, device="cpu")
    groups = [lora_slices([pool.module_view(0, m) for m in mods]) for mods in (QKV, ("o_proj",), GATE_UP, ("down_proj",))]

    def variants(counts):
        keys = _record(monkeypatch, triton_sgmv, ["_sgmv_shrink_kernel", "_sgmv_expand_kernel"], launch=False)
        splits = set()
        for T in counts:
            plan = build_lora_plan([slots[t % len(slots)] for t in range(T)], device="cpu")
            for sl in groups:
                x = torch.zeros(T, sl.d_in)
                triton_sgmv.lora_apply_triton(torch.zeros(T, sl.d_out), x, sl, plan)
        for name, ks in keys.items():
            for args, kw in ks:
                splits.add(dict(kw).get("SPLIT_K"))
        return {n: set(v) for n, v in keys.items()}, splits

    every, splits = variants(range(1, 601))
    warm, _ = variants([n for n in WARMUP_PROMPT_TOKENS if n <= 600])
    assert len(splits) >= 3, splits  # the rule does vary the split over these token counts
    assert warm == every
    pdls = {dict(kw).get("PDL") for ks in every.values() for _, kw in ks}  # (values as recorded: their repr)
    assert pdls == ({None} if not pdl else {"True"} if rank < 64 else {"True", None}), pdls
    if rank != 8:
        return  # the tile constants below are those of rank-16 pools
    # the decode expand's looped tiles (on a GPU, a rank-16 pool): warm-up's step sizes reach each row, and decode
    # graph buckets of up to 16 requests (captured by warm-up) the first
    loops = {triton_sgmv.decode_expand_tiles(T) for T in range(1, 4097)}
    assert len(loops) >= 2 and loops == {triton_sgmv.decode_expand_tiles(T) for T in (1, *WARMUP_PROMPT_TOKENS)}

    import triton

    from multilora.kernels.lora import block_m_for

    class Plan:  # what chunk_bound reads of a plan
        def __init__(self, T):
            self.num_tokens, self.block_m = T, block_m_for(T)

    class Slices:  # and of a group's slices
        def __init__(self, sl, max_slots):
            self.d_in, self.num_slices, self.max_slots = sl.d_in, sl.num_slices, max_slots

    def split_counts(counts, n_slots):
        """(group, BLOCK_M, BLOCK_K, SPLIT_K) of each T: the shrink's and expand's T-dependent constants (bf16 tiles)."""
        out = set()
        for T in counts:
            for sl in groups:
                st = Slices(sl, n_slots)
                cap = max(16, triton.next_power_of_2(st.d_in))  # as _shrink: the rule's block_k and split width
                block_k, split_block = triton_sgmv.shrink_block_k("cuda", torch.bfloat16, T, block_m_for(T), rank)
                programs = triton_sgmv.chunk_bound(Plan(T), st) * st.num_slices  # (what the split is computed from)
                split = real(torch.device("cuda", 0), programs, st.d_in, min(split_block or block_k, cap), 32)
                block_k = min(block_k, cap)
                out.add((st.d_in, st.num_slices, block_m_for(T), block_k, split))
        return out

    warm_all = sorted({min(n, 4096) for n in WARMUP_PROMPT_TOKENS})
    for n_slots in (8, 140, 4096):  # 4096: chunks = T up to 4,096 tokens (the shrink splits follow T itself)
        assert split_counts(range(1, 4097), n_slots) == split_counts(warm_all, n_slots), n_slots
