"""End-to-end generation: this engine against transformers and peft, with and without adapters (issue 6).

A random-weight model of a real shape (default Llama-3-8B, bf16); batches 1, 8, 64, 256; prompt 512 tokens
(random ids, seeded), 128 output tokens, greedy, end-of-sequence ignored. Providers, side by side in one run:

    multilora       this engine, no adapters
    multilora-lora  this engine, request i on adapter a<i> (rank r, all seven projections): b distinct adapters
    multilora-lora-inplace  the same engine and adapters with ``lora_side_stream_max_tokens = 0``: each LoRA added
                    in place after its GEMM instead of beside it on a side stream (issue 12: before / after)
    multilora-lora-hiprio  the same engine and adapters with the LoRA side stream at the highest CUDA priority
                    (``DecoderModel.lora_side_priority``), so its programs start before the GEMM's pending ones
    multilora-lora-onetile  the same engine and adapters with the decode expand as before session 16: one 256-wide
                    output tile per program (``kernels.triton_sgmv.DECODE_EXPAND_LOOP = ((512, 1, 256, 2),)``)
    multilora-lora-s17tiles  the same engine and adapters with the decode LoRA tiles as before session 18: 4-warp
                    shrink programs, the rank > 16 expand's older tiles (``triton_sgmv.DECODE_SHRINK_WARPS = 4``,
                    ``DECODE_EXPAND_RANK_TILES = None``)
    multilora-lora-nopdl  the same engine and adapters with plain launches of the LoRA kernels instead of
                    programmatic dependent launch (``kernels.triton_sgmv.PDL = False``: what ran before session 20)
    multilora-plain, multilora-lora-plain  the first two with every Triton kernel launched plainly: neither the step's
                    kernels (``kernels.triton_pdl.ENABLED = False``) nor the LoRA kernels (``triton_sgmv.PDL = False``)
                    use programmatic dependent launch (what ran before session 21 / session 20)
    multilora-lora-carve  the same engine and adapters with the base GEMMs of side-stream steps leaving ``--carveout``
                    SMs to the LoRA kernels (``DecoderModel.lora_side_sm_carveout``; issue 12)
    multilora-lt, multilora-lora-lt  the first two with the base GEMMs of steps of 17-64 tokens through cuBLASLt
                    instead of cuBLAS (``DecoderModel.gemm_cublaslt_tokens = (17, 64)``; faster for one layer there)
                    and no SM carve-out (``lora_side_sm_carveout = 0``): cuBLASLt alone
    multilora-fp8, multilora-fp8-lora   the same two with Engine(weight_dtype="fp8") (issue 16; not in the default
                    --providers: ask for them)
    multilora-fp8-plain, multilora-fp8-lora-plain   those two with every Triton kernel launched plainly (as the
                    ``-plain`` providers above; the fp8 GEMVs are Triton kernels)
    multilora-fp8-f16widen  multilora-fp8 with the one-row GEMV widening fp8 weights through float16
                    (``kernels.triton_fp8.GEMV_WIDEN_F16 = True``, the default since session 22)
    multilora-fp8-bf16head  multilora-fp8 with the LM head in bf16 (``EngineConfig.fp8_lm_head=False``; from session 32
                    the default engine's head is fp8 when untied, as here): the A/B of the fp8 head. One engine
                    serves both, its head swapped for the quantized copy, graphs captured again, so rounds
                    interleave; the rows record ``fp8_lm_head``
    multilora-fp8-lmhead  the same as multilora-fp8 since session 32 (the LM head in fp8; before, the A/B of it)
    multilora-fp8-bf16widen  the same through bfloat16 (``GEMV_WIDEN_F16 = False``: the A/B; the same results bit
                    for bit)
    multilora-fp8-onepassmax  multilora-fp8 with the greedy row maximum over the vocabulary in one pass
                    (``runtime.sampling.ROW_MAX_TWO_PASS = False``, what ran before session 23: the A/B)
    multilora-fp8-sepquant  multilora-fp8 with each fp8 GEMM quantizing its activations in a launch of its own
                    (``runtime.model.FUSE_FP8_QUANT = False``, what ran before session 23: the A/B; same values)
    multilora-s25attn, multilora-lora-s25attn, multilora-fp8-s25attn  those with session 25's decode attention
                    config and splits (``triton_attention.DECODE_TUNED = False``): the A/B of session 26's
    multilora-lora-zeroed  multilora-lora with the side stream's LoRA term added into a zeroed buffer (a memset and the
                    expand's read-add; ``runtime.model.LORA_DELTA_OVERWRITE_MIN_TOKENS = 1 << 30``, what ran before
                    session 27):
                    the A/B of ``lora_delta``
    multilora-lora-sidepf, multilora-lora-sidepf0  multilora-lora with every step's LoRA on the side stream, prefill
                    and mixed steps too (``DecoderModel.lora_side_max_tokens = 1 << 20``; the default stops at 64
                    tokens, 2 from a rank > 16 pool); -sidepf0 also without the SM carve-out of side-stream steps
                    (``lora_side_sm_carveout = 0``): the A/B of issue 12's TTFT (prefill LoRA in place adds 6-13%)
    multilora-lora-nowideout  multilora-lora with every width of a rank > 16 pool's decode expand on
                    ``DECODE_EXPAND_RANK_TILES`` (``triton_sgmv.DECODE_EXPAND_RANK_WIDE_OUT = None``, what ran before
                    session 29): the engine A/B of gate/up's 48-64-token tiles (with ``--rank 64``)
    multilora-lora-addafter  multilora-lora with prefill-sized steps' in-place LoRA added after the base GEMM (the
                    expand reading and rewriting its output; ``runtime.model.LORA_BEFORE_GEMM_MIN_TOKENS = 1 << 30``,
                    what ran before session 30): the A/B of the LoRA term written first and the GEMM adding to it
    multilora-lora-s29tiles  multilora-lora with the prefill LoRA tiles that ran before session 30
                    (``triton_sgmv.PREFILL_SHRINK_BLOCK_K = PREFILL_WRITE_BLOCK_N = PREFILL_WRITE_LOOP = None``): the
                    engine A/B of session 30's prefill sweep
    multilora-lora-s30tiles  multilora-lora with the prefill writing expand one tile per program, as in session 30
                    (``triton_sgmv.PREFILL_WRITE_LOOP = None``): the engine A/B of session 31's looped prefill tiles
    multilora-lora-boundgrid  multilora-lora with every LoRA launch's grid at the bound for any grouping,
                    ``min(T, cdiv(T, block_m) + max_slots)`` (``triton_sgmv.GRID_BY_SEGMENTS = False``, what ran before
                    session 33; a prefill then launches its chunk programs for the pool's 256-4,096 slots): the A/B
                    of sizing the grid by a step's distinct slots (eager steps) or the batch (the piecewise graphs,
                    captured again); the shrink's K split is the same in both (it follows the bound)
    multilora-lora-gridsplit  multilora-lora with the shrink's K split computed from the launched grid
                    (``triton_sgmv.SPLIT_BY_GRID = True``, off by default): more splits where the grid by a step's
                    slots leaves SMs idle, at other bits
    multilora-lora-gemmfused  multilora-lora with prefill-sized steps' base GEMMs taking the LoRA expand in their
                    epilogue (``kernels.experimental.gemm_lora``: ``runtime.model.LORA_GEMM_EPILOGUE_MIN_TOKENS =
                    LORA_BEFORE_GEMM_MIN_TOKENS``; off by default): the engine A/B of issue 12's TTFT for that kernel
    multilora-lora-glushrink  multilora-lora with prefill-sized steps' MLP activation and down-projection LoRA shrink
                    in one kernel (``kernels.triton_sgmv.glu_shrink``: ``runtime.model.GLU_SHRINK_MIN_TOKENS =
                    LORA_BEFORE_GEMM_MIN_TOKENS``; off by default): the engine A/B of issue 12's TTFT for that kernel
    multilora-fp8-nopreload  multilora-fp8 with no weight tiles of the one-row GEMV loaded before its PDL wait
                    (``kernels.triton_fp8.GEMV_PRELOAD = 0``, what ran before session 27): the A/B of the preload
    multilora-fp8-preload4  multilora-fp8 with 4 such tiles (``GEMV_PRELOAD = 4``)
    multilora-fp8-nopad  multilora-fp8 with fp8 activations of 1-63 rows in buffers of their own size
                    (``fp8.FP8_X_ROWS = 1``; TMA tiles past x's edge read zeros): the A/B of the 64-row buffers
    multilora-fp8-shipped  multilora-fp8 with the fp8 GEMMs' tiles of the shipped tables alone (``kernels/tuned/``),
                    where the other fp8 providers also read the file ``MULTILORA_FP8_TUNED`` names (a new sweep's
                    ``fp8_gemv_tuned.json``): the engine A/B of a new table; the same as multilora-fp8 when it is unset
    multilora-sync, multilora-lora-sync, multilora-fp8-sync  multilora, multilora-lora and multilora-fp8 with every
                    step read back before the next is launched (``EngineConfig.async_scheduling`` off, what ran
                    before session 24: the A/B of the default on CUDA)
    hf              transformers' generate on the same base weights (sdpa attention, its default dynamic cache)
    peft            peft's mixed-batch generate (adapter_names=) with the same adapter files as multilora-lora

The settings the multilora variants change are ``Knob``s in ``variant_knobs`` (a new A/B: a suffix in ``PROVIDERS``
and a knob there; its rows then record its value and it is put back after the run).

With ``--rounds N`` the multilora providers run N times (every other round in reverse order, so none is always the
first after warm-up; rows carry ``round``) and the table, targets and plot take each (provider, batch)'s median round
by TPOT (``merge_rounds``; odd N avoids choosing between two middles): use it for A/B decisions, single rows differ
by ~5% on an H200 (session 18).

Each (provider, batch) row runs the batch three times: 2 output tokens (untimed warm-up), 1 output token (TTFT:
prefill and the first token) and gen tokens (T_total). TPOT = (T_total - TTFT) / (gen - 1); output tokens/s =
batch * gen / T_total; decode tokens/s = batch / TPOT. Achieved bandwidth = bytes one decode step must read / TPOT:
the weights (less the input embedding table, of which a step reads `batch` rows) + the KV of the mean decode
context (batch x (prompt + gen / 2) tokens) + the distinct adapters of the batch, against the device-to-device
copy bandwidth measured in the same run. peft's mixed batch loops over the batch's adapters in every module and
is slow, so it generates --peft-gen tokens (default 16): compare it by TPOT and decode tokens/s (each row records
its gen; output_tokens_per_s_projected extrapolates every row to --gen tokens from its TTFT and TPOT). The
multilora rows also carry ``decode_step_ms_p50``: the median wall time of the decode steps that carried the whole
batch in the timed runs (the engine's own step timer): TPOT subtracts two runs' prefills, whose spread reaches
+-1 ms of TPOT at batch 64 (session 20), the step median does not; the issue-12 targets quote both. And
``tpot_in_run_ms``: TPOT request by request within the timed gen-token run, ``(finish - first token) / (tokens - 1)``
averaged over the batch (what serving metrics call TPOT; mixed steps a request decodes through included).

    python bench/bench_generate.py --out bench/results        # H200, Llama-3-8B, all providers: ~7 min
    python bench/bench_generate.py --shape tiny --batches 1,2 --prompt-len 8 --gen 3 --peft-gen 2   # CPU smoke run

Targets (issue 6): batch 1 without adapters reads the weights at >= 70% of copy bandwidth; 64 requests on 64
distinct adapters run >= 10x peft's mixed-batch tokens/s and >= 3x transformers' base-model tokens/s at batch 64.

multilora (both variants: one engine) and transformers + peft (one model, peft wraps it in place) each run in a
child process, so a crash or a broken CUDA context in one cannot lose the other's rows and all GPU memory is
returned in between (--in-process: no children). Every row runs in its own try/except (an error is recorded in
the row); rows that would start after --time-budget seconds are recorded as skipped. ``generate_<shape>.json`` is
rewritten after every row (each row carries the hardware, versions, shape, dtype and copy bandwidth); at the end
come ``generate_<shape>.md`` (the table and the targets, also printed) and ``generate_<shape>.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from multilora import Engine, SamplingParams
from multilora.memory.pool import max_adapter_pages
from multilora.config import ModelConfig
from multilora.runtime.weights import MODEL_SHAPES, random_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (adapter_bytes, add_torch_threads_arg, at_least, copy_bandwidth,  # noqa: E402
                     set_torch_threads, write_adapters)  # (bench/_common.py)

PROVIDERS = ("multilora", "multilora-lora", "multilora-lora-inplace", "multilora-lora-hiprio", "multilora-lora-onetile", "multilora-lora-s17tiles", "multilora-lora-nopdl", "multilora-lora-carve", "multilora-lt", "multilora-lora-lt", "multilora-plain", "multilora-lora-plain", "multilora-fp8", "multilora-fp8-lora", "multilora-fp8-plain", "multilora-fp8-lora-plain", "multilora-fp8-f16widen", "multilora-fp8-bf16widen", "multilora-fp8-lmhead", "multilora-fp8-bf16head", "multilora-fp8-onepassmax", "multilora-fp8-sepquant", "multilora-fp8-shipped", "multilora-fp8-nopad", "multilora-s25attn", "multilora-lora-s25attn", "multilora-fp8-s25attn", "multilora-lora-zeroed", "multilora-lora-sidepf", "multilora-lora-sidepf0", "multilora-lora-nowideout", "multilora-lora-addafter", "multilora-lora-s29tiles", "multilora-lora-s30tiles", "multilora-lora-boundgrid", "multilora-lora-gridsplit", "multilora-lora-gemmfused", "multilora-lora-glushrink", "multilora-fp8-nopreload", "multilora-fp8-preload4", "multilora-sync", "multilora-lora-sync", "multilora-fp8-sync", "hf", "peft")
GROUPS = {"multilora": ("multilora", "multilora-lora", "multilora-lora-inplace", "multilora-lora-hiprio", "multilora-lora-onetile", "multilora-lora-s17tiles", "multilora-lora-nopdl", "multilora-lora-carve", "multilora-lt", "multilora-lora-lt", "multilora-plain", "multilora-lora-plain", "multilora-sync", "multilora-lora-sync", "multilora-s25attn", "multilora-lora-s25attn", "multilora-lora-zeroed", "multilora-lora-sidepf", "multilora-lora-sidepf0", "multilora-lora-nowideout", "multilora-lora-addafter", "multilora-lora-s29tiles", "multilora-lora-s30tiles", "multilora-lora-boundgrid", "multilora-lora-gridsplit", "multilora-lora-gemmfused", "multilora-lora-glushrink"), "multilora-fp8": ("multilora-fp8", "multilora-fp8-lora", "multilora-fp8-plain", "multilora-fp8-lora-plain", "multilora-fp8-f16widen", "multilora-fp8-bf16widen", "multilora-fp8-lmhead", "multilora-fp8-bf16head", "multilora-fp8-onepassmax", "multilora-fp8-sepquant", "multilora-fp8-shipped", "multilora-fp8-nopad", "multilora-fp8-s25attn", "multilora-fp8-sync", "multilora-fp8-nopreload", "multilora-fp8-preload4"),
          "hf": ("hf", "peft")}  # one engine / one HF model each
DEFAULT_PROVIDERS = ("multilora", "multilora-lora", "hf", "peft")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
GB = 1e9
TARGET_BATCH = 64  # the issue's multi-adapter targets are at 64 requests on 64 adapters


# ------------------------------------------------------------------------------------------ measuring
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Wall seconds of fn() between device synchronizations, and its result."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def measure(generate: Callable[[int], list[list[int]]], batch: int, gen: int, device: torch.device,
            repeats: int = 1, warmup: bool = True) -> tuple[dict, list]:
    """TTFT (a run with 1 output token), T_total (gen tokens), medians over ``repeats``, and what follows.

    ``generate(n)`` runs the batch for n output tokens each and returns each request's output token ids. An
    untimed 2-token run comes first (``warmup``), so first-use costs of this batch's shapes (allocator growth,
    kernel selection, adapters not yet resident) land in neither timed run."""
    if warmup:
        generate(2)
    ttfts, totals = [], []
    for _ in range(repeats):
        ttft, outs1 = timed(lambda: generate(1), device)
        total, outs = timed(lambda: generate(gen), device)
        for n, o in ((1, outs1), (gen, outs)):
            lens = sorted({len(t) for t in o})
            if len(o) != batch or lens != [n]:
                raise RuntimeError(f"expected {batch} outputs of {n} tokens, got {len(o)} with lengths {lens}")
        ttfts.append(ttft)
        totals.append(total)
    ttft, total = statistics.median(ttfts), statistics.median(totals)
    tpot = (total - ttft) / (gen - 1)
    row = {"ttft_s": ttft, "total_s": total, "tpot_ms": tpot * 1e3, "output_tokens_per_s": batch * gen / total,
           "decode_tokens_per_s": batch / tpot if tpot > 0 else None, "repeats": repeats}
    if tpot <= 0:
        row["note"] = "T_total <= TTFT: timing noise larger than the decode time (no TPOT)"
    return row, outs


def traffic(row: dict, weight_read: int, kv_token: int, prompt_len: int, one_adapter: int, distinct: int,
            copy_gbps: float, gen_target: int) -> dict:
    """Bytes one decode step must read, achieved bandwidth and its fraction of copy bandwidth."""
    kv = row["batch"] * (prompt_len + row["gen"] / 2) * kv_token
    step = weight_read + kv + distinct * one_adapter
    tpot = row["tpot_ms"] / 1e3
    ok = tpot > 0
    proj = row["ttft_s"] + (gen_target - 1) * tpot  # T_total had it run gen_target tokens
    return {"weight_bytes_read": weight_read, "kv_bytes_per_step": int(kv), "adapter_bytes_per_step": distinct * one_adapter,
            "bytes_per_step": int(step),
            "achieved_gbps": step / tpot / GB if ok else None,
            "frac_of_copy": step / tpot / GB / copy_gbps if ok else None,
            "weights_frac_of_copy": weight_read / tpot / GB / copy_gbps if ok else None,
            "output_tokens_per_s_projected": row["batch"] * gen_target / proj if ok else None}


def matching_prefix(a: list[int] | None, b: list[int]) -> int | None:
    """Leading tokens on which two greedy outputs agree (None: nothing to compare)."""
    if a is None:
        return None
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------- the run
@dataclass
class Run:
    """What every row shares, and the rows so far (written to ``path`` after each one)."""

    args: argparse.Namespace
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    prompts: list[list[int]]
    meta: dict
    path: Path
    t0: float = field(default_factory=time.perf_counter)
    rows: list[dict] = field(default_factory=list)
    last: dict[str, tuple[int, float]] = field(default_factory=dict)  # provider -> (batch, seconds) of its last row
    first_tokens: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (provider, batch) -> request 0's ids

    @property
    def kv_token_bytes(self) -> int:
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def embed_bytes(self) -> int:
        """The input embedding table when untied (a decode step reads `batch` rows of it, not all)."""
        c = self.config
        return 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size * torch.empty((), dtype=self.dtype).element_size()

    def budget_reason(self, provider: str | None = None, batch: int = 0) -> str | None:
        """Why a row (or a provider's setup, provider=None) should not start now; None = go."""
        left = self.args.time_budget - (time.perf_counter() - self.t0)
        if left <= 0:
            return f"--time-budget {self.args.time_budget:.0f} s spent"
        if provider in self.last:
            b, s = self.last[provider]
            est = s * max(1.0, batch / b)
            if est > left:
                return f"predicted {est:.0f} s (last row x batch ratio) > {left:.0f} s left of --time-budget"
        return None

    def record(self, row: dict) -> None:
        row = {k: clean(v) for k, v in row.items()}
        self.rows.append({**self.meta, **row})
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if k != "first_request_tokens"}), flush=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.rows, indent=1))
        os.replace(tmp, self.path)  # atomic: a killed process never leaves half a file

    def skip(self, provider: str, batches: list[int], gen: int, reason: str, status: str = "skipped") -> None:
        for b in batches:
            self.record({"provider": provider, "batch": b, "gen": gen, "status": status, "error": reason})

    def row(self, provider: str, batch: int, gen: int, body: Callable[[], dict]) -> None:
        """Run one row's body under the time budget and a try/except; record what it returns or its error."""
        reason = self.budget_reason(provider, batch)
        if reason:
            self.skip(provider, [batch], gen, reason)
            return
        t = time.perf_counter()
        try:
            fields, status = body(), "ok"
        except Exception as e:  # a failed row is a result too; the run goes on
            traceback.print_exc()
            fields, status = {"error": f"{type(e).__name__}: {e}"[:2000]}, "error"
            free_memory()
        wall = time.perf_counter() - t
        if status == "ok":
            self.last[provider] = (batch, wall)
        self.record({"provider": provider, "batch": batch, "gen": gen, "status": status, "row_wall_s": wall, **fields})


def clean(v: Any) -> Any:
    """JSON-safe: non-finite floats become None."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


# --------------------------------------------------------------------------------------- multilora
@dataclass
class Knob:
    """A setting that provider variants change (``variant_knobs``): ``get`` / ``put`` read and write it (a module's
    attribute or the engine's), ``pick(variant, default)`` is the value a variant runs with, ``graphs``: captured
    CUDA graphs bake it in (a change captures them again), ``identity``: values compare by ``is`` (tensors,
    tables), ``key``: the row field that records it (``record()``, default ``get()``; None: not recorded)."""
    get: Callable[[], Any]
    put: Callable[[Any], None]
    pick: Callable[[str, Any], Any]
    graphs: bool = True
    identity: bool = False
    key: str | None = None
    record: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        if self.record is None:
            self.record = self.get

    def same(self, x: Any, y: Any) -> bool:
        return x is y if self.identity else x == y


def _attr(obj: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: getattr(obj, name)), (lambda value: setattr(obj, name, value))


def _by_suffix(*pairs: tuple[str | tuple[str, ...], Any]) -> Callable[[str, Any], Any]:
    """``pick``: the value of the first suffix (or tuple of suffixes) the variant ends with, else the default."""
    def pick(v: str, default: Any) -> Any:
        return next((value for suffix, value in pairs if v.endswith(suffix)), default)
    return pick


def variant_knobs(engine: Engine | None, a: argparse.Namespace) -> list[Knob]:
    """Every setting a multilora provider variant changes (the module docstring's provider list), as ``Knob``s: one
    place to add an A/B. ``bench_multilora`` reads their defaults once, gives each variant its values (capturing the
    graphs again when one they bake in changed), records them in the variant's rows and puts the defaults back at
    the end. An engine that failed to build (None) leaves only the module-level knobs."""
    from multilora.kernels import fp8 as fp8_mod
    from multilora.kernels import triton_attention, triton_fp8, triton_pdl, triton_sgmv
    from multilora.runtime import model as model_mod
    from multilora.runtime import sampling

    lazy: dict[str, Any] = {}

    def fp8_head(v: str, default: Any) -> Any:  # fp8 engines' head (the engine's default: untied heads in fp8)
        if (not v.startswith("multilora-fp8") or v.endswith("-bf16head") or not isinstance(default, torch.Tensor)
                or default is engine.model.embed):  # (tied: the engine keeps the table as its head)
            return default
        if "head" not in lazy:
            from multilora.kernels.fp8 import quantize_weight

            lazy["head"] = quantize_weight(default)  # what Engine(fp8_lm_head=True) stores
        return lazy["head"]

    def shipped(v: str, default: Any) -> Any:  # -shipped: the shipped tables alone, read on first use
        if not v.endswith("-shipped"):
            return default
        if "table" not in lazy:
            lazy["table"] = triton_fp8.shipped_table()
        return lazy["table"]

    def hiprio(v: str, default: int) -> int:  # (lowest, highest): the highest
        return torch.cuda.Stream.priority_range()[1] if v.endswith("-hiprio") and torch.cuda.is_available() else default

    knobs = [
        Knob(*_attr(triton_sgmv, "DECODE_EXPAND_LOOP"), _by_suffix(("-onetile", ((512, 1, 256, 2),))),
             key="decode_expand_loop"),
        Knob(*_attr(triton_sgmv, "DECODE_SHRINK_WARPS"), _by_suffix(("-s17tiles", 4)), key="decode_shrink_warps"),
        Knob(*_attr(triton_sgmv, "DECODE_EXPAND_RANK_TILES"), _by_suffix(("-s17tiles", None)),
             key="decode_expand_rank_tiles"),
        Knob(*_attr(triton_sgmv, "PDL"), _by_suffix((("-nopdl", "-plain"), False)), key="lora_pdl"),
        Knob(*_attr(triton_pdl, "ENABLED"), _by_suffix(("-plain", False)), key="step_pdl"),
        Knob(*_attr(triton_fp8, "GEMV_WIDEN_F16"), _by_suffix(("-f16widen", True), ("-bf16widen", False)),
             key="fp8_gemv_widen_f16"),
        Knob(*_attr(sampling, "ROW_MAX_TWO_PASS"), _by_suffix(("-onepassmax", False)), graphs=False),  # not in graphs
        Knob(*_attr(model_mod, "FUSE_FP8_QUANT"), _by_suffix(("-sepquant", False))),
        Knob(*_attr(fp8_mod, "FP8_X_ROWS"), _by_suffix(("-nopad", 1)), key="fp8_x_rows"),
        Knob(*_attr(triton_attention, "DECODE_TUNED"), _by_suffix(("-s25attn", False)), key="attention_decode_tuned"),
        Knob(*_attr(model_mod, "LORA_DELTA_OVERWRITE_MIN_TOKENS"), _by_suffix(("-zeroed", 1 << 30)),
             key="lora_delta_overwrite_min_tokens"),
        Knob(*_attr(model_mod, "LORA_BEFORE_GEMM_MIN_TOKENS"), _by_suffix(("-addafter", 1 << 30)),
             key="lora_before_gemm_min_tokens"),
        Knob(*_attr(triton_sgmv, "PREFILL_SHRINK_BLOCK_K"), _by_suffix(("-s29tiles", None)),
             key="prefill_shrink_block_k"),
        Knob(*_attr(triton_sgmv, "PREFILL_WRITE_BLOCK_N"), _by_suffix(("-s29tiles", None)),
             key="prefill_write_block_n"),
        Knob(*_attr(triton_sgmv, "PREFILL_WRITE_LOOP"), _by_suffix((("-s29tiles", "-s30tiles"), None)),
             key="prefill_write_loop"),
        Knob(*_attr(triton_sgmv, "GRID_BY_SEGMENTS"), _by_suffix(("-boundgrid", False)), key="lora_grid_by_segments"),
        Knob(*_attr(triton_sgmv, "SPLIT_BY_GRID"), _by_suffix(("-gridsplit", True)), key="lora_split_by_grid"),
        Knob(*_attr(model_mod, "LORA_GEMM_EPILOGUE_MIN_TOKENS"),
             _by_suffix(("-gemmfused", model_mod.LORA_BEFORE_GEMM_MIN_TOKENS)), key="lora_gemm_epilogue_min_tokens"),
        Knob(*_attr(model_mod, "GLU_SHRINK_MIN_TOKENS"),
             _by_suffix(("-glushrink", model_mod.LORA_BEFORE_GEMM_MIN_TOKENS)), key="glu_shrink_min_tokens"),
        Knob(*_attr(triton_fp8, "GEMV_PRELOAD"), _by_suffix(("-nopreload", 0), ("-preload4", 4)),
             key="fp8_gemv_preload"),
        Knob(*_attr(triton_sgmv, "DECODE_EXPAND_RANK_WIDE_OUT"), _by_suffix(("-nowideout", None)),
             key="decode_expand_rank_wide_out"),
        Knob(triton_fp8.tuned_table, lambda t: setattr(triton_fp8, "_tuned", t), shipped,  # the fp8 GEMMs' tiles
             identity=True),  # (read at capture; the default: the shipped ones with MULTILORA_FP8_TUNED on top)
    ]
    if engine is None:
        return knobs
    m = engine.model
    return knobs + [
        Knob(*_attr(m, "lora_side_max_tokens"), _by_suffix(("-inplace", 0), (("-sidepf", "-sidepf0"), 1 << 20)),
             key="lora_side_stream_max_tokens", record=m.lora_side_limit),
        Knob(*_attr(m, "lora_side_priority"), hiprio, key="lora_side_priority"),
        Knob(*_attr(m, "lora_side_sm_carveout"), _by_suffix(("-carve", a.carveout), (("-lt", "-sidepf0"), 0)),
             key="lora_side_sm_carveout"),
        Knob(*_attr(m, "gemm_cublaslt_tokens"), _by_suffix(("-lt", (17, 64))), key="gemm_cublaslt_tokens"),
        Knob(*_attr(m, "lm_head"), fp8_head, identity=True, key="fp8_lm_head",
             record=lambda: not isinstance(m.lm_head, torch.Tensor)),
        Knob(*_attr(engine, "_async"), lambda v, d: d and not v.endswith("-sync"), graphs=False,
             key="async_scheduling"),  # (not in graphs: no capture again)
    ]


def bench_multilora(run: Run, variants: list[str], dirs: list[Path]) -> None:
    """One engine for both variants, sized for the largest batch (all its adapters resident at once)."""
    a, batches = run.args, run.args.batches
    names = [f"a{i}" for i in range(max(batches))]
    failed: dict[str, str] = {}  # variant -> why its rows cannot run
    engine, info = None, {}
    lora_variants = [v for v in variants if "-lora" in v]
    lora_variant = lora_variants[0] if lora_variants else None
    try:
        engine = build_engine(run, lora=lora_variant is not None, fp8=variants[0].startswith("multilora-fp8"))
        st = engine.stats()
        seq_blocks = -(-(a.prompt_len + a.gen) // st["kv_block_size"])  # blocks one request needs at its end
        info = {"kv_seqs": st["kv_blocks_total"] // seq_blocks}  # (weight_bytes: per round, the head may be swapped)
        warm_up_engine(engine, run.prompts, None)
    except Exception as e:
        traceback.print_exc()
        failed = {v: f"engine setup failed: {type(e).__name__}: {e}"[:2000] for v in variants}
    if engine is not None and lora_variant is not None:
        try:
            info.update(load_engine_adapters(engine, names, dirs, a.load_threads, a.rank))
            warm_up_engine(engine, run.prompts, names)
        except Exception as e:  # the no-adapter rows can still run
            traceback.print_exc()
            failed.update({v: f"adapter setup failed: {type(e).__name__}: {e}"[:2000] for v in lora_variants})
    knobs = variant_knobs(engine, a)
    defaults = [k.get() for k in knobs]
    # --rounds: the variant list again, every other round in reverse, so each variant runs early and late
    schedule = [(rnd, v) for rnd in range(a.rounds) for v in (variants if rnd % 2 == 0 else variants[::-1])]
    try:
        for rnd, v in schedule:
            if v in failed:
                if rnd == 0:
                    run.skip(v, batches, a.gen, failed[v], status="error")
                continue
            want = [k.pick(v, d) for k, d in zip(knobs, defaults)]
            recapture = any(k.graphs and not k.same(k.get(), w) for k, w in zip(knobs, want))
            for k, w in zip(knobs, want):
                k.put(w)
            if recapture and engine.graphs is not None:  # captured graphs bake the changed knobs in: capture again
                engine.runner.reset_graphs()  # decode and piecewise
                try:  # (an engine without adapters has none loaded: warm it without)
                    warm_up_engine(engine, run.prompts, names if lora_variant is not None else None)
                except Exception as e:  # this variant's rows fail; the others still run
                    traceback.print_exc()
                    failed[v] = f"warm-up after re-capture failed: {type(e).__name__}: {e}"[:2000]
                    run.skip(v, batches, a.gen, failed[v], status="error")
                    continue
            m = engine.model
            row_info = {**info, "round": rnd, "weight_bytes": m.nbytes,
                        **{k.key: k.record() for k in knobs if k.key is not None}}
            for b in batches:
                adapters = names[:b] if "-lora" in v else None
                run.row(v, b, a.gen, lambda v=v, b=b, adapters=adapters, ri=row_info: multilora_row(run, engine, v, b,
                                                                                                   adapters, ri))
    finally:  # every knob as it was, whatever happened
        for k, d in zip(knobs, defaults):
            k.put(d)
    engine = None  # free it before the caller goes on (in-process runs)
    free_memory()
    if run.device.type == "cuda":  # the engine capped this process's allocator from its memory plan
        torch.cuda.set_per_process_memory_fraction(1.0, run.device.index if run.device.index is not None else torch.cuda.current_device())


def build_engine(run: Run, lora: bool, fp8: bool = False) -> Engine:
    a, maxb = run.args, max(run.args.batches)
    max_seq = a.prompt_len + a.gen + 8
    # KV: the engine's default cap (max_batch_size sequences of max_seq_len in whole blocks, + the null block);
    # adapter pool: room for every request's own adapter (a larger share than the default 10% of the budget)
    return Engine(run.config, device=run.device, dtype=run.dtype, progress=False, max_batch_size=maxb,
                  max_seq_len=max_seq, max_lora_rank=a.rank, adapter_slots=maxb if lora else 1,
                  adapter_pool_share=0.3 if lora else None, weight_dtype="fp8" if fp8 else None,
                  fp8_lm_head=False if fp8 else None,  # (the fp8 providers' head: variant_knobs swaps it in)
                  lora_side_stream_max_tokens=a.lora_side_stream_max_tokens)


def load_engine_adapters(engine: Engine, names: list[str], dirs: list[Path], threads: int, rank: int) -> dict:
    """Load adapter i from dirs[i % len(dirs)] (each name a distinct adapter: its own pages). When the pool
    holds them all, pin them, so that all are resident before any timed run; otherwise pin none (a pool full
    of pinned adapters would fail every other request) and let each row's warm-up make its adapters resident."""
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:  # load_adapter is thread-safe
        list(ex.map(lambda i: engine.load_adapter(names[i], dirs[i % len(dirs)]), range(len(names))))
    capacity = engine.stats()["pool_pages_total"] // max_adapter_pages(engine.pool.config, rank)
    info: dict[str, Any] = {"adapter_load_s": time.perf_counter() - t, "pool_adapters": capacity}
    if capacity < len(names):
        info["pin_error"] = (f"not pinned: the memory plan gave the pool {capacity} rank-{rank} adapters < {len(names)} "
                             f"(raise Engine(adapter_pool_share=...))")
        return info
    try:
        for n in names:
            engine.pin_adapter(n)
    except Exception as e:  # then they become resident on first use, in the warm-ups
        info["pin_error"] = f"{type(e).__name__}: {e}"
    return info


def warm_up_engine(engine: Engine, prompts: list[list[int]], names: list[str] | None) -> None:
    """First use of every kernel before timing: full prompts at a small batch, short ones at the largest
    (with names: every adapter once, so all are resident)."""
    def sp(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)

    n = len(names) if names is not None else len(prompts)
    small = min(n, 8 if names is not None else 2)
    engine.generate(prompts[:small], adapters=names[:small] if names else None, sampling=sp(4))
    engine.generate([p[:8] for p in prompts[:n]], adapters=names, sampling=sp(2))
    # every decode-graph bucket up to n: with chunked prefill a batch's requests start (and end) decoding a few
    # steps apart, so a timed run passes through smaller batch sizes, whose graphs would otherwise be captured
    # inside it (H200: +0.9 s in a 64-request run)
    graphs = getattr(engine, "graphs", None)
    for bk in (graphs.buckets if graphs is not None else []):
        if bk < n:
            engine.generate([p[:8] for p in prompts[:bk]], adapters=names[:bk] if names else None, sampling=sp(2))


@contextlib.contextmanager
def gc_pauses():
    """Python's cyclic collections while the block runs: yields ``{generation: [count, ms]}``, filled as they happen
    (``gc.callbacks``). A full (generation 2) collection walks every tracked object of the process: with torch,
    transformers and peft imported, hundreds of thousands; a step it lands in waits for it."""
    pauses: dict[int, list] = {}
    start = [0.0]

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            p = pauses.setdefault(info["generation"], [0, 0.0])
            p[0] += 1
            p[1] += (time.perf_counter() - start[0]) * 1e3

    gc.callbacks.append(cb)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(cb)


def multilora_row(run: Run, engine: Engine, provider: str, b: int, names: list[str] | None, info: dict) -> dict:
    loop = {}
    per_request: dict[int, list[float]] = {}  # output tokens -> each request's TPOT in the last run of that length

    def generate(n: int) -> list[list[int]]:
        outs = engine.generate(run.prompts[:b], adapters=names,
                               sampling=SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
        failed = [o.error for o in outs if o.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"{len(failed)} of {b} requests failed: {failed[0]}")
        loop[n] = engine.last_run["seconds"]
        per_request[n] = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) for o in outs
                          if o.first_token_time is not None and o.finish_time is not None and len(o.token_ids) > 1]
        return [o.token_ids for o in outs]

    generate(2)  # untimed: first use of this batch's shapes; makes its adapters resident
    before = engine.stats()
    if run.args.gc_freeze:  # (this process runs one group of rows and exits: nothing frozen outlives it)
        gc.collect()
        gc.freeze()
    mark = engine.step_times.observed
    with gc_pauses() as pauses:
        row, outs = measure(generate, b, run.args.gen, run.device, run.args.repeats, warmup=False)
    after = engine.stats()
    row["gc_pauses_ms"] = {str(g): [n, round(ms, 1)] for g, (n, ms) in sorted(pauses.items())}  # {gen: [count, ms]}
    # decode steps that carried the whole batch, timed one by one inside the timed runs: a TPOT estimate that the
    # prefill's run-to-run spread (in TTFT and T_total, which TPOT subtracts) does not reach
    steps = engine.step_times.since(mark)
    full = [sec for kind, rows, sec in steps if kind == "decode" and rows == b]
    row["decode_step_ms_p50"] = round(statistics.median(full) * 1e3, 4) if full else None
    row["decode_steps_full_batch"] = len(full)
    # TPOT within one run, request by request: (finish - first token) / (tokens - 1), as serving metrics define it
    tp = per_request.get(run.args.gen) or []
    row["tpot_in_run_ms"] = round(statistics.fmean(tp) * 1e3, 4) if tp else None
    # where a TPOT far above the step median comes from: the timed runs' slowest steps and the time by step kind
    row["slowest_steps"] = [[kind, rows, round(sec * 1e3, 2)] for kind, rows, sec in sorted(steps, key=lambda s: -s[2])[:4]]
    row["step_ms_by_kind"] = {k: round(sum(sec for kind, _, sec in steps if kind == k) * 1e3, 1)
                              for k in sorted({kind for kind, _, _ in steps})}
    if run.args.repeats == 1 and row.get("ttft_s") and row.get("total_s"):  # host time between and around steps
        row["ms_outside_steps"] = round((row["ttft_s"] + row["total_s"]) * 1e3 - sum(sec for _, _, sec in steps) * 1e3, 1)
    run.first_tokens[(provider, b)] = outs[0]
    row["first_request_tokens"] = outs[0]
    d = {k: after[k] - before[k] for k in ("decode_steps", "prefill_steps", "mixed_steps", "bytes_host_to_gpu",
                                           "bytes_disk_to_host")}
    distinct = len(set(names or []))
    row.update({"engine_loop_ttft_s": loop[1], "engine_loop_total_s": loop[run.args.gen],
                # timed runs: per repeat a 1-token and a gen-token run (gen - 1 decode steps if all ran at once)
                "decode_steps_per_full_run": d["decode_steps"] / run.args.repeats,
                "prefill_steps_per_run": d["prefill_steps"] / (2 * run.args.repeats),
                "mixed_steps_per_run": d["mixed_steps"] / (2 * run.args.repeats),  # chunked prefill: decodes + prompts
                "adapter_bytes_moved_in_timed_runs": d["bytes_host_to_gpu"] + d["bytes_disk_to_host"],
                "adapters_in_batch": distinct, "adapters_resident_at_start": before["adapters_per_tier"]["gpu"], **info})
    row.update(traffic({**row, "batch": b, "gen": run.args.gen}, info["weight_bytes"] - run.embed_bytes,
                       run.kv_token_bytes, run.args.prompt_len, adapter_bytes(run.config, run.args.rank, run.dtype),
                       distinct, run.meta["copy_gbps"], run.args.gen))
    waves = [f"the engine's KV cache holds {info['kv_seqs']} full-length requests"] if info["kv_seqs"] < b else []
    if distinct > info.get("pool_adapters", distinct):
        waves.append(f"its adapter pool holds {info['pool_adapters']} adapters")
    if waves:  # not every request in every step: per-step bytes and bandwidth do not apply
        row["note"] = f"{' and '.join(waves)} < batch {b}: requests ran in waves (only T_total and output tokens/s hold)"
        row.update({k: None for k in ("tpot_ms", "decode_tokens_per_s", "achieved_gbps", "frac_of_copy",
                                      "weights_frac_of_copy", "output_tokens_per_s_projected")})
    return row


# ----------------------------------------------------------------------------------- transformers, peft
#: ModelConfig.architecture -> transformers' config and model class names.
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
              "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}


def hf_llama_config(c: ModelConfig):
    """transformers' config of the same family and shape (sdpa attention; no end-of-sequence token: never stops
    early). Qwen2's q/k/v biases are implied by its class; Llama / Qwen3 biases come from ``attention_bias``."""
    import transformers

    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
              num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
              head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
              tie_word_embeddings=c.tie_word_embeddings, max_position_embeddings=c.max_position_embeddings,
              bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    if c.rope_scaling is not None:
        kw["rope_scaling"] = dict(c.rope_scaling)
    if c.architecture in ("llama", "qwen3"):
        kw["attention_bias"] = c.qkv_bias
    if c.architecture == "qwen2":
        kw.pop("head_dim")  # Qwen2Config derives it (hidden / heads)
    if c.architecture == "gemma2":  # eager attention: Gemma 2's only transformers path that soft-caps
        kw.update(attention_bias=c.qkv_bias, query_pre_attn_scalar=c.query_pre_attn_scalar,
                  attn_logit_softcapping=c.attn_logit_softcapping, final_logit_softcapping=c.final_logit_softcapping,
                  sliding_window=c.sliding_window, layer_types=c.layer_types, attn_implementation="eager")
    return getattr(transformers, HF_CLASSES[c.architecture][0])(**kw)


def build_hf(run: Run):
    """The HF ``*ForCausalLM`` of the config's family made directly on the device in the bench dtype (no CPU init), then given the
    engine's weights (``random_weights``, same seed): both providers run the same model."""
    import transformers

    before = torch.get_default_dtype()
    torch.set_default_dtype(run.dtype)
    try:
        with torch.device(run.device):
            model = getattr(transformers, HF_CLASSES[run.config.architecture][1])(hf_llama_config(run.config))
    finally:
        torch.set_default_dtype(before)
    weights = random_weights(run.config, dtype=run.dtype, device=run.device)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    del weights
    allowed = {"lm_head.weight"} if run.config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(f"HF model weights: missing {sorted(set(missing) - allowed)[:5]}, unexpected {unexpected[:5]}")
    model.eval().requires_grad_(False)
    return model


def hf_generate(model, ids: torch.Tensor, n: int, names: list[str] | None = None) -> list[list[int]]:
    kw = {} if names is None else {"adapter_names": names}
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, **kw)
    return out[:, ids.shape[1]:].tolist()


def hf_row(run: Run, model, provider: str, b: int, gen: int, weight_bytes: int, names: list[str] | None) -> dict:
    ids = torch.tensor(run.prompts[:b], device=run.device)
    row, outs = measure(lambda n: hf_generate(model, ids, n, names), b, gen, run.device, run.args.repeats)
    ours = run.first_tokens.get(("multilora" if names is None else "multilora-lora", b))
    row.update({"weight_bytes": weight_bytes, "adapters_in_batch": len(set(names or [])),
                "greedy_prefix_match_multilora": matching_prefix(ours, outs[0]), "first_request_tokens": outs[0]})
    row.update(traffic({**row, "batch": b, "gen": gen}, weight_bytes - run.embed_bytes, run.kv_token_bytes,
                       run.args.prompt_len, adapter_bytes(run.config, run.args.rank, run.dtype),
                       len(set(names or [])), run.meta["copy_gbps"], run.args.gen))
    return row


def load_peft(model, dirs: list[Path], n: int):
    """peft model with adapters a0..a{n-1} from the same files as multilora's (a<i> from dirs[i % len(dirs)]).
    Adapter weights stay in the model dtype (autocast_adapter_dtype=False), as in multilora's pool."""
    from peft import PeftModel

    pm = PeftModel.from_pretrained(model, str(dirs[0]), adapter_name="a0", autocast_adapter_dtype=False)
    for i in range(1, n):
        pm.load_adapter(str(dirs[i % len(dirs)]), adapter_name=f"a{i}", autocast_adapter_dtype=False)
    return pm.eval()  # peft refuses adapter_names= in training mode


def bench_hf_peft(run: Run, want_hf: bool, want_peft: bool, dirs: list[Path]) -> None:
    a = run.args
    try:
        hf_and_peft(run, want_hf, want_peft, dirs, [b for b in a.batches if b <= a.peft_max_batch])
    finally:
        if want_peft:
            run.skip("peft", [b for b in a.batches if b > a.peft_max_batch], a.peft_gen,
                     f"batch > --peft-max-batch {a.peft_max_batch} (peft's mixed batch loops over adapters per module)")


def hf_and_peft(run: Run, want_hf: bool, want_peft: bool, dirs: list[Path], peft_batches: list[int]) -> None:
    """One transformers model for both: hf rows on the base model, then peft wraps it (adapters injected in place)."""
    a, batches = run.args, run.args.batches
    wanted = ([("hf", batches, a.gen)] if want_hf else []) + ([("peft", peft_batches, a.peft_gen)] if want_peft else [])
    reason = run.budget_reason()
    if reason:
        for p, bs, g in wanted:
            run.skip(p, bs, g, reason)
        return
    try:
        t = time.perf_counter()
        model = build_hf(run)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        hf_generate(model, torch.tensor(run.prompts[:1], device=run.device), 2)  # warm-up
        info = {"hf_build_s": time.perf_counter() - t}
    except Exception as e:
        traceback.print_exc()
        for p, bs, g in wanted:
            run.skip(p, bs, g, f"transformers model setup failed: {type(e).__name__}: {e}"[:2000], status="error")
        free_memory()
        return
    if want_hf:
        for b in batches:
            run.row("hf", b, a.gen, lambda b=b: {**hf_row(run, model, "hf", b, a.gen, weight_bytes, None), **info})
    if want_peft and peft_batches:
        bench_peft(run, model, peft_batches, weight_bytes, dirs)
    model = None
    free_memory()


def bench_peft(run: Run, model, batches: list[int], weight_bytes: int, dirs: list[Path]) -> None:
    a = run.args
    reason = run.budget_reason()
    if reason:
        run.skip("peft", batches, a.peft_gen, reason)
        return
    try:
        t = time.perf_counter()
        pm = load_peft(model, dirs, max(batches))
        load_s = time.perf_counter() - t
        hf_generate(pm, torch.tensor(run.prompts[:1], device=run.device), 2, ["a0"])  # warm-up
    except Exception as e:
        traceback.print_exc()
        run.skip("peft", batches, a.peft_gen, f"peft setup failed: {type(e).__name__}: {e}"[:2000], status="error")
        free_memory()
        return
    for b in batches:
        names = [f"a{i}" for i in range(b)]
        run.row("peft", b, a.peft_gen, lambda b=b, names=names: {
            **hf_row(run, pm, "peft", b, a.peft_gen, weight_bytes, names), "peft_adapter_load_s": load_s})
    pm = None
    free_memory()


# ---------------------------------------------------------------------------------------- reporting
def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per (provider, batch), in first-seen order: where several rounds ran ok (``--rounds``), the median
    round by TPOT (of an even count, the slower of the middle two), so every field of the row comes from one real
    run and stays consistent with the others, plus ``rounds`` = how many ran ok, ``tpot_ms_rounds`` /
    ``ttft_s_rounds`` = each of those rounds' values in order, ``ttft_s_median`` = the median of the rounds' TTFTs
    (of an even count, the slower middle; the TTFT target's figure: the median round by TPOT is no median of TTFT,
    session 31: 1.13x by that round where the rounds' median was 1.10x), and a note when some rounds failed; a key
    with no ok row keeps its first row (skipped or error)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r.get("provider"), r.get("batch")), []).append(r)
    out = []
    for rs in groups.values():
        ok = [r for r in rs if r.get("status") == "ok"]
        if len(ok) < 2:
            out.append(ok[0] if ok else rs[0])
            continue
        by_tpot = sorted(ok, key=lambda r: math.inf if r.get("tpot_ms") is None else r["tpot_ms"])
        ttfts = sorted(r["ttft_s"] for r in ok if r.get("ttft_s") is not None)
        m = {**by_tpot[len(ok) // 2], "rounds": len(ok), "tpot_ms_rounds": [r.get("tpot_ms") for r in ok],
             "ttft_s_rounds": [r.get("ttft_s") for r in ok],
             "ttft_s_median": ttfts[len(ttfts) // 2] if ttfts else None}  # (of an even count, the slower middle)
        if len(ok) < len(rs):
            failed = f"{len(rs) - len(ok)} of {len(rs)} rounds did not run ok"
            m["note"] = f"{m['note']}; {failed}" if m.get("note") else failed
        out.append(m)
    return out


def targets(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(target, met / missed / not measured, the numbers) for the issue's three targets."""
    ok = {(r["provider"], r["batch"]): r for r in rows if r.get("status") == "ok"}
    out = []

    def verdict(x: float | None, need: float) -> str:
        return "not measured" if x is None else ("met" if x >= need else "missed")

    r = ok.get(("multilora", 1))
    f = r and r.get("weights_frac_of_copy")
    out.append(("batch 1, no adapters: weights read at >= 70% of copy bandwidth", verdict(f, 0.70),
                f"{f:.1%} ({r['weight_bytes_read'] / r['tpot_ms'] / 1e6:.4g} GB/s of weights, TPOT {r['tpot_ms']:.2f} ms)"
                if f is not None else ("no TPOT (see the row's note)" if r else "no multilora batch-1 row")))
    lo, pe, hf = (ok.get((p, TARGET_BATCH)) for p in ("multilora-lora", "peft", "hf"))
    x = lo and pe and lo.get("decode_tokens_per_s") and pe.get("decode_tokens_per_s") and \
        pe.get("output_tokens_per_s_projected") and lo["decode_tokens_per_s"] / pe["decode_tokens_per_s"]
    out.append((f"{TARGET_BATCH} requests on {TARGET_BATCH} adapters: >= 10x peft's mixed-batch tokens/s", verdict(x or None, 10),
                f"{x:.3g}x decode tokens/s ({lo['decode_tokens_per_s']:.0f} vs {pe['decode_tokens_per_s']:.1f}); "
                f"output tokens/s projected to gen {lo['gen']}: "
                f"{lo['output_tokens_per_s'] / pe['output_tokens_per_s_projected']:.3g}x" if x else "a row is missing"))
    x = lo and hf and lo.get("decode_tokens_per_s") and hf.get("decode_tokens_per_s") and \
        lo["output_tokens_per_s"] / hf["output_tokens_per_s"]
    out.append((f"{TARGET_BATCH} requests on {TARGET_BATCH} adapters: >= 3x transformers' base-model tokens/s",
                verdict(x or None, 3),
                f"{x:.3g}x output tokens/s ({lo['output_tokens_per_s']:.0f} vs {hf['output_tokens_per_s']:.0f}); "
                f"decode tokens/s {lo['decode_tokens_per_s'] / hf['decode_tokens_per_s']:.3g}x" if x else "a row is missing"))
    for v in ("multilora-lora", "multilora-lora-inplace", "multilora-lora-hiprio", "multilora-lora-onetile",
              "multilora-lora-s17tiles", "multilora-lora-nopdl", "multilora-lora-carve", "multilora-lora-lt",
              "multilora-lora-s25attn", "multilora-lora-zeroed", "multilora-lora-sidepf", "multilora-lora-sidepf0",
              "multilora-lora-nowideout", "multilora-lora-addafter", "multilora-lora-s29tiles", "multilora-lora-s30tiles",
              "multilora-lora-boundgrid", "multilora-lora-gridsplit", "multilora-lora-gemmfused",
              "multilora-lora-glushrink"):  # issue 12: adapters over base (-s25attn: over the base with that attention)
        base = "multilora-s25attn" if v.endswith("-s25attn") else "multilora"
        base_rows = {b: ok.get((base, b)) for b in (1, TARGET_BATCH)}
        for b, what, key, need in ((1, "TPOT", "tpot_ms", 1.05), (TARGET_BATCH, "TPOT", "tpot_ms", 1.30),
                                   (TARGET_BATCH, "TTFT", "ttft_s", 1.10)):
            lo, hi = base_rows.get(b), ok.get((v, b))
            if hi is None:
                continue
            if what == "TTFT" and lo and lo.get("ttft_s_median") and hi.get("ttft_s_median"):
                # with --rounds: the medians of the rounds' TTFTs (the median round by TPOT's TTFT in the numbers)
                x = hi["ttft_s_median"] / lo["ttft_s_median"]
                one = lo.get(key) and hi.get(key) and hi[key] / lo[key]
                out.append((f"{v} batch {b} on {b} adapters: {what} <= {need}x {base}'s",
                            "met" if x <= need else "missed",
                            f"{x:.3g}x by the rounds' median TTFT ({hi['ttft_s_median']:.4g} vs "
                            f"{lo['ttft_s_median']:.4g} s); the median-TPOT round's "
                            + (f"{one:.3g}x" if one else "not measured")))
                continue
            x = lo and lo.get(key) and hi.get(key) and hi[key] / lo[key]
            # TPOT's ratio, then the same ratio by the steadier per-step and per-request measures where both rows have them
            also = "".join(f"; {label} {hi[k] / lo[k]:.3g}x ({hi[k]:.4g} vs {lo[k]:.4g} ms)"
                           for k, label in (("decode_step_ms_p50", "full-batch decode step p50"),
                                            ("tpot_in_run_ms", "TPOT within the run"))
                           if what == "TPOT" and lo and lo.get(k) and hi.get(k))
            out.append((f"{v} batch {b} on {b} adapters: {what} <= {need}x {base}'s",
                        "not measured" if not x else ("met" if x <= need else "missed"),
                        (f"{x:.3g}x ({hi[key]:.4g} vs {lo[key]:.4g})" if x else "a row is missing") + also))
            # and against the base whose GEMMs take the same library (the carve-out's are cuBLASLt's too)
            lo = ok.get(("multilora-lt", b)) if v.endswith(("-lt", "-carve")) else None
            x = lo and lo.get(key) and hi.get(key) and hi[key] / lo[key]
            if x:
                out.append((f"{v} batch {b} on {b} adapters: {what} <= {need}x multilora-lt's",
                            "met" if x <= need else "missed", f"{x:.3g}x ({hi[key]:.4g} vs {lo[key]:.4g})"))
    for b, need in ((1, 1.7), (TARGET_BATCH, 1.3)):  # issue 16: fp8 base weights against bf16, decode tokens/s
        for base, fp8 in (("multilora", "multilora-fp8"), ("multilora-lora", "multilora-fp8-lora"),
                          ("multilora", "multilora-fp8-f16widen"), ("multilora", "multilora-fp8-bf16widen"),
                          ("multilora", "multilora-fp8-lmhead"), ("multilora", "multilora-fp8-bf16head"),
                          ("multilora", "multilora-fp8-onepassmax"), ("multilora", "multilora-fp8-sepquant"),
                          ("multilora", "multilora-fp8-shipped"), ("multilora", "multilora-fp8-nopad"),
                          ("multilora-s25attn", "multilora-fp8-s25attn"), ("multilora", "multilora-fp8-nopreload"),
                          ("multilora", "multilora-fp8-preload4"),
                          ("multilora-sync", "multilora-fp8-sync")):
            lo, hi = ok.get((base, b)), ok.get((fp8, b))
            if hi is None:
                continue
            x = lo and lo.get("decode_tokens_per_s") and hi.get("decode_tokens_per_s") and \
                hi["decode_tokens_per_s"] / lo["decode_tokens_per_s"]
            out.append((f"{fp8} batch {b}: >= {need}x {base}'s decode tokens/s", verdict(x or None, need),
                        f"{x:.3g}x ({hi['decode_tokens_per_s']:.0f} vs {lo['decode_tokens_per_s']:.0f}; TPOT "
                        f"{hi['tpot_ms']:.2f} vs {lo['tpot_ms']:.2f} ms)" if x else "a row is missing"))
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    """The table (one row per (provider, batch): ``merge_rounds``) and the targets, as markdown."""
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    rows = merge_rounds(rows)

    head = (f"{meta['shape']} ({meta['dtype']}), {meta['device']}, torch {meta['torch']}, transformers "
            f"{meta['transformers']}, peft {meta['peft']}; prompt {meta['prompt_len']}, rank {meta['rank']}; "
            f"copy bandwidth {meta['copy_gbps']:.0f} GB/s")
    if any(r.get("rounds") for r in rows):
        head += "; with --rounds: each row is the median round by TPOT, every round's TPOT in brackets"
    cols = ("provider", "batch", "gen", "TTFT s", "TPOT ms", "output tok/s", "decode tok/s", "GB/s", "% of copy",
            "weights % of copy", "status")
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def tpot(r):  # with rounds: the median round's, then (each round's in order)
        got = [v for v in r.get("tpot_ms_rounds") or [] if v is not None]
        return f(r.get("tpot_ms"), ".2f") + (f" ({' / '.join(format(v, '.2f') for v in got)})" if len(got) > 1 else "")

    for r in rows:
        why = r.get("error") or r.get("note")
        status = f"{r['status']}: {why[:100]}" if why else r["status"]
        frac = r.get("frac_of_copy")
        wfrac = r.get("weights_frac_of_copy")
        lines.append(f"| {r['provider']} | {r['batch']} | {r['gen']} | {f(r.get('ttft_s'), '.3f')} | "
                     f"{tpot(r)} | {f(r.get('output_tokens_per_s'), '.1f')} | "
                     f"{f(r.get('decode_tokens_per_s'), '.1f')} | {f(r.get('achieved_gbps'), '.4g')} | "
                     f"{f(frac and 100 * frac, '.1f')} | {f(wfrac and 100 * wfrac, '.1f')} | {status} |")
    lines += ["", "| target | result | numbers |", "|---|---|---|"]
    lines += [f"| {t} | **{v}** | {n} |" for t, v, n in targets(rows)]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    rows = merge_rounds(rows)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = (("output_tokens_per_s", "output tokens/s (batch x gen / T_total)", True),
              ("decode_tokens_per_s", "decode tokens/s (batch / TPOT)", True),
              ("frac_of_copy", "achieved bandwidth / copy bandwidth", False))
    for ax, (key, label, logy) in zip(axes, panels):
        for p in PROVIDERS:
            pts = [(r["batch"], r[key]) for r in rows if r["provider"] == p and r.get(key)]
            gens = sorted({r["gen"] for r in rows if r["provider"] == p and r.get(key)})
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{p} (gen {'/'.join(map(str, gens))})")
        ax.set_xscale("log")
        batches = sorted({r["batch"] for r in rows})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_locator(NullLocator())
        if logy:
            ax.set_yscale("log")
        else:
            ax.axhline(0.7, ls="--", c="gray", label="70% (batch-1 weights target)")
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta['shape']} {meta['dtype']}, prompt {meta['prompt_len']}, r={meta['rank']}, {meta['device']}, "
                 f"copy {meta['copy_gbps']:.0f} GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(device: torch.device) -> dict:
    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return {"device": name, "device_type": device.type, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": version("transformers"),
            "peft": version("peft"), "triton": version("triton"), "python": platform.python_version(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


# --------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--batches", default="1,8,64,256", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128, help="output tokens per request (>= 2)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS), help=f"any of {','.join(PROVIDERS)}")
    ap.add_argument("--peft-gen", type=int, default=16, help="output tokens per request for peft (>= 2; it is slow)")
    ap.add_argument("--peft-max-batch", type=int, default=64, help="peft rows above this batch are skipped")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--adapter-dir", help="where adapter files go (default: a temporary directory, removed at the end)")
    ap.add_argument("--adapter-files", type=int, default=64,
                    help="write K adapter directories; adapter a<i> loads from directory i %% K (every name is still a "
                         "distinct adapter to the engine and to peft: its own pages / LoRA modules); 0 = one per adapter")
    ap.add_argument("--load-threads", type=int, default=8, help="threads writing adapter files and calling load_adapter")
    ap.add_argument("--time-budget", type=float, default=480.0,
                    help="seconds from start after which no row starts (recorded as skipped)")
    ap.add_argument("--repeats", type=int, default=1, help="timed (TTFT, T_total) pairs per row; medians are reported")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the multilora group's providers this many times, every other round in reverse order "
                         "(rows carry 'round'); the table, targets and plot take each (provider, batch)'s median round "
                         "(row-to-row noise on an H200 is ~5%%, and the first variant after warm-up runs slower)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="before each multilora row's timed runs: gc.collect() and gc.freeze(), so Python's full "
                         "collections skip every object alive then (what vLLM and SGLang do in their engine "
                         "processes); rows record gc_pauses_ms either way")
    ap.add_argument("--seed", type=int, default=0, help="prompt token ids")
    ap.add_argument("--carveout", type=int, default=32, metavar="SMS",
                    help="multilora-lora-carve: SMs the base GEMMs of side-stream steps leave to the LoRA kernels")
    ap.add_argument("--lora-side-stream-max-tokens", type=int, default=None,
                    help="Engine(lora_side_stream_max_tokens=...) of the multilora rows (default: the engine's)")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in generate_<shape>.json (except those this run redoes) and add this "
                         "run's: for a run split over several calls (the table and plot then cover all rows)")
    ap.add_argument("--in-process", action="store_true",
                    help="run multilora and transformers/peft in this process (default: one child process each, so a "
                         "crash or a corrupted CUDA context in one cannot take the other's rows, and all GPU memory "
                         "is returned between them)")
    add_torch_threads_arg(ap)
    ap.add_argument("--child", choices=sorted(GROUPS), help=argparse.SUPPRESS)  # internal: run one group
    ap.add_argument("--child-state", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    except ValueError:
        ap.error(f"--batches: expected comma-separated batch sizes, got {args.batches!r}")
    if not args.batches:
        ap.error("--batches: expected at least one batch size, got none")
    args.providers = [p for p in args.providers.split(",") if p]
    bad = [p for p in args.providers if p not in PROVIDERS]
    if bad:
        ap.error(f"--providers: unknown {bad}; expected any of {list(PROVIDERS)}")
    if args.gen < 2 or args.peft_gen < 2:
        ap.error(f"--gen and --peft-gen must be >= 2 (TPOT needs a decode step), got {args.gen}, {args.peft_gen}")
    if min(args.batches) < 1 or args.prompt_len < 1 or args.rank < 1 or args.repeats < 1 or args.rounds < 1:
        ap.error(f"--batches, --prompt-len, --rank, --repeats and --rounds must be >= 1, got {args.batches}, "
                 f"{args.prompt_len}, {args.rank}, {args.repeats}, {args.rounds}")
    at_least(ap, ("--adapter-files", args.adapter_files, 0), ("--load-threads", args.load_threads, 1),
             ("--peft-max-batch", args.peft_max_batch, 0))
    if not args.time_budget > 0:
        ap.error(f"--time-budget: expected seconds > 0, got {args.time_budget}")
    context = ModelConfig(**MODEL_SHAPES[args.shape]).max_position_embeddings
    gen = max(args.gen, args.peft_gen if "peft" in args.providers else 0)
    if args.prompt_len + gen + 8 > context:  # (build_engine's max_seq_len)
        ap.error(f"--prompt-len / --gen: a request of {args.prompt_len} + {gen} tokens (+ 8 spare) is past the {args.shape} shape's context of {context} tokens: lower them")
    if args.device is not None:
        try:
            dev = torch.device(args.device)
        except (RuntimeError, ValueError) as e:
            ap.error(f"--device: expected cpu, cuda or cuda:N, got {args.device!r}")
        if dev.type not in ("cpu", "cuda"):
            ap.error(f"--device: expected cpu or cuda, got {args.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            ap.error(f"--device: {args.device!r} needs a CUDA GPU, and torch sees none")
    if not args.child:
        try:  # before any work: a run whose rows cannot be written is lost
            Path(args.out).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--out: cannot make the directory {args.out!r}: {e.strerror or e}")
    return args


def run_group(run: Run, group: str, dirs: list[Path]) -> None:
    want = [p for p in run.args.providers if p in GROUPS[group]]  # in the order asked for
    if group in ("multilora", "multilora-fp8"):
        if want:
            bench_multilora(run, want, dirs)
    else:
        bench_hf_peft(run, "hf" in want, "peft" in want, dirs)


def expected_rows(args: argparse.Namespace, group: str) -> list[tuple[str, int, int]]:
    return [(p, b, args.peft_gen if p == "peft" else args.gen)
            for p in GROUPS[group] if p in args.providers for b in args.batches]


def run_child(run: Run, group: str, argv: list[str], state: dict, state_path: Path) -> None:
    """Run one group in a child process (same arguments); rows it did not record become error rows."""
    reason = run.budget_reason()
    if reason is None:
        state["elapsed"] = time.perf_counter() - run.t0
        state_path.write_text(json.dumps(state))
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", group, "--child-state", str(state_path)]
        left = run.args.time_budget - state["elapsed"]
        try:
            ended = f"exit code {subprocess.run(cmd, check=False, timeout=max(60.0, left + 90)).returncode}"
        except subprocess.TimeoutExpired:
            ended = "killed after --time-budget + 90 s"
        try:
            run.rows = json.loads(run.path.read_text())
        except (OSError, ValueError) as e:
            print(f"cannot read {run.path} after the {group} process: {e}", flush=True)
        reason = f"the {group} process ended ({ended}) before this row; see its log above"
    done = {(r["provider"], r["batch"]) for r in run.rows}
    for p, b, g in expected_rows(run.args, group):
        if (p, b) not in done:
            run.skip(p, [b], g, reason, status="error" if "process ended" in reason else "skipped")


def setup(args: argparse.Namespace) -> tuple[torch.device, torch.dtype, ModelConfig, list[list[int]]]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = ModelConfig(**MODEL_SHAPES[args.shape])
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, config.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(max(args.batches))]
    return device, dtype, config, prompts


def child_main(args: argparse.Namespace) -> None:
    """One group's rows, appended to the parent's result file (the parent waits; nothing else writes it)."""
    state = json.loads(Path(args.child_state).read_text())
    device, dtype, config, prompts = setup(args)
    run = Run(args, config, device, dtype, prompts, state["meta"], Path(state["path"]),
              t0=time.perf_counter() - state["elapsed"])
    run.rows = json.loads(run.path.read_text())
    run.first_tokens = {(r["provider"], r["batch"]): r["first_request_tokens"] for r in run.rows if r.get("first_request_tokens")}
    run_group(run, args.child, [Path(d) for d in state["adapter_dirs"]])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    threads = set_torch_threads(args.torch_threads)  # (a child parses the same flags and sets its own)
    if args.child:
        return child_main(args)
    t0 = time.perf_counter()
    device, dtype, config, prompts = setup(args)
    copy_gbps, copy_how = copy_bandwidth(device)
    meta = {**environment(device), "bench": "generate", "shape": args.shape, "dtype": str(dtype).replace("torch.", ""),
            "model_config": {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                                             "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings")},
            "rank": args.rank, "prompt_len": args.prompt_len, "gen_requested": args.gen, "peft_gen": args.peft_gen,
            "copy_gbps": copy_gbps, "copy_method": copy_how,
            "timing": "perf_counter between torch.cuda.synchronize() calls (CUDA)",
            "hf_attention": "sdpa", "hf_cache": "DynamicCache (transformers' default)",
            "peft_adapters": "PeftModel.from_pretrained + load_adapter, autocast_adapter_dtype=False, adapter_names=",
            "isolation": "in-process" if args.in_process else "one child process per group (multilora; hf + peft)",
            "torch_threads": threads}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(args, config, device, dtype, prompts, meta, out / f"generate_{args.shape}.json", t0=t0)
    kept = []
    if args.append and run.path.is_file():
        redo = {(p, b) for g in GROUPS for p, b, _ in expected_rows(args, g)}
        kept = [r for r in json.loads(run.path.read_text()) if (r.get("provider"), r.get("batch")) not in redo]
        run.rows = kept
        run.first_tokens = {(r["provider"], r["batch"]): r["first_request_tokens"] for r in kept
                            if r.get("first_request_tokens")}
    run.path.write_text(json.dumps(kept, indent=1))
    print(f"copy bandwidth {copy_gbps:.0f} GB/s ({copy_how}); {meta['device']}, {meta['dtype']}", flush=True)

    temp = Path(tempfile.mkdtemp(prefix="multilora-bench-generate-"))
    root = Path(args.adapter_dir) if args.adapter_dir else temp / "adapters"
    try:
        dirs: list[Path] = []
        if any("-lora" in p for p in args.providers) or "peft" in args.providers:
            root.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            n = min(args.adapter_files or max(args.batches), max(args.batches))
            dirs = write_adapters(root, config, n, args.rank, dtype, threads=args.load_threads)
            run.meta.update(adapter_files=len(dirs), adapter_write_s=time.perf_counter() - t)
        state = {"meta": run.meta, "path": str(run.path), "adapter_dirs": [str(d) for d in dirs]}
        for group in GROUPS:
            if not expected_rows(args, group):
                continue
            if args.in_process:
                run_group(run, group, dirs)
            else:
                run_child(run, group, argv, state, temp / "state.json")
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        if run.rows:
            md = markdown(run.rows, run.meta)
            (out / f"generate_{args.shape}.md").write_text(md)
            print("\n" + md, flush=True)
            plot(run.rows, run.meta, out / f"generate_{args.shape}.png")
        print(f"done in {time.perf_counter() - t0:.0f} s: {run.path}", flush=True)
    mine = [r for r in run.rows if r not in kept]
    if mine and not any(r.get("status") == "ok" for r in mine):  # a run that measured nothing fails (CI, scripts)
        reasons = sorted({str(r.get("reason") or r.get("error") or r.get("status")) for r in mine})
        print(f"no row was measured ({len(mine)} errors or skips): " + "; ".join(reasons)[:2000], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (the rows measured so far are kept)
        print("\ninterrupted: the rows measured so far are in --out's generate_<shape>.json", file=sys.stderr)
        sys.exit(130)
