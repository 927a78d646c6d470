"""How an engine is built and runs: ``EngineConfig``, one dataclass for every ``Engine(...)`` keyword.

    Engine(model, max_batch_size=64, kv_block_size=16)          # keywords: an EngineConfig is built from them
    Engine(model, config=EngineConfig(max_batch_size=64))       # the same
    EngineConfig.add_cli_flags(parser); EngineConfig.from_cli(args)   # the CLI's engine flags, made from the fields

Values are validated when the config is made (``__post_init__``), before any model is loaded. The model
configuration lives in ``multilora.config`` (shared with ``memory/``); it is re-exported here so
``multilora.runtime.config.ModelConfig`` keeps working.
"""

from __future__ import annotations

import argparse
import logging
import re
import unicodedata
from dataclasses import MISSING, dataclass, field, fields
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from multilora.config import MODULE_INDEX, MODULE_PARENT, TARGET_MODULES, ModelConfig

if TYPE_CHECKING:  # pragma: no cover  (torch is imported only to check a dtype: the CLI parser stays light)
    import torch

__all__ = ["EngineConfig", "MODULE_INDEX", "MODULE_PARENT", "TARGET_MODULES", "ModelConfig"]

_DTYPES = ("float32", "float16", "bfloat16")
_BACKENDS = ("torch", "triton")


#: the largest byte count a flag takes: ``multilora.memory.accounting.MAX_MEASURED_BYTES`` (2^64 - 1, the most the
#: kernel and CUDA can report), repeated here so that importing the config (and the CLI parser) does not load torch
MAX_BYTE_COUNT = (1 << 64) - 1

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_BYTES = re.compile(r"^\s*((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512MiB', '1.5G', '4096', '2,010,458,972 B' (thousands separated by commas, as
    ``multilora memory`` prints its byte counts; exact: a decimal is not read as a float; a fraction of a byte that a
    unit leaves is dropped).

    Raises ValueError on anything else, a decimal without a unit ('1.5'), or a count above 2^64 - 1 (16 EiB).
    """
    m = _BYTES.match(text)
    unit = m.group(2).lower() if m else None
    shown = repr(text[:40]) + ("..." if len(text) > 40 else "")
    if m is None or unit not in _UNITS:
        raise ValueError(f"expected a byte count like 4096, 512MiB or 2GiB, got {shown}")
    if _UNITS[unit] == 1 and "." in m.group(1):  # (1.5 bytes: a unit was probably meant; 1.5GiB is whole bytes)
        raise ValueError(f"expected a whole number of bytes (or a unit: 1.5GiB), got {shown}")
    value = int(Fraction(m.group(1).replace(",", "")) * _UNITS[unit]) if len(m.group(1)) <= 40 else None
    if value is None or value > MAX_BYTE_COUNT:
        raise ValueError(f"expected a byte count below 2^64 (16 EiB), got {shown}")
    return value


def bytes_arg(text: str) -> int:
    """``parse_bytes`` as an argparse ``type`` (its error as argparse's)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _opt(default: Any, help: str, *, cli: bool = True, choices: tuple[str, ...] | None = None, kind: type | None = None):
    """A field with its CLI flag's help text (``cli=False``: no flag, the value is not a plain string/number)."""
    return field(default=default, metadata={"help": help, "cli": cli, "choices": choices, "kind": kind})


@dataclass
class EngineConfig:
    """Everything an ``Engine`` is built with, besides the model.

    Attributes:
        device: "cuda", "cpu", ... (None: CUDA when available).
        dtype: compute dtype, a ``torch.dtype`` or "float32" / "float16" / "bfloat16" (None: bfloat16 on CUDA,
            float32 on CPU).
        weight_dtype: None (base weights in ``dtype``) or "fp8": the base projections (q/k/v, o, gate/up, down) as
            float8 e4m3 with per-output-channel scales, quantized at load (``multilora.kernels.fp8``; CUDA compute
            capability 8.9+, or the CPU); LoRA, embeddings, norms and activations stay in ``dtype``, and the LM head
            too unless ``fp8_lm_head`` (by default an untied head is fp8).
        fp8_lm_head: with ``weight_dtype="fp8"``, the LM head too as float8 e4m3 with per-row scales. None (the
            default) = on exactly when the model has a head of its own (untied embeddings, as Llama-3-8B): it then
            replaces the ``dtype`` head, halving its bytes read per decode step (Llama-3-8B: 1.05 GB -> 0.53 GB) and
            its memory, at one more GEMM's fp8 rounding in the logits (relative error against the bf16 engine 0.1330
            -> 0.1356 on the GPU test model; ``bench/results/fp8/README.md``); with tied embeddings off, since the
            embedding table stays in ``dtype`` and the fp8 copy would be extra memory (vocab x hidden bytes). True /
            False force it (True needs ``weight_dtype="fp8"``).
        fp8_gemm: the fp8 GEMM: "scaled_mm" (per-token fp8 activations, ``torch._scaled_mm``), "weight_only" (bf16
            activations, fp8 weights widened in a Triton kernel), or None = weight_only for decode-sized steps on
            CUDA, scaled_mm otherwise (``multilora.kernels.fp8``).
        max_batch_size: most requests running at once.
        max_seq_len: most tokens (prompt + generated) per request; None = min(model context, 2048 on GPU,
            1024 on CPU). At most the model's context (``max_position_embeddings``): more is refused when the engine
            starts, before the weights load.
        kv_block_size: tokens per KV-cache block (``multilora.memory.kv_cache``).
        max_lora_rank: largest adapter rank accepted by ``load_adapter``.
        adapter_slots: at most this many adapters resident at once (the pool's slots), and a cap on the pool's
            bytes at this many of the largest ``max_lora_rank`` adapters. Default: as many as the planned pool holds
            of rank-8 q/k/v/o adapters, between 256 and 4,096 (``runtime.sizing.default_slots``).
        adapter_pool_bytes: cap on the adapter pool's bytes. The pool takes the memory plan's share
            (``multilora.memory.accounting``), lowered by these caps, in whole pages of 64 elements; it must hold at
            least the largest adapter ``max_lora_rank`` allows (every target module of every layer at that rank).
        kv_cache_bytes: cap on the KV cache's bytes. The cache takes the memory plan's KV share, lowered by this
            cap and by ``max_batch_size`` sequences of ``max_seq_len`` tokens, in whole blocks; the reserved null
            block (block 0) is counted in these bytes. A cap below one ``max_seq_len`` sequence is honoured:
            requests that could never fit are then rejected at submission. When running requests need more
            blocks than are free, the newest are preempted and recomputed later (``multilora.runtime.scheduler``).
        host_adapter_bytes: explicit host-tier size, passed to the memory plan (which rejects one that
            over-commits a shared-memory device); None = the plan's automatic size.
        host_arena_map_ahead_bytes: bytes of the host tier's pinned arena mapped (and page-locked) on a background
            thread, in whole chunks, up to the tier's size (``HostArena.map_ahead``), so that a tier filling fast
            (thousands of adapters) never waits for a chunk to be mapped on the step thread. None (default): on a
            discrete CUDA GPU, ``min(pool bytes, host tier, 8 GB)`` once the registered adapters' bytes first exceed
            the GPU pool's (``AdapterCache(map_ahead_on_overflow=)``; an engine whose adapters fit its pool maps
            nothing ahead); elsewhere 0. 0: chunks are mapped as adapters need them, a chunk ahead
            (``HostArena.grow_ahead``). n > 0: n bytes from the engine's start. Measured on an H200 (session 22,
            ``bench_adapter_throughput.py`` at 2,048 adapters, 8 GB ahead vs 0, interleaved): 34.2 / 29.9% vs 25.3 /
            27.9% of the no-adapter tokens/s cold, 48.1 / 43.8% vs 36.7 / 36.0% warm; the step thread's waits for a
            chunk (10-23% of its samples) went to none.
        host_arena_chunk_bytes: bytes of one chunk of the host tier's arena (None: ``DEFAULT_CHUNK_BYTES``, 1 GiB;
            always at least one image of the largest adapter ``max_lora_rank`` allows). On CUDA each chunk is
            page-locked by one ``cudaHostRegister``, which takes ~0.1-0.2 s per GiB and, by reports of other engines
            (vLLM issue 42632: "pin in small chunks ... so we're not holding the heavy lock for long"), holds up the
            other threads' CUDA calls meanwhile: smaller chunks hold the step thread up for less at a time, in more
            registrations, and waste up to one image's bytes more per chunk (a block never spans two chunks).
            Measured on an H100 (session 40, S4 at 2,000 adapters, same rate): 1 GiB chunks held 6 steps up for
            202-272 ms (1.29 s in all), 256 MiB ones 20 steps for 66-136 ms (1.78 s) with fewer requests within the
            SLO (83.8% against 90.2%): registration costs less per byte in big chunks.
        gpu_memory_fraction: share of usable device memory the plan may budget, in (0, 1].
        local_ranks: engine processes sharing this device/host (the plan divides host memory by it).
        tensor_parallel_size: ranks the model is split over (``runtime.parallel``: Megatron-style shards, one
            process per rank, rank r on ``cuda:r``, gloo on the CPU); 1 = no tensor parallelism. Each rank's memory
            plan counts ``local_ranks * tensor_parallel_size`` processes on the host.
        memory_snapshot: a recorded ``MemorySnapshot`` to plan from instead of measuring this machine
            (replaying a user's machine; tests).
        page_rows: ignored (accepted so existing callers and ``--page-rows`` keep working). It was the rank-rows per
            pool page of the fixed-page pool; the pool now stores each adapter at its exact size in pages of 64
            elements (``multilora.memory.pool``), so there is nothing to choose.
        max_prefill_tokens: most prompt tokens computed in one step (a preempted request recomputes its prompt and
            generated tokens). With chunked prefill: the cap on a step's prompt chunks, and the default of
            ``max_num_batched_tokens``; without: the most tokens of the prompts admitted in one prefill step (the
            first request of a step is admitted whatever its length).
        enable_chunked_prefill: chunked prefill (default on; ``multilora.runtime.scheduler``): one step carries the
            decode token of every running request AND chunks of prompts, under ``max_num_batched_tokens``, so a
            long prompt never stops running requests; decode-only steps keep their CUDA graphs, mixed steps replay
            piecewise graphs (``piecewise_cuda_graph_max_tokens``). Off: a step is a prefill (every decode waits) or a decode, as before.
        max_num_batched_tokens: with chunked prefill, the step's token budget (vLLM's name): decode tokens first
            (one per running request, never held back, even beyond the budget), then prompt chunks in the rest, at
            most ``max_prefill_tokens`` and at least one token. None = ``max_prefill_tokens``. Smaller: steps of
            steadier length (lower TPOT tail), a long prompt's first token later.
        starvation_patience: steps a waiting request may be passed over before nothing behind it is admitted
            (the scheduler's no-starvation bound, ``multilora.runtime.scheduler``).
        prefetch_adapters: how many not-yet-resident adapters of waiting requests to start prefetching per step
            (reads already in flight do not count).
        adapter_io_threads: threads of the adapter cache that read adapters from disk (default 4). On the H200
            host (16 cores) the host-finished read (``adapter_finish="host"``) of Llama-3-8B rank-16 adapters gave
            6.9 GB/s on 4 threads and 10.3 on 8 (bench/README.md, "Session 12"); the engine's own thread shares the
            GIL with them, so more is not always faster for the steps: measure with your traffic.
        gil_switch_interval: seconds passed to ``sys.setswitchinterval`` while the engine lives (restored by
            ``Engine.close`` if still set): how long a thread that wants Python's GIL back (the engine's step thread,
            after a CUDA call or a wait) may wait behind a thread holding it (the cache's I/O threads). Python's
            default, 5 ms, let the step thread wait behind the I/O threads for seconds per step while adapters were
            read: in the one-batch bench at 2,048 adapters (H200, one call) 0.5 ms gave 41.6% of the no-adapter
            throughput against 26.1% (warm; cold 18.2% against 11.2%), and 36.5% against 9.0% with
            ``adapter_finish="device"`` (bench/README.md, "Session 13"). None or 0: leave the interpreter's setting.
        adapter_aware_admission: with prefetch on, a waiting request whose adapter is still on the disk tier is
            passed over (until it is urgent, ``starvation_patience``) while requests behind it whose adapters are
            resident or in host memory are admitted, instead of reading its files inside a step
            (``multilora.runtime.scheduler``, "Adapter-aware admission").
        max_waiting_requests: most requests waiting at once; ``add_request`` beyond it raises
            ``EngineOverloadedError`` (a server answers 429) instead of queueing without bound; ``generate`` raises it
            only when the queue is full as the call begins, and otherwise queues its prompts as room frees.
        lora_backend: "torch", "triton" or None (triton on CUDA when available).
        attention_backend: the paged-attention backend, "torch", "triton" or None (triton on CUDA when
            available; ``multilora.kernels.attention``).
        lora_side_stream_max_tokens: steps of at most this many tokens compute each projection's LoRA on a side
            CUDA stream while the base GEMM runs, into a buffer the op after the projection adds (RoPE + KV write,
            the residual add + RMSNorm, the gated activation), so at decode LoRA costs little time of its own
            (``runtime.model.LORA_SIDE_MAX_TOKENS``, measured in ``bench/bench_lora_overlap.py``); 0 = LoRA added in
            place after each GEMM. None: on CUDA 64 for a pool of rank <= 16 (``max_lora_rank``) and 2 for larger
            ranks, where the concurrent LoRA kernels slow the GEMMs more than they save; 0 elsewhere (off the GPU a
            value > 0 runs the same deferred adds on the one stream).
        cuda_graphs: replay decode steps from CUDA graphs, one per batch-size bucket
            (``multilora.runtime.cuda_graphs``); used on CUDA when both backends are Triton, ignored elsewhere.
        piecewise_cuda_graph_max_tokens: with ``cuda_graphs``, prefill and mixed steps of at most this many tokens
            replay CUDA graphs piecewise: everything of a layer but attention is captured per token bucket and
            attention runs eagerly between the pieces (``multilora.runtime.cuda_graphs.PiecewiseGraphs``; SGLang's
            option of this name does the same). Eagerly such a step is bound by the host launching ~600 kernels
            (Llama-3-8B, 43 decode rows + a 300-token chunk, H200: 42 ms of host time for 11 ms of GPU work,
            ``bench/profile_decode.py --mixed-tokens``). None: ``PIECEWISE_MAX_TOKENS`` (2048) capped by the step
            budget (``max_num_batched_tokens``, or ``max_prefill_tokens``) on CUDA; 0: off. Not used with tensor
            parallelism or longrope.
        adapter_pool_share: share of the memory budget for the adapter pool, in (0, 1) (None: the memory
            plan's default, 0.1); the KV cache takes the rest.
        adapter_pool_fill: the adapter pool also takes the budget the KV cache can never use: where KV's share
            (``1 - adapter_pool_share`` of the budget) exceeds ``max_batch_size`` sequences of ``max_seq_len``
            tokens, the pool gets the difference (up to ``adapter_pool_bytes`` / ``adapter_slots``), so that memory
            holds adapters instead of lying idle (an H200 with Llama-3-8B at the defaults: the KV cache can use 4 of
            its ~98 GiB share). ``kv_cache_bytes`` stays a cap whose remainder is left free. Default off until
            measured on the GPU (``memory.accounting.MemoryPlanOptions.kv_need_bytes``); not with tensor
            parallelism; without a measured snapshot (no /proc/meminfo) the caps alone size the engine, as before.
        unified_pool: put the adapter pool and the KV cache in one device buffer with a movable boundary
            (``multilora.memory.unified``; S-LoRA's unified paging): adapters grow into KV blocks that running and
            waiting requests do not need (more adapters resident, fewer tier moves at low load), and give them
            back, idle adapters evicted least recently used first, when requests need KV blocks. The memory plan's
            pool and KV bytes make the buffer together, and are each side's starting size: ``adapter_pool_bytes``,
            ``kv_cache_bytes`` and ``adapter_pool_share`` size the buffer and set where the boundary starts, but
            do not cap either side (the pool may take the whole buffer but one ``max_seq_len`` sequence's KV
            blocks; the KV side, all but the largest adapter ``max_lora_rank`` allows). Not with tensor
            parallelism.
        adapter_finish: where an adapter read again from disk (the cache's reload of a host-tier miss) is put in
            the pool's layout: "host" (on the cache's I/O threads, lora_B transposed and the values checked finite
            there) or "device" (the I/O threads read the file raw, every tensor straight into its place; the pool
            copies the image into its extent as it is and finishes it there on the GPU at the next step boundary, on
            the compute stream: ``multilora.kernels.image_finish``; on a CPU pool with torch ops at the load; not
            with tensor parallelism). None (the default): "device" on a CUDA engine without tensor parallelism,
            "host" otherwise (``finish_on_device``). "device" reads at the plain read's speed (H100 host, page cache,
            4 threads: 91% of a plain read against 32% for "host") and in the one-batch bench at 2,048 adapters
            (two H100 hosts, alternated, two runs each per host) gave 53.0-58.6% of the no-adapter tokens/s warm and
            63.0-66.2% cold, against 46.4-51.2% and 34.3-38.6% with "host" (bench/README.md, "Session 38";
            session 13's H200 A/B, before the GIL switch interval and the urgent-read wait, had it behind).
        async_scheduling: launch each step before reading the step before back (vLLM's name): the step's last
            tokens stay on the device (``Request.pending``) and the next step takes them from there
            (``runner.Feed``), so the host schedules and stages step n + 1 while the GPU runs step n, instead of
            the GPU idling from the end of step n until the host has read its tokens, checked them and launched
            step n + 1. Stop conditions are then checked one step late: a request that ends on an end-of-sequence
            token or a stop string computes one more row, whose token is dropped. The tokens are those of steps
            read back one by one (``tests/test_async_scheduling.py``), except that such an extra row can change a
            later step's batch size, and on the GPU kernels of another batch size may round bf16 differently. The
            engine reads back first (no step ahead) when a request of the step before reaches ``max_tokens`` or
            ``max_seq_len`` with it, and for steps with ``Engine.logits`` rows; ``Engine.abort`` reads back a
            request's drawn tokens before it withdraws it. Every step's host-to-device copies are pinned and
            non-blocking (``kernels.backends.to_device``), so prefill and mixed steps overlap too (measured on the
            GPU for decode steps only, so far). None (default): on for
            CUDA without tensor parallelism (H200, Llama-3-8B: the GPU idled 0.52 ms between fp8 batch-64 decode
            steps without it, 0.09 ms with it; decode steps 5.1-6.2% faster at batch 64, 2.7-3.8% at batch 1:
            ``bench/results/session24``), off elsewhere. Not with tensor parallelism.
        progress: show a progress bar while loading the model.

    Raises:
        ValueError: a value of the wrong type or out of range (the message names the field, with the
            ``Engine:`` prefix the engine's errors have always had).
        MemorySnapshotError (a ValueError): ``memory_snapshot`` is not a ``MemorySnapshot``.
    """

    device: str | torch.device | None = _opt(None, "cuda, cpu, ... (default: cuda when available)", kind=str)
    dtype: torch.dtype | str | None = _opt(None, "default: bfloat16 on GPU, float32 on CPU", choices=_DTYPES)
    weight_dtype: str | None = _opt(None, "base weights: fp8 = float8 e4m3 with per-channel scales (default: dtype)",
                                    choices=("fp8",))
    fp8_lm_head: bool | None = _opt(None, "with --weight-dtype fp8: the LM head in fp8 too (half its bytes per step; "
                                           "the logits carry one more GEMM's fp8 rounding); default: on when the "
                                           "model's head is untied", kind=bool)
    fp8_gemm: str | None = _opt(None, "the fp8 GEMM (default: weight_only for decode steps on CUDA, else scaled_mm)",
                                choices=("scaled_mm", "weight_only"))
    max_batch_size: int = _opt(16, "most requests running at once")
    max_seq_len: int | None = _opt(None, "most tokens per request, prompt + generated, at most the model's context "
                                         "(default: min(model context, 2048 on GPU, 1024 on CPU))", kind=int)
    kv_block_size: int = _opt(16, "tokens per KV-cache block")
    max_lora_rank: int = _opt(64, "largest adapter rank accepted")
    adapter_slots: int | None = _opt(None, "most adapters resident at once; also caps the pool at this many "
                                           "max-rank adapters (default: as many as the planned pool holds of rank-8 "
                                           "q/k/v/o adapters, 256 to 4096)", kind=int)
    adapter_pool_bytes: int | None = _opt(None, "cap on the adapter pool's bytes (default: no cap, the memory plan's "
                                                "share)", kind=int)
    kv_cache_bytes: int | None = _opt(None, "cap on the KV cache's bytes, the reserved null block included (default: "
                                            "no cap, the memory plan's KV share, at most --max-batch-size sequences "
                                            "of --max-seq-len tokens)", kind=int)
    host_adapter_bytes: int | None = _opt(None, "host-tier size in bytes (default: the memory plan's)", kind=int)
    host_arena_map_ahead_bytes: int | None = _opt(None, "bytes of the host tier mapped (on CUDA: and pinned) on a "
                                                     "background thread from the start, up to the tier's size; 0: as "
                                                     "adapters need them (default: on a discrete GPU, min(pool, host "
                                                     "tier, 8 GB) once the adapters outgrow the GPU pool)", kind=int)
    host_arena_chunk_bytes: int | None = _opt(None, "bytes of one chunk of the host tier's pinned arena, each "
                                                   "page-locked by one cudaHostRegister (default 1 GiB; at least one "
                                                   "max-rank adapter image)", kind=int)
    gpu_memory_fraction: float = _opt(0.9, "share of usable device memory the memory plan may budget")
    local_ranks: int = _opt(1, "engine processes sharing this device / host")
    tensor_parallel_size: int = _opt(1, "ranks (processes, GPUs) the model is split over")
    memory_snapshot: Any = _opt(None, "", cli=False)
    page_rows: int = _opt(8, "ignored: the adapter pool stores adapters at their exact size (kept for old scripts)")
    max_prefill_tokens: int = _opt(4096, "most prompt tokens in one step (chunked: the prompt part of "
                                         "--max-num-batched-tokens)")
    enable_chunked_prefill: bool = _opt(True, "chunked prefill: steps carry decode tokens and prompt chunks "
                                              "together (--no-enable-chunked-prefill: prefill steps stop decodes)",
                                        kind=bool)
    max_num_batched_tokens: int | None = _opt(None, "chunked prefill: tokens per step, decode tokens + prompt "
                                                    "chunks (default: --max-prefill-tokens)", kind=int)
    starvation_patience: int = _opt(16, "steps a waiting request may be passed over before it is urgent")
    prefetch_adapters: int = _opt(4, "adapters of waiting requests whose prefetch starts per step")
    adapter_io_threads: int = _opt(4, "threads reading adapters from disk for prefetch (default 4; the host-finished "
                                      "read, --adapter-finish host, scaled 1.5x from 4 to 8 on a 16-core H200 host)", kind=int)
    gil_switch_interval: float | None = _opt(0.0005, "sys.setswitchinterval while the engine lives, in seconds "
                                                     "(default 0.0005: the step thread waits less for the GIL behind "
                                                     "the adapter I/O threads; 0: leave Python's 0.005)", kind=float)
    adapter_aware_admission: bool = _opt(True, "pass over waiting requests whose adapter is still on disk (until "
                                               "urgent) for those whose adapter is resident or in host memory",
                                         kind=bool)
    max_waiting_requests: int = _opt(16384, "most requests waiting at once (more: an 'overloaded' error)")
    lora_backend: str | None = _opt(None, "LoRA kernels (default: triton on CUDA, torch on the CPU)",
                                    choices=_BACKENDS)
    attention_backend: str | None = _opt(None, "paged attention (default: triton on CUDA, torch on the CPU)",
                                         choices=_BACKENDS)
    lora_side_stream_max_tokens: int | None = _opt(None, "steps of at most this many tokens run LoRA on a side CUDA "
                                                         "stream beside the base GEMMs (default on CUDA: 64, or 2 when "
                                                         "--max-lora-rank > 16; 0: off; unused on the CPU)",
                                                   kind=int)
    cuda_graphs: bool = _opt(True, "run decode steps eagerly (default: CUDA graphs on CUDA with the Triton "
                                           "backends; the CPU has none)")
    piecewise_cuda_graph_max_tokens: int | None = _opt(None, "prefill and mixed steps of at most this many tokens "
                                                             "replay CUDA graphs piecewise, attention eager between "
                                                             "them (default on CUDA: 2048, at most the step budget; "
                                                             "0: off; unused on the CPU)", kind=int)
    adapter_pool_share: float | None = _opt(None, "share of the memory budget for the adapter pool (default: the "
                                                  "memory plan's, 0.1)", kind=float)
    adapter_pool_fill: bool = _opt(False, "the adapter pool also takes the budget the KV cache can never use "
                                          "(more than max_batch_size sequences of max_seq_len)",
                                   kind=bool)
    unified_pool: bool = _opt(False, "one device buffer for the adapter pool and the KV cache, with a movable "
                                     "boundary: idle KV memory holds more adapters, and adapters give way when "
                                     "requests need KV blocks; --adapter-pool-bytes and --kv-cache-bytes then size "
                                     "the buffer together (default: off; not with tensor parallelism)", kind=bool)
    adapter_finish: str | None = _opt(None, "where adapters read again from disk get the pool's layout: host (the "
                                              "I/O threads transpose lora_B and check values) or device (raw reads, "
                                              "finished in the pool at the next step: a GPU kernel, torch ops on a CPU "
                                              "pool; not with tensor parallelism); default: device on CUDA without "
                                              "tensor parallelism, host otherwise", choices=("host", "device"))
    async_scheduling: bool | None = _opt(None, "launch each step before reading the step before back, so the host "
                                               "prepares step n + 1 while the GPU runs step n (default: on on CUDA "
                                               "without tensor parallelism)", kind=bool)
    progress: bool = _opt(True, "", cli=False)

    def __post_init__(self) -> None:
        def fail(name: str, want: str) -> ValueError:
            return ValueError(f"Engine: {name} must be {want}, got {getattr(self, name)!r}")

        for name in ("max_batch_size", "kv_block_size", "max_lora_rank", "adapter_slots", "page_rows",
                     "max_prefill_tokens", "local_ranks", "max_waiting_requests", "tensor_parallel_size",
                     "adapter_io_threads"):
            v = getattr(self, name)
            if not (v is None and name == "adapter_slots") and (not _is_int(v) or v < 1):
                raise fail(name, "an int >= 1")
        if self.host_arena_chunk_bytes is not None and (not _is_int(self.host_arena_chunk_bytes)
                                                         or self.host_arena_chunk_bytes < 1):
            raise fail("host_arena_chunk_bytes", "None or an int >= 1")
        for name in ("starvation_patience", "prefetch_adapters", "host_arena_map_ahead_bytes"):
            v = getattr(self, name)
            if not (v is None and name == "host_arena_map_ahead_bytes") and (not _is_int(v) or v < 0):
                raise fail(name, "an int >= 0" if name != "host_arena_map_ahead_bytes" else "None or an int >= 0")
        for name, unit in (("adapter_pool_bytes", "bytes"), ("kv_cache_bytes", "bytes"),
                           ("host_adapter_bytes", "bytes"), ("lora_side_stream_max_tokens", "tokens"),
                           ("piecewise_cuda_graph_max_tokens", "tokens")):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise fail(name, f"None or an int >= 0 ({unit})")
        if self.max_seq_len is not None and (not _is_int(self.max_seq_len) or self.max_seq_len < 2):
            raise fail("max_seq_len", "an int >= 2")
        if not (_is_number(self.gpu_memory_fraction) and 0 < self.gpu_memory_fraction <= 1):
            raise fail("gpu_memory_fraction", "a number in (0, 1]")
        if self.adapter_pool_share is not None and not (_is_number(self.adapter_pool_share) and 0 < self.adapter_pool_share < 1):
            raise fail("adapter_pool_share", "a number in (0, 1)")
        for name in ("lora_backend", "attention_backend"):
            if getattr(self, name) not in (None, *_BACKENDS):
                raise fail(name, "'torch', 'triton' or None")
        if self.dtype is not None:
            import torch

            name = self.dtype if isinstance(self.dtype, str) else str(self.dtype).replace("torch.", "")
            if name not in _DTYPES or not isinstance(self.dtype, (str, torch.dtype)):
                raise fail("dtype", f"a torch dtype or a name, one of {list(_DTYPES)}")
            self.dtype = getattr(torch, name)
        if self.weight_dtype not in (None, "fp8"):
            raise fail("weight_dtype", "None or 'fp8'")
        if self.fp8_gemm not in (None, "scaled_mm", "weight_only"):
            raise fail("fp8_gemm", "None, 'scaled_mm' or 'weight_only'")
        if self.fp8_gemm is not None and self.weight_dtype != "fp8":
            raise fail("fp8_gemm", "None unless weight_dtype='fp8'")
        if self.fp8_lm_head is not None and not isinstance(self.fp8_lm_head, bool):
            raise fail("fp8_lm_head", "None, True or False")
        if self.fp8_lm_head and self.weight_dtype != "fp8":
            raise fail("fp8_lm_head", "None or False unless weight_dtype='fp8'")
        for name in ("cuda_graphs", "enable_chunked_prefill", "adapter_aware_admission", "unified_pool",
                     "adapter_pool_fill"):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, "True or False")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise fail("async_scheduling", "None, True or False")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise fail("async_scheduling", "None or False with tensor_parallel_size > 1 (the workers take their "
                                           "token ids from the host)")
        if self.gil_switch_interval is not None and not (_is_number(self.gil_switch_interval)
                                                         and 0 <= self.gil_switch_interval <= 1):
            raise fail("gil_switch_interval", "None or a number of seconds in [0, 1] (0: leave Python's)")
        if self.adapter_finish not in (None, "host", "device"):
            raise fail("adapter_finish", "None, 'host' or 'device'")
        if self.device is not None:  # its form only: whether this machine has it is Engine's check (resolve_device)
            device_of(self.device)
        if self.max_num_batched_tokens is not None and (not _is_int(self.max_num_batched_tokens)
                                                        or self.max_num_batched_tokens < 1):
            raise fail("max_num_batched_tokens", "None or an int >= 1")
        if self.adapter_finish == "device" and self.tensor_parallel_size > 1:
            raise ValueError(f"Engine: adapter_finish='device' is not available with tensor_parallel_size="
                             f"{self.tensor_parallel_size} (each rank reads its own shard of an adapter, finished on "
                             f"the host); leave adapter_finish unset (None) or 'host'")
        if self.unified_pool and self.tensor_parallel_size > 1:
            raise ValueError(f"Engine: unified_pool=True is not available with tensor_parallel_size="
                             f"{self.tensor_parallel_size} (each rank keeps its own pool and KV cache); leave "
                             f"unified_pool off")
        if self.adapter_pool_fill and self.tensor_parallel_size > 1:
            raise ValueError(f"Engine: adapter_pool_fill=True is not available with tensor_parallel_size="
                             f"{self.tensor_parallel_size} (the workers take rank 0's pool size without planning "
                             f"their own memory, and a pool of nearly the whole budget leaves them no margin); leave "
                             f"adapter_pool_fill off")
        if self.memory_snapshot is not None:  # checked before any weights load
            from multilora.memory.accounting import require_snapshot

            require_snapshot(self.memory_snapshot, "Engine(memory_snapshot=...)")

    def warn_ineffective(self) -> None:
        """Log a warning for each option set that this combination makes do nothing (``Engine`` calls it once):
        ``max_num_batched_tokens`` with ``enable_chunked_prefill=False`` (an A/B of the two modes may keep its
        budget: a warning, not an error); ``page_rows`` other than its default (ignored since the pool stores
        adapters at their exact size)."""
        if self.page_rows != 8:
            logging.getLogger("multilora").warning(
                "page_rows=%s has no effect: the adapter pool stores each adapter at its exact size in pages of 64 "
                "elements (multilora.memory.pool); the option is kept only so old scripts still run", self.page_rows)
        if self.max_num_batched_tokens is not None and not self.enable_chunked_prefill:
            logging.getLogger("multilora").warning(
                "max_num_batched_tokens=%s has no effect with enable_chunked_prefill=False (it is chunked prefill's "
                "step budget; without chunking, max_prefill_tokens=%s caps a prefill step)",
                self.max_num_batched_tokens, self.max_prefill_tokens)

    # ------------------------------------------------------------------------------------------ CLI
    @classmethod
    def add_cli_flags(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (``max_batch_size`` -> ``--max-batch-size``; ``cuda_graphs`` -> ``--no-cuda-graphs``;
        ``enable_chunked_prefill`` -> ``--enable-chunked-prefill`` / ``--no-enable-chunked-prefill``),
        with the field's default, type and help; fields that are not plain values have no flag."""
        for f in fields(cls):
            meta = f.metadata
            if not meta.get("cli"):
                continue
            flag = "--" + f.name.replace("_", "-")
            if meta["kind"] is bool and (f.default is None or isinstance(f.default, bool)):  # --name / --no-name
                parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                    help=meta["help"])
                continue
            if isinstance(f.default, bool):
                parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                    help=meta["help"])
                continue
            kind = meta["kind"] or (type(f.default) if f.default is not None and f.default is not MISSING else str)
            help = meta["help"]
            if kind is int and f.name.endswith("_bytes"):  # a byte count: 4096, 512MiB, 8GiB, 1.5GB (parse_bytes)
                kind, help = bytes_arg, help + "; a count or with a unit: 512MiB, 8GiB, 1.5GB"
            parser.add_argument(flag, dest=f.name, type=None if meta["choices"] else kind, default=f.default,
                                choices=meta["choices"], help=help)

    @classmethod
    def from_cli(cls, args: argparse.Namespace, **overrides: Any) -> "EngineConfig":
        """The config of the flags ``add_cli_flags`` added (and ``overrides``)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if f.metadata.get("cli") and hasattr(args, f.name)}
        return cls(**{**values, **overrides})


def finish_on_device(cfg: EngineConfig, device_type: str) -> bool:
    """Whether adapters read again from disk are read raw and finished in the pool (``EngineConfig.adapter_finish``):
    "device" -> True, "host" -> False, None -> True exactly on a CUDA engine (``device_type == "cuda"``) without
    tensor parallelism (``tensor_parallel_size == 1``; its ranks read their shards finished on the host)."""
    if cfg.adapter_finish is not None:
        return cfg.adapter_finish == "device"
    return device_type == "cuda" and cfg.tensor_parallel_size == 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: how a device error tells the command line's user to run on the CPU (``resolve_device``'s ``use_cpu``; the Python
#: API's words are ``device='cpu'``)
CLI_USE_CPU = "--device cpu"


def check_adapter_name(name: Any, label: str = "load_adapter: name") -> None:
    """Refuse an adapter name that a request, a metric label or a list of names could not carry: not a string,
    empty, with whitespace at either end (a name that looks like another), a comma (the gateway's
    ``running_lora_adapters`` label lists names comma-separated) or a control character.

    Raises:
        ValueError: ``"<label> must be ..., got ..."``: what was expected and what was got.
    """
    why = ("not a string" if not isinstance(name, str) else "empty" if not name
           else "whitespace at an end" if name != name.strip() else "a comma" if "," in name
           else "a control character" if any(unicodedata.category(c) == "Cc" for c in name) else None)
    if why is not None:
        raise ValueError(f"{label} must be a non-empty string without commas, control characters or whitespace at "
                         f"its ends, got {name!r} ({why})")


def check_api_key(key: Any, label: str = "api_key") -> None:
    """Refuse an API key that could not protect a server: not None (no authentication) and not a non-empty string
    without whitespace at its ends. An empty key is refused rather than taken as "no key": ``MULTILORA_API_KEY=``
    in an env file would otherwise either serve without authentication while the operator believes it is on, or
    require a blank ``Authorization: Bearer`` header; whitespace at an end could never match (the header's token
    is stripped).

    Raises:
        ValueError: ``"<label>: expected a non-empty string ..., got ..."`` (also for a character outside Latin-1, which
            a header cannot carry).
    """
    if key is None:
        return
    why = ("not a string" if not isinstance(key, str) else "empty" if not key
           else "whitespace at an end" if key != key.strip()
           else "a character an HTTP header cannot carry (outside Latin-1), so no request could match it"
           if not all(ord(c) < 256 for c in key) else None)
    if why is not None:  # never echo a key's text (nor a non-string's, which may be the key as bytes)
        shown = type(key).__name__ if not isinstance(key, str) else f"{len(key)} characters"
        raise ValueError(f"{label}: expected a non-empty string without whitespace at its ends, got {shown} ({why}); "
                         f"to serve without authentication, give no key (and leave MULTILORA_API_KEY unset)")


def as_flag_error(e: ValueError) -> ValueError:
    """An ``EngineConfig`` error in the command line's words: "Engine: max_batch_size must be an int >= 1, got 0"
    becomes "--max-batch-size: must be an int >= 1, got 0", and "Engine: device='tpu' is not a device" becomes
    "--device: 'tpu' is not a device". Other errors as they are. (Here, not in ``cli``, so that ``cli_memory`` can
    use it without an import cycle.)"""
    m = re.match(r"Engine: (\w+)[ =]", str(e))
    if m is None:
        return ValueError(str(e))
    rest = str(e)[m.end():]  # after the field and the space or "=" that follows it
    if "_" in m.group(1):  # the field named again ("raise kv_cache_bytes to ..."): the flag (not a plain word: device)
        rest = flag_words(rest, (m.group(1),))
    return ValueError(f"--{m.group(1).replace('_', '-')}: {rest}")


def flag_words(text: str, names: tuple[str, ...]) -> str:
    """``text`` with each of ``names`` (option names, ``kv_cache_bytes``) written as its flag (``--kv-cache-bytes``),
    except where a value follows it (``max_tokens=300`` quotes what was asked for)."""
    return re.sub(rf"\b({'|'.join(map(re.escape, names))})\b(?!=)", lambda w: "--" + w.group(1).replace("_", "-"),
                  text)


def resolve_device(device: "str | torch.device | None", *, use_cpu: str = "device='cpu'") -> "torch.device":
    """The device an ``Engine`` of ``EngineConfig.device`` runs on, checked before anything loads: None is CUDA when
    available, else the CPU. ``use_cpu``: how the error for cuda without CUDA tells the caller to ask for the CPU,
    in the caller's spelling (the Python API's ``device='cpu'``; the command line passes ``--device cpu``).

    Raises:
        ValueError: naming ``device``: not a torch device string; a device type other than cpu and cuda (the only
            ones multilora runs on: Triton kernels on CUDA, torch ops on the CPU); cuda on a machine without a CUDA
            device (a CPU build of torch, no GPU or none visible), or a CUDA index past the devices there are.
    """
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = device_of(device)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU build of torch" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(f"Engine: device={device!r}, but CUDA is not available here ({build}, torch "
                             f"{torch.__version__}); use {use_cpu}")
        n = torch.cuda.device_count()
        if d.index is not None and d.index >= n:
            raise ValueError(f"Engine: device={device!r}, but this machine has {n} CUDA device(s) (cuda:0 to "
                             f"cuda:{n - 1})")
    return d


def device_of(device: "str | torch.device") -> "torch.device":
    """``device`` as a ``torch.device`` of type cpu or cuda, whatever this machine has (``EngineConfig`` checks the
    form when it is made; ``resolve_device`` also whether the machine has it). Raises ValueError naming ``device``:
    not a torch device string, or a device type other than cpu and cuda."""
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"Engine: device={device!r} is not a device ({e}); expected 'cpu', 'cuda' or "
                         "'cuda:N'") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"Engine: device={device!r}: multilora runs on 'cpu' and 'cuda' devices, got type {d.type!r}")
    return d
