"""How big the adapter pool and the KV cache are: a pure function of the model shape, the engine options and a
memory snapshot, so every case can be checked on a CPU from a recorded snapshot.

    request = memory_request(model_config, engine_config, dtype=..., max_seq_len=...)   # bytes per adapter, block, ...
    sizes = size_engine(request, engine_config, snapshot, reserve_bytes=request.activation_bytes)
    sizes.num_pages, sizes.num_blocks, sizes.plan                                     # plan: multilora.memory.accounting

``measure_and_size`` is the engine's driver around it: it measures the two inputs that are not pure
(``multilora.memory.snapshot.take_snapshot``, and on CUDA a profiling forward of the largest prefill through
the runner for ``reserve_bytes``) and sizes twice on CUDA: once with the activation estimate, once with the
measured reserve.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

from multilora.config import TARGET_MODULES, ModelConfig
from multilora.memory.accounting import (MAX_BATCH_SIZE, USER_CAP, MemoryPlan, MemoryPlanError, MemoryPlanOptions,
                                         MemorySnapshot, compute_memory_plan, require_snapshot)
from multilora.memory.snapshot import apply_torch_memory_fraction, take_snapshot
from multilora.memory.kv_cache import PagedKVCache
from multilora.memory.pool import DEFAULT_MAX_SLOTS, PAGE_ELEMS, max_adapter_pages, scratch_elems, slot_table_bytes
from multilora.memory.unified import UnifiedLayout, unified_layout
from multilora.runtime.config import EngineConfig, finish_on_device

log = logging.getLogger("multilora")

#: Bytes of sampler workspace per logit with top-p (measured on an H200; ``multilora.runtime.sampling``).
SAMPLER_BYTES_PER_LOGIT = 36

#: Most slots a pool gets by default (``default_slots``); its metadata is 24 bytes per slot and (layer, module):
#: 22 MB for 4,096 slots of a 32-layer model.
MAX_DEFAULT_SLOTS = 4096
#: The small adapter the default slot count is sized for: rank 8 on q/k/v/o of every layer (S-LoRA's and issue
#: 13's "S1" set; 13.6 MB for Llama-3-8B in bf16).
SLOT_SIZING_RANK, SLOT_SIZING_MODULES = 8, ("q_proj", "k_proj", "v_proj", "o_proj")


def default_dtype(cfg: EngineConfig, device_type: str) -> torch.dtype:
    """The engine's compute dtype: ``cfg.dtype``, else bfloat16 on CUDA and float32 on the CPU."""
    return cfg.dtype or (torch.bfloat16 if device_type == "cuda" else torch.float32)


def default_max_seq_len(model: ModelConfig, cfg: EngineConfig, device_type: str) -> int:
    """The engine's longest sequence (prompt + output, tokens): ``cfg.max_seq_len``, else the model's
    ``max_position_embeddings`` capped at 2,048 on CUDA and 1,024 on the CPU (the KV cache holds ``max_batch_size``
    of them at most).

    Raises:
        ValueError: ``cfg.max_seq_len`` past the model's context (``model_context``: positions it was not trained
            or scaled for), naming ``max_seq_len``.
    """
    context = model_context(model)
    if cfg.max_seq_len is not None and cfg.max_seq_len > context:
        how = (f"max_position_embeddings={model.max_position_embeddings}" if context == model.max_position_embeddings
               else f"max_position_embeddings={model.max_position_embeddings} x its linear RoPE factor")
        raise ValueError(f"Engine: max_seq_len={cfg.max_seq_len} is past the model's context of {context} tokens "
                         f"({how} in its config); ask for at most {context}")
    return cfg.max_seq_len or min(model.max_position_embeddings, 2048 if device_type == "cuda" else 1024)


def model_context(model: ModelConfig) -> int:
    """The tokens the model's positions cover: ``max_position_embeddings``, times the factor of ``linear`` RoPE
    scaling, whose configs keep the original length there (HF's position interpolation; vLLM reads them so too).
    ``llama3`` and ``longrope`` configs already give the extended length."""
    if model.rope_type == "linear":
        return int(model.max_position_embeddings * float((model.rope_scaling or {}).get("factor", 1.0)))
    return model.max_position_embeddings


def weight_bytes(model: ModelConfig, dtype: torch.dtype, weight_dtype: str | None = None,
                 fp8_lm_head: bool | None = None) -> int:
    """Bytes of ``model``'s base weights as an engine stores them (``DecoderModel.nbytes``), from the shapes alone
    (``weights.weight_shapes``: fused projections or not, the same elements), all in ``dtype``. With
    ``weight_dtype="fp8"`` the projections take 1 byte per weight plus a float32 scale per output row
    (``kernels.fp8.Fp8Weight``), and so does an untied LM head unless ``fp8_lm_head`` is False (None: fp8 for an
    untied head, as ``EngineConfig.fp8_lm_head``); a tied head asked for in fp8 is a copy beside the table."""
    from multilora.runtime.weights import weight_shapes

    eb, fp8 = torch.empty((), dtype=dtype).element_size(), weight_dtype == "fp8"
    total = 0
    for name, shape, _ in weight_shapes(model):
        n = math.prod(shape)
        quantized = fp8 and (name.endswith("_proj.weight") or (name == "lm_head.weight" and fp8_lm_head is not False))
        total += n + 4 * shape[0] if quantized else n * eb
    if fp8 and fp8_lm_head and model.tie_word_embeddings:
        total += model.vocab_size * model.hidden_size + 4 * model.vocab_size
    return total


@dataclass(frozen=True)
class MemoryRequest:
    """What the engine asks of the memory plan, derived from the model and the options (all bytes).

    Attributes:
        page_bytes: one adapter-pool page, ``PAGE_ELEMS * dtype_bytes`` (64 elements: the pool's allocation unit,
            ``memory/pool.py``); ``pages_per_adapter`` pages hold the largest adapter ``max_lora_rank`` allows (every
            target module of every layer at ``max_lora_rank``): ``layers * sum over the target modules of
            ceil(max_lora_rank * (d_in + d_out) / PAGE_ELEMS)`` (``max_adapter_pages``).
        layers, module_width, dtype_bytes: the model's layers, the sum over the target modules of (d_in + d_out),
            the bytes of one element: the factors, for the messages.
        kv_token_bytes: K and V of one token over all layers; ``block_bytes = kv_token_bytes * kv_block_size``.
        seq_blocks: KV blocks of one ``max_seq_len`` sequence.
        pool_cap: the user's cap on the pool (``adapter_pool_bytes``, ``adapter_slots``), or None.
        pool_cap_rank: the largest rank whose largest adapter fits under ``pool_cap`` (``largest_rank_that_fits``),
            or None without a cap: what the too-small-pool message suggests.
        kv_cap: the cap on the KV cache: ``max_batch_size`` sequences + the null block, lowered by ``kv_cache_bytes``.
        kv_need: ``max_batch_size`` sequences + the null block: the most KV the engine can use.
        live_blocks: blocks of the live state the plan must fit (one sequence, or fewer under an explicit cap).
        activation_bytes: the estimated activations of the largest prefill + the sampler's reserve + (when adapters
            are finished on the device: ``adapter_finish="device"``, by default on CUDA) the adapter pool's scratch
            for finishing raw images in place (``multilora.memory.pool.scratch_elems``; 44 MB for Llama-3-8B at rank
            16 in bf16).
        sampling_bytes: float32 logits (eager and graph) + sampler workspace of a ``max_batch_size`` step.
        scratch_bytes: the adapter pool's scratch for finishing raw images on the device (0 when adapters are
            finished on the host): part of ``activation_bytes``, and added to the measured reserve on CUDA
            (``measure_and_size``), since the profiling forward does not allocate it.
        slot_table_bytes: the pool's device slot table (``memory.pool.slot_table_bytes``) for ``adapter_slots``
            slots, or ``MAX_DEFAULT_SLOTS`` (the most the default gives) without it: part of ``activation_bytes`` and
            of the measured reserve, as the scratch (the pool is made after the plan).
    """

    page_bytes: int
    pages_per_adapter: int
    layers: int
    module_width: int
    dtype_bytes: int
    kv_token_bytes: int
    block_bytes: int
    seq_blocks: int
    pool_cap: int | None
    pool_cap_rank: int | None
    kv_cap: int
    live_blocks: int
    activation_bytes: int
    sampling_bytes: int
    slot_sizing_pages: int = 0  # pages of the small adapter ``default_slots`` counts (``slot_sizing_pages``)
    kv_need: int = 0
    scratch_bytes: int = 0
    slot_table_bytes: int = 0


@dataclass(frozen=True)
class EngineSizes:
    """The sizing result: ``num_pages`` pool pages, ``num_blocks`` KV blocks (the null block included), the host
    tier's byte budget (None: unbounded), the pool's ``slots`` (``adapter_slots``, else ``default_slots``) and the
    memory plan they came from (None: no plan, sized from the caps)."""

    num_pages: int
    num_blocks: int
    host_bytes: int | None
    plan: MemoryPlan | None
    request: MemoryRequest
    slots: int = DEFAULT_MAX_SLOTS


def slot_sizing_pages(model: ModelConfig) -> int:
    """Pages of ``SLOT_SIZING_RANK`` on ``SLOT_SIZING_MODULES`` of every layer (the pool layout's count)."""
    return model.num_layers * sum(-(-SLOT_SIZING_RANK * sum(model.module_shape(m)) // PAGE_ELEMS)
                                  for m in SLOT_SIZING_MODULES)


def default_slots(small_pages: int, num_pages: int) -> int:
    """Slots of a pool of ``num_pages`` pages when ``adapter_slots`` is not given: as many as it holds of a small
    common adapter of ``small_pages`` pages (``slot_sizing_pages``: ``SLOT_SIZING_RANK`` on ``SLOT_SIZING_MODULES``
    of every layer), at least
    ``DEFAULT_MAX_SLOTS`` (256) and at most ``MAX_DEFAULT_SLOTS`` (4,096), so a pool sized for thousands of
    small adapters is not capped at 256 residents by its slot table. Example: Llama-3-8B in bf16 on an H200, the
    plan's default pool of ~11 GB: 11e9 / 13.6 MB ~ 800 slots."""
    return min(MAX_DEFAULT_SLOTS, max(DEFAULT_MAX_SLOTS, num_pages // max(1, small_pages)))


def memory_request(model: ModelConfig, cfg: EngineConfig, *, dtype: torch.dtype, max_seq_len: int,
                   device_type: str = "cpu") -> MemoryRequest:
    """The byte sizes the memory plan is asked for (pure).

    ``device_type`` ("cuda", "cpu", ...: the engine's device) decides ``adapter_finish=None``
    (``config.finish_on_device``): finishing raw images on the device adds the pool's scratch to the reserve.

    Raises:
        ValueError: ``kv_cache_bytes`` holds fewer than 2 KV blocks (block 0 is reserved).
    """
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    pages_per = max_adapter_pages(model, cfg.max_lora_rank)
    page_bytes = PAGE_ELEMS * dtype_bytes
    kv_token = PagedKVCache.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    block_bytes = kv_token * cfg.kv_block_size
    seq_blocks = -(-max_seq_len // cfg.kv_block_size)
    pool_cap = cfg.adapter_pool_bytes
    if cfg.adapter_slots is not None:
        slots_bytes = cfg.adapter_slots * pages_per * page_bytes
        pool_cap = slots_bytes if pool_cap is None else min(pool_cap, slots_bytes)
    kv_cap = kv_need = (cfg.max_batch_size * seq_blocks + 1) * block_bytes  # + the null block
    live_blocks = seq_blocks  # the plan's live state: one max_seq_len sequence (+ the null block)
    if cfg.kv_cache_bytes is not None:
        if cfg.kv_cache_bytes // block_bytes < 2:
            raise MemoryPlanError(
                f"Engine: kv_cache_bytes={cfg.kv_cache_bytes} holds {cfg.kv_cache_bytes // block_bytes} KV block(s) of "
                f"{block_bytes} bytes ({cfg.kv_block_size} tokens); at least 2 are needed (block 0 is reserved): raise "
                f"kv_cache_bytes to at least {2 * block_bytes} (block_bytes = 2 x layers x kv_heads x head_dim x dtype "
                f"bytes x kv_block_size)", needed_bytes=2 * block_bytes, fits_bytes=cfg.kv_cache_bytes, source=USER_CAP
            )
        kv_cap = min(kv_cap, cfg.kv_cache_bytes)
        live_blocks = min(live_blocks, kv_cap // block_bytes - 1)  # an explicit smaller cap is honoured
    sampling = cfg.max_batch_size * model.vocab_size * (4 + 4 + SAMPLER_BYTES_PER_LOGIT)
    scratch = scratch_elems(model, cfg.max_lora_rank) * dtype_bytes if finish_on_device(cfg, device_type) else 0
    slot_table = slot_table_bytes(model, cfg.adapter_slots if cfg.adapter_slots is not None else MAX_DEFAULT_SLOTS)
    return MemoryRequest(page_bytes=page_bytes, pages_per_adapter=pages_per, layers=model.num_layers,
                         module_width=sum(sum(model.module_shape(m)) for m in TARGET_MODULES),
                         dtype_bytes=dtype_bytes, kv_token_bytes=kv_token,
                         block_bytes=block_bytes, seq_blocks=seq_blocks, pool_cap=pool_cap,
                         pool_cap_rank=None if pool_cap is None else largest_rank_that_fits(
                             model, pool_cap, dtype_bytes, cfg.max_lora_rank),
                         kv_cap=kv_cap, kv_need=kv_need,
                         live_blocks=live_blocks,
                         activation_bytes=activation_bytes(model, cfg, dtype, max_seq_len) + sampling + scratch
                         + slot_table,
                         sampling_bytes=sampling, slot_sizing_pages=slot_sizing_pages(model), scratch_bytes=scratch,
                         slot_table_bytes=slot_table)


def activation_bytes(model: ModelConfig, cfg: EngineConfig, dtype: torch.dtype, max_seq_len: int) -> int:
    """Bytes of activations of the largest prefill (``max_prefill_tokens`` tokens), from the layer shapes: the
    residual stream, norms, q/k/v, the MLP's gate/up and one padded score matrix of the longest prompt."""
    c, T = model, min(cfg.max_prefill_tokens, max_seq_len)
    per_token = 4 * c.hidden_size + 2 * (c.q_size + 2 * c.kv_size) + 3 * c.intermediate_size
    attn = c.num_heads * T * T
    return (T * per_token + attn) * torch.empty((), dtype=dtype).element_size()


def plan_options(request: MemoryRequest, cfg: EngineConfig, reserve_bytes: int) -> MemoryPlanOptions:
    """The memory plan's options for ``request`` with ``reserve_bytes`` of non-KV working memory (pure). The
    model weights are resident when the snapshot is taken, so they are not added to the reserve."""
    kw = {} if cfg.adapter_pool_share is None else {"adapter_pool_share": float(cfg.adapter_pool_share)}
    return MemoryPlanOptions(
        fraction=cfg.gpu_memory_fraction,
        non_kv_reserve_bytes=reserve_bytes,
        min_adapter_pool_bytes=request.pages_per_adapter * request.page_bytes,
        min_kv_bytes=(request.live_blocks + 1) * request.block_bytes,  # whole blocks, the null block included
        max_adapter_pool_bytes=request.pool_cap,
        # adapter_pool_fill: what KV cannot use goes to the pool (kv_need); kv_cache_bytes stays a plain cap
        max_kv_bytes=cfg.kv_cache_bytes if cfg.adapter_pool_fill else request.kv_cap,
        kv_need_bytes=request.kv_need if cfg.adapter_pool_fill else None,
        # a cap of max_batch_size sequences is the engine's bound, not the user's (the plan names it so)
        max_kv_source=USER_CAP if cfg.adapter_pool_fill or request.kv_cap < request.kv_need else MAX_BATCH_SIZE,
        host_tier_bytes=cfg.host_adapter_bytes,
        local_ranks=cfg.local_ranks,
        **kw,
    )


def largest_rank_that_fits(model: ModelConfig, pool_bytes: int, dtype_bytes: int, max_rank: int) -> int:
    """The largest rank ``r <= max_rank`` whose largest adapter (every module of every layer at r) fits in
    ``pool_bytes``; 0 if none does."""
    page_bytes = PAGE_ELEMS * dtype_bytes
    lo, hi = 0, max_rank  # max_adapter_pages grows with the rank: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if max_adapter_pages(model, mid) * page_bytes <= pool_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def pool_below_one_adapter(r: MemoryRequest, cfg: EngineConfig) -> MemoryPlanError:
    """The error for an ``adapter_pool_bytes`` cap below the largest adapter ``max_lora_rank`` allows: what to change
    (Engine keyword and CLI flag) and how the bytes were computed. Only this cap can be the cause: ``adapter_slots``
    >= 1 holds one adapter, and the plan lifts its share of the budget (``adapter_pool_share`` of
    ``gpu_memory_fraction`` x usable memory) to one adapter."""
    need, R = r.pages_per_adapter * r.page_bytes, cfg.max_lora_rank
    per_layer = r.pages_per_adapter // r.layers
    fit = r.pool_cap_rank
    rank = (f" or lower max_lora_rank to at most {fit} (Engine(max_lora_rank=...), --max-lora-rank)" if fit else "")
    return MemoryPlanError(
        f"Engine: adapter_pool_bytes={cfg.adapter_pool_bytes} is below the largest adapter max_lora_rank={R} allows "
        f"(rank {R} on all {len(TARGET_MODULES)} target modules of all {r.layers} layers), which needs {need} bytes = "
        f"layers {r.layers} x sum over the target modules of ceil(max_lora_rank {R} x (d_in + d_out) / {PAGE_ELEMS}) "
        f"{per_layer} pages x page bytes {r.page_bytes} ({PAGE_ELEMS} elements x dtype bytes {r.dtype_bytes}) "
        f"(its weight bytes, {R} x {r.module_width} x {r.layers} x {r.dtype_bytes} = "
        f"{R * r.module_width * r.layers * r.dtype_bytes}, rounded up to whole pages per module). Raise "
        f"adapter_pool_bytes to at least {need} (Engine(adapter_pool_bytes=...), or the --adapter-pool-bytes of "
        f"multilora generate and serve){rank}. (adapter_slots, adapter_pool_share and gpu_memory_fraction are not the "
        f"cause: each leaves room for one adapter at least.)",
        needed_bytes=need, fits_bytes=r.pool_cap, source=USER_CAP)


def check_pool_cap(r: MemoryRequest, cfg: EngineConfig) -> None:
    """Raise ``pool_below_one_adapter``'s MemoryPlanError if ``adapter_pool_bytes`` holds fewer pages than the
    largest adapter ``max_lora_rank`` allows: from the config alone, so an engine checks it before loading weights."""
    if r.pool_cap is not None and r.pool_cap // r.page_bytes < r.pages_per_adapter:
        raise pool_below_one_adapter(r, cfg)


def plan_config(cfg: EngineConfig) -> EngineConfig:
    """The config the memory plan sizes for: with tensor parallelism each rank shares the host as a local rank
    (``local_ranks`` x ``tensor_parallel_size``)."""
    tp = cfg.tensor_parallel_size
    return cfg if tp == 1 else replace(cfg, local_ranks=cfg.local_ranks * tp)


def size_engine(request: MemoryRequest, cfg: EngineConfig, snapshot: MemorySnapshot | None, *,
                reserve_bytes: int) -> EngineSizes:
    """Pool pages and KV blocks from the memory plan of ``snapshot`` (pure; ``snapshot=None``: no plan, the caps
    alone, with 8 max-rank adapters when the pool has no cap).

    Raises:
        MemoryPlanError: the live state (one max-rank adapter + KV of one sequence) does not fit
            (``multilora.memory.accounting``; the message says what would fit and which source bound it).
        MemoryPlanError: ``adapter_pool_bytes`` holds fewer bytes than the largest max-rank adapter
            (``pool_below_one_adapter``).
        ValueError: the KV cache gets fewer than 2 blocks.
    """
    r = request
    check_pool_cap(r, cfg)
    plan = None if snapshot is None else compute_memory_plan(snapshot, plan_options(request, cfg, reserve_bytes))
    pool_bytes = plan.adapter_pool_bytes if plan is not None else (r.pool_cap or 8 * r.pages_per_adapter * r.page_bytes)
    num_pages = pool_bytes // r.page_bytes
    assert num_pages >= r.pages_per_adapter, "the plan holds its pool to one max-rank adapter at least"
    num_blocks = (plan.kv_bytes if plan is not None else r.kv_cap) // r.block_bytes  # the null block included
    if num_blocks < 2:
        raise MemoryPlanError(
            f"Engine: the KV cache gets {num_blocks} block(s) of {r.block_bytes} bytes ({cfg.kv_block_size} tokens); "
            f"at least 2 are needed (block 0 is reserved): raise kv_cache_bytes",
            needed_bytes=2 * r.block_bytes, fits_bytes=num_blocks * r.block_bytes,
            source=plan.kv_source if plan is not None else USER_CAP)
    host = cfg.host_adapter_bytes if cfg.host_adapter_bytes is not None else (plan.host_tier_bytes if plan else None)
    slots = cfg.adapter_slots if cfg.adapter_slots is not None else default_slots(r.slot_sizing_pages, num_pages)
    return EngineSizes(num_pages=num_pages, num_blocks=num_blocks, host_bytes=host, plan=plan, request=request,
                       slots=slots)


def unified_sizes(sizes: EngineSizes, cfg: EngineConfig) -> tuple[UnifiedLayout, int]:
    """With ``unified_pool``: the one buffer for ``sizes``' pool and KV cache (``memory.unified.unified_layout``: the
    same bytes in whole KV-block units, the pool starting at its planned share) and the pool's slots (``adapter_slots``,
    else ``default_slots`` of the most pages the pool can grow to: all but the null block and the live state's KV,
    ``live_blocks``: one ``max_seq_len`` sequence, fewer under a smaller ``kv_cache_bytes``).

    Raises:
        ValueError: a KV block that is not a whole number of pool pages, or too few units (``unified_layout``).
    """
    r = sizes.request
    layout = unified_layout(pool_bytes=sizes.num_pages * r.page_bytes, kv_bytes=sizes.num_blocks * r.block_bytes,
                            block_bytes=r.block_bytes, page_bytes=r.page_bytes,
                            min_pool_bytes=r.pages_per_adapter * r.page_bytes, min_kv_blocks=r.live_blocks)
    slots = sizes.slots if cfg.adapter_slots is not None else default_slots(
        r.slot_sizing_pages, layout.max_pool_pages)
    return layout, slots


def recorded_snapshot(cfg: EngineConfig) -> MemorySnapshot:
    """``cfg.memory_snapshot``, checked: a ``MemorySnapshot`` (its fields are checked when it is made).

    Raises:
        MemorySnapshotError: it is something else (a dict, a path, ...).
    """
    return require_snapshot(cfg.memory_snapshot, "Engine(memory_snapshot=...)")


def measure_and_size(request: MemoryRequest, cfg: EngineConfig, device: torch.device, *,
                     profile_reserve: Callable[[], int]) -> EngineSizes:
    """Size an engine on this machine (after its weights are loaded): a snapshot (``cfg.memory_snapshot`` or this
    machine's), then ``size_engine``. On CUDA the PyTorch memory-fraction cap is set from the plan, the caller's
    ``profile_reserve()`` (a forward of the largest prefill) measures the non-KV reserve, and the plan is made
    again with it. Where host memory cannot be measured (no /proc/meminfo: not Linux), a CPU engine is sized
    from the options alone. Raises as ``size_engine``, and MemorySnapshotError for a ``cfg.memory_snapshot``
    that is not a ``MemorySnapshot``."""
    def snapshot() -> MemorySnapshot:
        return recorded_snapshot(cfg) if cfg.memory_snapshot is not None else take_snapshot(device)

    try:
        sizes = size_engine(request, cfg, snapshot(), reserve_bytes=request.activation_bytes)
    except MemoryPlanError:
        if device.type == "cpu" and not os.path.exists("/proc/meminfo"):
            log.warning("memory plan: host memory cannot be measured here; sizing from the Engine arguments")
            return size_engine(request, cfg, None, reserve_bytes=0)
        raise
    if device.type == "cuda":
        apply_torch_memory_fraction(sizes.plan, device)
        reserve = profile_reserve() + request.sampling_bytes + request.scratch_bytes + request.slot_table_bytes
        sizes = size_engine(request, cfg, snapshot(), reserve_bytes=reserve)
        apply_torch_memory_fraction(sizes.plan, device)
    return sizes


#: The most host-arena bytes an engine maps ahead by default (``default_map_ahead_bytes``): what was measured on an
#: H200 (session 22, ``bench/bench_adapter_throughput.py --host-map-ahead 8`` at 2,048 adapters, where one batch's
#: new adapters were 2.9 GB).
DEFAULT_MAP_AHEAD_CAP = 8_000_000_000


def default_map_ahead_bytes(device_type: str, plan_kind: str | None, pool_bytes: int, host_bytes: int | None) -> int:
    """The host-arena bytes mapped ahead once the registered adapters outgrow the GPU pool
    (``EngineConfig.host_arena_map_ahead_bytes=None``): ``min(pool_bytes, host_bytes, DEFAULT_MAP_AHEAD_CAP)`` on a
    discrete CUDA GPU (``plan_kind`` "discrete", or None without a memory plan), the tier filling at up to a pool's
    worth of adapters; 0 on the CPU and on integrated GPUs, whose host memory is the device's too (pinning it ahead
    would take it from the KV cache and the pool)."""
    if device_type != "cuda" or plan_kind not in (None, "discrete"):
        return 0
    return max(0, min(pool_bytes, DEFAULT_MAP_AHEAD_CAP, host_bytes if host_bytes is not None else pool_bytes))
