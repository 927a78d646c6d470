"""The model runner: owns the model, the KV cache, the CUDA graphs and the backend choice, and is the ONLY place
that builds step plans.

One plan type (``StepPlan``) serves every step. An eager step's plan is built from the batch's host lists
(``build_plan``: one attention-metadata copy, one LoRA-plan copy, the ids and positions). A CUDA-graph decode
step's plan IS its static buffers (``DecodeBuffers``): made once at the largest bucket, viewed per bucket, and
filled in place before each replay by one pinned host-to-device copy; its LoRA plan is a real one over those
buffers, so the same plan runs through the torch backends too (``tests/test_cuda_graphs.py``). Plans are complete
when built: the kernels read them and add nothing to them.

    runner = ModelRunner(model, max_batch_size=16, max_seq_len=2048, lora_backend=None, attention_backend=None)
    reserve = runner.profile_reserve(tokens, block_size)     # the memory plan's profiling forward (CUDA)
    runner.bind(kv, pool, cuda_graphs=True)                  # after sizing: pool views, graphs
    logits = runner.run(sched.kind, sched.batch)             # float32 [S, vocab]: rows of sched.sampling
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from multilora.kernels.attention import AttentionMetadata, build_attention_metadata
from multilora.kernels.backends import select_triton, to_device, triton_module
from multilora.kernels.lora import LoRAPlan, block_m_for, build_lora_plan, fill_chunk_table
from multilora.memory.kv_cache import PagedKVCache
from multilora.memory.pool import AdapterPool
from multilora.runtime.cuda_graphs import CaptureStream, DecodeGraphs, PiecewiseGraphs, bucket_sizes, token_buckets
from multilora.runtime.model import DecoderModel
from multilora.runtime.scheduler import Request

log = logging.getLogger("multilora")


@dataclass(frozen=True)
class StepPlan:
    """Everything one forward step needs, built once (by ``ModelRunner``) and passed to every layer.

    Tokens are flattened (varlen): ``T = sum(q_lens)``, sequence ``b``'s tokens are contiguous.

    Attributes:
        input_ids: int64 [T].
        positions: int64 [T], absolute position of each token in its sequence (the forward looks up the
            model's RoPE tables with it, so a captured graph only needs this buffer updated).
        q_lens: host tuple [B], new tokens per sequence.
        last_index: int64 [S], flat index of the last token of each sequence that samples (its logits are
            computed; S = B unless a chunked-prefill step has chunks that stop short of their prompt's end).
        attn: the step's paged-attention metadata (block tables, slot mapping, lengths).
        lora: the step's LoRA plan (token -> adapter slot, SGMV chunk table).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    q_lens: tuple[int, ...]
    last_index: torch.Tensor
    attn: AttentionMetadata
    lora: LoRAPlan


def _field_spans(fields: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[dict, int]:
    """Byte spans of static-buffer fields laid out one after another, each 64-byte aligned: ({name: (offset, nbytes,
    dtype, shape)}, total bytes)."""
    spans, off = {}, 0
    for name, dtype, shape in fields:
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        spans[name] = (off, nbytes, dtype, shape)
        off += -(-nbytes // 64) * 64
    return spans, off


def _staged_fields(fields: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device):
    """One device byte buffer and a host buffer of the same layout (pinned on CUDA) holding ``fields``
    (``_field_spans``), zeroed; returns (device buffer, host buffer, host numpy views and device views by field,
    spans). A step writes the host views and copies the host buffer (or a prefix) to the device in one copy."""
    spans, size = _field_spans(fields)
    dev = torch.zeros(size, dtype=torch.uint8, device=device)
    host = torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    hnp = host.numpy()
    h: dict[str, np.ndarray] = {}
    d: dict[str, torch.Tensor] = {}
    for name, (o, nbytes, dtype, shape) in spans.items():
        d[name] = dev[o : o + nbytes].view(dtype).view(shape)
        h[name] = hnp[o : o + nbytes].view(np.dtype(str(dtype).replace("torch.", ""))).reshape(shape)
    return dev, host, h, d, spans


@dataclass
class Feed:
    """Token ids a step takes from the device instead of the host: the tokens that the step before drew and the
    engine has not read back yet (``Request.pending``; ``EngineConfig.async_scheduling``). The host staged a
    placeholder (0) for each; ``apply`` overwrites them in stream order, so the step reads the drawn ids without
    the host waiting for them.

    Attributes:
        ids: int64 [S] on the device: the step before's draw (``postprocess.draw_tokens``; -1 for a row whose
            logits were not finite: its request fails when read back, and its placeholder becomes token 0).
        src: one int per row of this step's batch: the row of ``ids`` holding the id of that row's last token, or
            -1 (the row's tokens are all on the host). A pending token is always the last of its row's chunk.
    """

    ids: torch.Tensor
    src: Sequence[int]

    def apply(self, input_ids: torch.Tensor, q_lens: Sequence[int] | None) -> None:
        """Write the drawn ids into a step's device ``input_ids`` [T] (int64), whose row ``b`` holds ``q_lens[b]``
        tokens (None: one each, a decode step). No host sync: at most one small pinned copy of the indices, none
        when the rows keep the step before's order (a decode step of the same batch)."""
        src = np.asarray(self.src, dtype=np.int64)
        rows = np.flatnonzero(src >= 0)
        n = rows.size
        if n == 0:
            return
        dst = rows if q_lens is None else (np.cumsum(np.asarray(q_lens, dtype=np.int64)) - 1)[rows]
        src = src[rows]
        if dst[-1] == n - 1 and np.array_equal(src, np.arange(n)):  # (dst rises: ending at n - 1, it is 0 .. n - 1)
            torch.clamp(self.ids[:n], min=0, out=input_ids[:n])  # the same rows in the same order: one kernel
            return
        idx = to_device(torch.from_numpy(np.stack([dst, src])), input_ids.device)  # (pinned on CUDA: no wait)
        input_ids.index_copy_(0, idx[0], self.ids.index_select(0, idx[1]).clamp_(min=0))


class DecodeBuffers:
    """The static inputs of CUDA-graph decode steps: made once for the largest bucket, filled in place per step.

    Everything that changes between steps lives here: input ids, positions, KV slots, context lengths, block
    tables, the tokens' adapter slots and the LoRA chunk table. Padding rows (``B .. bucket - 1``) get token 0
    at position 0, context length 1, a block table of zeros, KV slot 0 and no adapter (slot -1): they read and
    write only the cache's reserved null block 0 (``multilora.memory.kv_cache``) and never touch a real sequence.

    The buffers are views of one device byte buffer, filled from a pinned host buffer of the same layout by one
    host-to-device copy per step. The host side is written with numpy, a block-table row only when that row's
    table changed and the chunk table only when the batch's slots changed, so a step's host work is a few dozen
    small numpy operations whatever the batch. The chunk field holds the replayed bucket's ``[4, bucket]``
    table (contiguous); only one graph runs at a time, so every bucket's plan reads the same field.

    Args:
        max_batch: the largest bucket. max_blocks: block-table width (blocks of a ``max_seq_len`` sequence).
        block_size: KV tokens per block. max_seq_len: the plans' ``max_seq_len`` (attention's key bound).
        device: where the plans' tensors live.
    """

    BLOCK_M = block_m_for(1)  # decode buckets are at most 512 rows: one chunk size for every bucket

    def __init__(self, *, max_batch: int, max_blocks: int, block_size: int, max_seq_len: int,
                 device: torch.device) -> None:
        assert block_m_for(max_batch) == self.BLOCK_M, "decode buckets are at most 512 rows"
        n, w = max_batch, max_blocks
        self.block_size, self.max_seq_len, self.device = block_size, max_seq_len, device
        fields = [("input_ids", torch.int64, (n,)), ("positions", torch.int64, (n,)),
                  ("slot_mapping", torch.int64, (n,)), ("seq_lens", torch.int32, (n,)),
                  ("token_slots", torch.int32, (n,)), ("chunk", torch.int32, (4 * n,)),
                  ("block_tables", torch.int32, (n, w))]
        # host (self.h) and device (self.d) views by field; a step copies up to its last table row
        self._dev, self._host, self.h, self.d, spans = _staged_fields(fields, device)
        self.h["seq_lens"][:] = 1
        self.h["token_slots"][:] = -1
        self._dev.copy_(self._host)
        self._rows: list[list[int]] = [[] for _ in range(n)]  # each host block-table row as last written
        self._chunk_key: tuple[int, ...] | None = None  # the slots whose chunk table the host field holds
        self._bt_off, self._row_bytes = spans["block_tables"][0], 4 * w
        self._arange = np.arange(n)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # after each host -> device copy
        self._query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._last_index = torch.arange(n, dtype=torch.int64, device=device)

    def plan(self, B: int, lora: bool) -> StepPlan:
        """The static plan of a ``B``-row bucket (views of the buffers; ``lora``: whether it applies adapters)."""
        d = self.d
        attn = AttentionMetadata(
            query_start_loc=self._query_start_loc[: B + 1], seq_lens=d["seq_lens"][:B],
            block_tables=d["block_tables"][:B], slot_mapping=d["slot_mapping"][:B], block_size=self.block_size,
            q_lens=(1,) * B, seq_lens_host=(self.max_seq_len,) * B, max_query_len=1, max_seq_len=self.max_seq_len,
        )
        lora_plan = LoRAPlan(token_slots=d["token_slots"][:B], chunks=d["chunk"][: 4 * B].view(4, B),
                             block_m=self.BLOCK_M, has_lora=lora)
        return StepPlan(input_ids=d["input_ids"][:B], positions=d["positions"][:B], q_lens=(1,) * B,
                        last_index=self._last_index[:B], attn=attn, lora=lora_plan)

    def stage(self, bucket: int, token_ids: Sequence[int], positions: Sequence[int],
              block_tables: Sequence[Sequence[int]], token_slots: Sequence[int]) -> None:
        """Write a step of ``B = len(token_ids)`` rows, padded to ``bucket``, and copy it to the device."""
        if self._copied is not None:  # the previous step's copy reads this buffer (normally long done: the
            self._copied.synchronize()  # engine reads each step's sampled ids back before the next step)
        B, h, bs = len(token_ids), self.h, self.block_size
        tables, rows = h["block_tables"], self._rows
        for b in range(bucket):  # rows past B are padding: an empty table (zeros = the null block)
            src = block_tables[b] if b < B else []
            if not isinstance(src, list):
                src = list(src)
            if src != rows[b]:
                tables[b, : len(src)] = src
                tables[b, len(src) :] = 0
                rows[b] = list(src)  # a copy: the caller may change its list later
        ids, pos, slots = h["input_ids"], h["positions"], h["slot_mapping"]
        ids[:B] = token_ids
        ids[B:] = 0
        pos[:B] = positions
        pos[B:] = 0
        p = pos[:B]
        slots[:B] = tables[self._arange[:B], p // bs].astype(np.int64) * bs + p % bs
        slots[B:] = 0
        h["seq_lens"][:B] = p + 1
        h["seq_lens"][B:] = 1
        h["token_slots"][:B] = token_slots
        h["token_slots"][B:] = -1
        key = (bucket, *token_slots)
        if key != self._chunk_key and any(s >= 0 for s in token_slots):
            fill_chunk_table(h["chunk"][: 4 * bucket].reshape(4, bucket), h["token_slots"][:bucket], self.BLOCK_M)
            self._chunk_key = key
        size = self._bt_off + bucket * self._row_bytes
        self._dev[:size].copy_(self._host[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))


#: The default largest prefill / mixed step replayed from piecewise CUDA graphs (``EngineConfig.
#: piecewise_cuda_graph_max_tokens``). Past it a step is long enough on the GPU for the host's launches to hide behind
#: it: Llama-3-8B on an H200 takes ~24 us of GPU time per prompt token and ~42 ms of host time per eager step
#: (``bench/profile_decode.py --mixed-tokens``), even at ~1,750 tokens.
PIECEWISE_MAX_TOKENS = 2048

#: What the memory plan adds for the cuBLAS / cuBLASLt workspaces of the graphs' capture stream (``CaptureStream``,
#: shared by the decode and piecewise graphs; cuBLAS keeps one per stream): torch's default workspace is up to 32 MiB
#: on Hopper (``CUBLAS_WORKSPACE_CONFIG`` ``:4096:8``), twice that covers cuBLASLt's beside it.
CAPTURE_WORKSPACE_BYTES = 64 << 20


@dataclass
class _PieceContext:
    """What the piecewise graphs of one (bucket, lora) capture: the static plan, and the forward pass that the
    first piece starts (``DecoderModel.ForwardPass``: the residual stream in the static buffer)."""

    bucket: int
    plan: "StepPlan"
    st: Any = None


class StepBuffers:
    """The static inputs and outputs of piecewise-graph steps (``PiecewiseGraphs``), for steps of up to ``max_tokens``
    tokens: made once, viewed per token bucket, filled in place before each step.

    Staged from the host by one pinned copy: input ids, positions (the RoPE rows), the tokens' adapter slots and the
    LoRA chunk table, with the KV slots copied in from the step's attention metadata. Padding tokens (``T ..
    bucket - 1``) get token 0 at position 0, KV slot 0 (the cache's reserved null block) and no adapter: they write
    only the null block, and every op is per token, so they never touch a real token's values. Device-only buffers:
    the residual stream ``residual`` [N, hidden], each piece's output queries ``q`` [N, H, D] (the eager attention's
    input), attention's output ``attn`` [N, H, D] (the next piece's input) and the final normed ``hidden`` [N, hidden].

    Args:
        max_tokens: the largest bucket. hidden, num_heads, head_dim: the model's widths. dtype, device: the model's.
        max_segments: the most sequences (so distinct adapter slots) a step holds, ``max_batch_size``: the static
            plans' LoRA grids are sized by it (``LoRAPlan.num_segments``) instead of by the pool's slots; ``stage``
            refuses a step with more. None: the pool's slots.
    """

    def __init__(self, *, max_tokens: int, hidden: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_segments: int | None = None) -> None:
        n = max_tokens
        self.max_tokens, self.device = n, device
        self.max_segments = max_segments  # the most distinct adapter slots a step may have (the engine's batch)
        self._dev, self._host, self.h, self.d, _ = _staged_fields(self._fields(n), device)
        self.h["token_slots"][:] = -1
        self._dev.copy_(self._host)
        self.residual = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.q = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
        self.attn = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=device)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._chunk_key: tuple | None = None

    @staticmethod
    def _fields(n: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The staged fields of a ``n``-token buffer (``_staged_fields``)."""
        return [("input_ids", torch.int64, (n,)), ("positions", torch.int64, (n,)), ("slot_mapping", torch.int64, (n,)),
                ("token_slots", torch.int32, (n,)), ("chunk", torch.int32, (4 * n,))]

    @classmethod
    def nbytes(cls, max_tokens: int, hidden: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Device bytes of the buffers for ``max_tokens`` (the memory plan's share for them)."""
        e = torch.empty((), dtype=dtype).element_size()
        return _field_spans(cls._fields(max_tokens))[1] + 2 * max_tokens * e * (hidden + num_heads * head_dim)

    def context(self, bucket: int, lora: bool, block_size: int) -> _PieceContext:
        """The static plan of a ``bucket``-token step (views of the buffers; ``lora``: whether it applies adapters).
        Its attention metadata carries the static KV slots only: the pieces write the cache through it, and the
        step's real metadata serves the eager attention."""
        d, z = self.d, torch.zeros(1, dtype=torch.int32, device=self.device)
        attn = AttentionMetadata(query_start_loc=z, seq_lens=z, block_tables=z.view(1, 1),
                                 slot_mapping=d["slot_mapping"][:bucket], block_size=block_size, q_lens=(bucket,),
                                 seq_lens_host=(bucket,), max_query_len=bucket, max_seq_len=bucket)
        lora_plan = LoRAPlan(token_slots=d["token_slots"][:bucket], chunks=d["chunk"][: 4 * bucket].view(4, bucket),
                             block_m=block_m_for(bucket), has_lora=lora, num_segments=self.max_segments)
        plan = StepPlan(input_ids=d["input_ids"][:bucket], positions=d["positions"][:bucket], q_lens=(bucket,),
                        last_index=d["positions"][:0], attn=attn, lora=lora_plan)
        return _PieceContext(bucket, plan)

    def stage(self, bucket: int, token_ids: Sequence[Sequence[int]], starts: Sequence[int],
              token_slots: Sequence[int], slot_mapping: torch.Tensor | None) -> None:
        """Write a step of ``T = sum(len(t) for t in token_ids)`` tokens (sequence b's at positions ``starts[b]``
        onward, adapter slot ``token_slots[b]``), padded to ``bucket``, and copy it to the device; then the step's
        KV slots ``slot_mapping`` [T] (device int64, ``AttentionMetadata.slot_mapping``) into place. ``T = 0``
        (``slot_mapping`` None) stages a step of padding only."""
        if self.max_segments is not None and len(token_ids) > self.max_segments:  # (never: the scheduler's batch)
            raise ValueError(f"StepBuffers.stage: {len(token_ids)} sequences in one step, more than max_segments="
                             f"{self.max_segments} (the captured LoRA grids hold that many distinct adapters)")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        h = self.h
        qn = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(token_ids))
        T = int(qn.sum())
        ids, pos, slots, tok = h["input_ids"], h["positions"], h["slot_mapping"], h["token_slots"]
        ids[:T] = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=T)
        ids[T:bucket] = 0
        first = np.cumsum(qn) - qn
        pos[:T] = np.arange(T) + np.repeat(np.fromiter(starts, dtype=np.int64, count=len(qn)) - first, qn)
        pos[T:bucket] = 0
        slots[:bucket] = 0  # the real tokens' slots are copied in on the device below
        tok[:T] = np.repeat(np.fromiter(token_slots, dtype=np.int32, count=len(qn)), qn)
        tok[T:bucket] = -1
        key = (bucket, *token_slots, *qn.tolist())
        if key != self._chunk_key:
            fill_chunk_table(h["chunk"][: 4 * bucket].reshape(4, bucket), tok[:bucket], block_m_for(bucket))
            self._chunk_key = key
        self._dev.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        if T:
            self.d["slot_mapping"][:T].copy_(slot_mapping)


class ModelRunner:
    """Runs the model for the engine: plans, eager forwards, CUDA-graph decode steps, the profiling forward.

    Args:
        model: the ``DecoderModel``.
        max_batch_size: the largest decode batch (the largest graph bucket).
        max_seq_len: most tokens per sequence (RoPE tables, graph block tables and attention bounds).
        lora_backend, attention_backend: "torch", "triton" or None (Triton on CUDA when it imports).
    """

    def __init__(self, model: DecoderModel, *, max_batch_size: int, max_seq_len: int, lora_backend: str | None,
                 attention_backend: str | None) -> None:
        self.model, self.device = model, model.device
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.lora_backend, self.attention_backend = lora_backend, attention_backend
        self.kv: PagedKVCache | None = None
        self.graphs: DecodeGraphs | None = None
        self.buffers: DecodeBuffers | None = None
        self.pieces: PiecewiseGraphs | None = None  # prefill / mixed steps replayed piecewise (``enable_pieces``)
        #: the one stream both kinds of graph capture on (one cuBLAS workspace: ``CAPTURE_WORKSPACE_BYTES``)
        self.capture_stream = CaptureStream(self.device)
        self.step_buffers: StepBuffers | None = None
        #: steps run by each path (``run``): a decode graph, piecewise graphs, eager (``Engine.stats()``)
        self.path_counts = {"graph_steps": 0, "piecewise_graph_steps": 0, "eager_steps": 0}
        self.tp = None  # rank 0 of a tensor-parallel engine: its ``runtime.parallel.TensorParallel`` (set by Engine)
        model.ensure_rope_positions(max_seq_len)  # the RoPE tables never move while serving (graphs read them)
        c = model.config
        attn = select_triton(attention_backend, self.device, "triton_attention", label="attention backend",
                             unavailable="the Triton kernel is not available")
        self._tiles_block_q = 0 if attn is None else attn.prefill_block_q(
            c.num_heads, c.num_kv_heads, c.head_dim, model.dtype, self.device)

    def bind(self, kv: PagedKVCache, pool: AdapterPool, *, cuda_graphs: bool, piecewise_max_tokens: int = 0) -> None:
        """Attach the sized KV cache and adapter pool; capture decode graphs when ``cuda_graphs`` and every kernel
        of the step is graph-safe (CUDA, Triton LoRA and attention), and piecewise graphs of prefill and mixed steps
        of up to ``piecewise_max_tokens`` tokens (``piecewise_tokens``) then too."""
        self.kv = kv
        self.model.bind_pool(pool)
        if cuda_graphs and self.graphs_supported():
            self.enable_graphs()
            if piecewise_max_tokens > 0 and self.piecewise_supported():
                self.enable_pieces(piecewise_max_tokens)

    def piecewise_supported(self) -> bool:
        """Piecewise graphs need what decode graphs need, no tensor parallelism (its collectives run inside the
        pieces) and RoPE rows that follow the positions alone (not longrope: its row depends on the sequence's length
        after the step)."""
        return self.graphs_supported() and self.model.tp_group is None and self.model.long_inv_freq is None

    def piecewise_tokens(self, requested: int | None, step_budget: int) -> int:
        """The largest piecewise-graph step for ``EngineConfig.piecewise_cuda_graph_max_tokens = requested`` (None:
        ``PIECEWISE_MAX_TOKENS``) and a step budget of ``step_budget`` tokens: 0 where unsupported or off."""
        if not self.piecewise_supported():
            return 0
        want = PIECEWISE_MAX_TOKENS if requested is None else requested
        return max(0, min(want, step_budget))

    def enable_pieces(self, max_tokens: int, *, capture: bool = True) -> PiecewiseGraphs:
        """Run prefill and mixed steps of up to ``max_tokens`` tokens through the static ``StepBuffers`` and
        piecewise graphs (``capture=False``: the same padded pieces run eagerly, testable on a CPU)."""
        c = self.model.config
        buckets = token_buckets(max_tokens)
        self.step_buffers = StepBuffers(max_tokens=buckets[-1], hidden=c.hidden_size, num_heads=c.num_heads,
                                        head_dim=c.head_dim, dtype=self.model.dtype, device=self.device,
                                        max_segments=self.max_batch_size)
        self.pieces = PiecewiseGraphs(c.num_layers + 1, buckets, self.device, capture=capture,
                                      stream=self.capture_stream)
        log.debug("piecewise graphs for %d token buckets up to %d", len(buckets), buckets[-1])
        return self.pieces

    def reset_graphs(self) -> None:
        """Drop every captured graph, decode and piecewise (captured again on next use): after a change of something
        capture bakes in, such as ``DecoderModel.lora_side_max_tokens``."""
        for g in (self.graphs, self.pieces):
            if g is not None:
                g.reset()

    def graphs_supported(self) -> bool:
        """CUDA graphs need CUDA and graph-safe (Triton) LoRA and attention kernels."""
        return (self.device.type == "cuda" and self.lora_backend in (None, "triton")
                and self.attention_backend in (None, "triton")
                and triton_module("triton_sgmv") is not None and triton_module("triton_attention") is not None)

    def enable_graphs(self, *, capture: bool = True) -> DecodeGraphs:
        """Run decode steps of up to ``max_batch_size`` rows through the static buffers and graphs.
        ``capture=False`` runs the same padded static-buffer step eagerly (no CUDA needed: the CPU tests'
        view of exactly what a graph replays)."""
        c = self.model.config
        blocks = -(-self.max_seq_len // self.kv.block_size)
        self.buffers = DecodeBuffers(max_batch=max(bucket_sizes(self.max_batch_size)), max_blocks=blocks,
                                     block_size=self.kv.block_size, max_seq_len=self.max_seq_len, device=self.device)
        self.graphs = DecodeGraphs(self._logits_of, bucket_sizes(self.max_batch_size), self.device, capture=capture,
                                   stream=self.capture_stream)
        log.debug("decode graphs for %s (%d layers)", self.graphs.buckets, c.num_layers)
        return self.graphs

    # ------------------------------------------------------------------------------------- plans
    def build_plan(self, token_ids: Sequence[Sequence[int]], starts: Sequence[int],
                   block_tables: Sequence[Sequence[int]], slots: Sequence[int], *, block_size: int,
                   sample: Sequence[bool] | None = None) -> StepPlan:
        """The eager plan of B sequences, each adding ``token_ids[b]`` at ``starts[b]`` onward with adapter slot
        ``slots[b]`` (-1 = none) and KV blocks ``block_tables[b]`` (covering ``starts[b] + len(token_ids[b])``).
        ``sample``: which sequences' last tokens get logits (``StepPlan.last_index``; default all).

        Raises:
            ValueError: empty input, lengths that disagree, or a block table too short.
        """
        B = len(token_ids)
        if B == 0 or len(starts) != B or len(block_tables) != B or len(slots) != B:
            raise ValueError("build_plan: token_ids, starts, block_tables and slots must be non-empty and equal in length")
        if sample is not None and len(sample) != B:
            raise ValueError(f"build_plan: sample must have one entry per sequence ({B}), got {len(sample)}")
        q_lens = tuple(len(t) for t in token_ids)
        if min(q_lens) == 0:
            raise ValueError("build_plan: every sequence must add at least one token")
        qn = np.fromiter(q_lens, dtype=np.int64, count=B)
        st = np.fromiter(starts, dtype=np.int64, count=B)
        seq_lens = (st + qn).tolist()
        dev = self.device
        self.model.ensure_rope_positions(max(seq_lens))
        attn = build_attention_metadata(q_lens, seq_lens, block_tables, block_size=block_size, device=dev,
                                        tiles_block_q=self._tiles_block_q)
        first = np.cumsum(qn) - qn
        positions = np.arange(qn.sum()) + np.repeat(st - first, qn)
        lora = build_lora_plan(np.repeat(np.fromiter(slots, dtype=np.int64, count=B), qn), device=dev)
        last = np.cumsum(qn) - 1
        if sample is not None:
            last = last[np.fromiter(sample, dtype=bool, count=B)]
        # ids, positions and the sampled rows in one host buffer, one copy (pinned on CUDA); each field starts on 64
        # bytes, as separate tensors would (Triton specialises kernels on 16-byte aligned pointers)
        T, S = int(qn.sum()), last.size
        p0 = -(-T // 8) * 8
        s0 = 2 * p0
        host = np.zeros(s0 + S, dtype=np.int64)
        host[:T] = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=T)
        host[p0 : p0 + T] = positions
        host[s0:] = last
        d = to_device(torch.from_numpy(host), dev)
        return StepPlan(input_ids=d[:T], positions=d[p0 : p0 + T], q_lens=q_lens, last_index=d[s0:], attn=attn,
                        lora=lora)

    # -------------------------------------------------------------------------------------- runs
    def forward(self, plan: StepPlan, kv: PagedKVCache | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] of a plan (keys and values written into ``kv``, default the engine's)."""
        return self.model.forward(plan, kv if kv is not None else self.kv, lora_backend=self.lora_backend,
                                  attention_backend=self.attention_backend)

    def _logits_of(self, plan: StepPlan) -> torch.Tensor:
        """float32 logits [S, vocab] at the tokens of ``plan.last_index`` (what a graph captures: every row). The
        lm_head runs for those rows only; S = 0 (a step of prompt chunks that all stop short of their last token)
        runs none."""
        hidden = self.forward(plan)
        n = plan.last_index.shape[0]
        if n == 0:
            return torch.empty(0, self.model.lm_head.shape[0], dtype=torch.float32, device=hidden.device)
        if n != hidden.shape[0]:
            hidden = hidden.index_select(0, plan.last_index)
        return self.model.compute_logits(hidden)

    def run(self, kind: str, batch: list[Request], feed: Feed | None = None) -> torch.Tensor:
        """The forward of a scheduled step (``Scheduler.schedule``): request ``r`` computes its tokens
        ``r.computed .. r.computed + r.chunk - 1``. Returns float32 logits [S, vocab] on the device, one row per
        request whose chunk reaches its last token (``Request.samples``), in batch order (S = B for a decode step
        and for an unchunked prefill). A decode step that fits a graph bucket replays it; everything else (prefill
        and mixed steps) replays piecewise graphs when it fits their largest bucket, or runs eagerly.

        ``feed``: the ids of tokens drawn on the device by the step before and not read back (``Request.pending``;
        the engine's ``async_scheduling``): ``Feed``. Not with tensor parallelism (ValueError)."""
        tables = [self.kv.block_table(r.seq_id) for r in batch]
        slots = [r.slot for r in batch]
        if feed is not None and self.tp is not None:
            raise ValueError("run: feed (tokens read back one step late) is not supported with tensor parallelism")
        with torch.inference_mode():
            if kind == "decode" and self.graphs is not None and self.graphs.bucket_for(len(batch)) is not None:
                args = ([r.tokens(r.computed, 1)[0] for r in batch], [r.computed for r in batch], tables, slots)
                if self.tp is not None:  # tensor-parallel workers run the same step (runtime.parallel)
                    self.tp.step("graph", args)
                self.path_counts["graph_steps"] += 1
                return self.decode_graph(*args, feed=feed)
            token_ids = [r.tokens(r.computed, r.chunk) for r in batch]  # a prefill: prompt + any tokens generated
            starts = [r.computed for r in batch]  # before a preemption, whole or a chunk of it
            sample = [r.samples for r in batch]
            if (self.pieces is not None and self.tp is None
                    and self.pieces.bucket_for(sum(r.chunk for r in batch)) is not None):
                self.path_counts["piecewise_graph_steps"] += 1
                return self.piecewise_step(token_ids, starts, tables, slots, sample=None if all(sample) else sample,
                                           feed=feed)
            self.path_counts["eager_steps"] += 1
            if self.tp is not None:
                self.tp.step("eager", (token_ids, starts, tables, slots))
            plan = self.build_plan(token_ids, starts, tables, slots, block_size=self.kv.block_size,
                                   sample=None if all(sample) else sample)
            if feed is not None:
                feed.apply(plan.input_ids, [len(t) for t in token_ids])
            return self._logits_of(plan)

    def decode_graph(self, token_ids: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
                     slots: Sequence[int], feed: Feed | None = None) -> torch.Tensor:
        """One decode step through the static buffers and its bucket's graph: float32 logits [B, vocab]."""
        B = len(token_ids)
        bucket = self.graphs.bucket_for(B)
        lora = any(s >= 0 for s in slots)
        self.buffers.stage(bucket, token_ids, positions, block_tables, slots)
        if feed is not None:
            feed.apply(self.buffers.d["input_ids"], None)
        return self.graphs.replay((bucket, lora), lambda: self.buffers.plan(bucket, lora))[:B]

    def piecewise_step(self, token_ids: Sequence[Sequence[int]], starts: Sequence[int],
                       block_tables: Sequence[Sequence[int]], slots: Sequence[int], *,
                       sample: Sequence[bool] | None = None, feed: Feed | None = None) -> torch.Tensor:
        """One step of B sequences (``build_plan``'s arguments) through the static buffers and its token bucket's
        piecewise graphs, attention eager between them over the real tokens: float32 logits [S, vocab] (the rows of
        ``sample``, default all). ``feed``: as in ``run``."""
        B = len(token_ids)
        q_lens = tuple(len(t) for t in token_ids)
        T = sum(q_lens)
        bucket = self.pieces.bucket_for(T)
        seq_lens = [s + n for s, n in zip(starts, q_lens)]
        meta = build_attention_metadata(q_lens, seq_lens, block_tables, block_size=self.kv.block_size,
                                        device=self.device, tiles_block_q=self._tiles_block_q)
        lora = any(s >= 0 for s in slots)
        bufs = self.step_buffers
        if self.pieces.capture and not self.pieces.captured:  # the largest bucket first lays out the shared pool
            self.warm_pieces(lora=(True,), buckets=self.pieces.buckets[-1:])  # (``warm_pieces``)
        bufs.stage(bucket, token_ids, starts, slots, meta.slot_mapping)
        if feed is not None:
            feed.apply(bufs.d["input_ids"], q_lens)

        def between(i: int) -> None:  # layer i's attention over the real tokens, into the next piece's input
            self.model.attend(i, bufs.q[:T], meta, self.kv, backend=self.attention_backend, out=bufs.attn[:T])

        last = np.cumsum(q_lens) - 1
        if sample is not None:
            last = last[np.fromiter(sample, dtype=bool, count=B)]
        # the sampled rows' index (a pinned, non-blocking copy: a pageable one would wait for the work queued on the
        # stream, the step before included)
        index = to_device(torch.from_numpy(last), self.device) if 0 < last.size < T else None
        self.pieces.run((bucket, lora), lambda: bufs.context(bucket, lora, self.kv.block_size), self._piece, between)
        if last.size == 0:
            return torch.empty(0, self.model.lm_head.shape[0], dtype=torch.float32, device=self.device)
        hidden = bufs.hidden[:T]
        return self.model.compute_logits(hidden if index is None else hidden.index_select(0, index))

    def _piece(self, ctx: _PieceContext, k: int) -> None:
        """Piece ``k`` of a piecewise step (``PiecewiseGraphs``): 0 = ``DecoderModel.start``, else ``resume`` of layer
        ``k - 1`` from the static attention output; its queries (or, last, the final hidden states) into the static
        buffers."""
        m, bufs, n = self.model, self.step_buffers, ctx.bucket
        if k == 0:
            ctx.st, out = m.start(ctx.plan, self.kv, lora_backend=self.lora_backend, residual=bufs.residual[:n])
        else:
            out = m.resume(ctx.st, k - 1, bufs.attn[:n])
        (bufs.hidden if k == m.config.num_layers else bufs.q)[:n].copy_(out)

    def warm_pieces(self, lora: Sequence[bool] = (True, False), buckets: Sequence[int] | None = None) -> int:
        """Capture the piecewise graphs of ``buckets`` (default every token bucket), with and without LoRA, now, from
        steps of padding only (they write only the KV cache's null block), largest first, so that no capture happens
        inside a serving step and the graphs' shared memory pool is laid out by the largest step: a smaller
        bucket's temporaries then fit in its free blocks (captured smallest first, each larger one would add
        segments of its own). Returns the (bucket, lora) steps captured by this call."""
        if self.pieces is None:
            return 0
        before = len(self.pieces.captured)
        with torch.inference_mode():
            for bucket in sorted(self.pieces.buckets if buckets is None else buckets, reverse=True):
                for on in lora:
                    if (bucket, on) in self.pieces.captured:
                        continue
                    self.step_buffers.stage(bucket, [], [], [], None)
                    self.pieces.run((bucket, on),
                                    lambda b=bucket, o=on: self.step_buffers.context(b, o, self.kv.block_size),
                                    self._piece, lambda i: None)
        return len(self.pieces.captured) - before

    def run_eager(self, token_ids: Sequence[Sequence[int]], starts: Sequence[int], block_tables: Sequence[Sequence[int]],
                  slots: Sequence[int], kv: PagedKVCache | None = None) -> torch.Tensor:
        """An eager step of host lists (``build_plan``'s arguments) in ``kv`` (default: the engine's cache):
        float32 logits [B, vocab] on the CPU."""
        kv = kv if kv is not None else self.kv
        with torch.inference_mode():
            plan = self.build_plan(token_ids, starts, block_tables, slots, block_size=kv.block_size)
            hidden = self.model.forward(plan, kv, lora_backend=self.lora_backend,
                                        attention_backend=self.attention_backend)
            return self.model.compute_logits(hidden.index_select(0, plan.last_index)).cpu()

    def piecewise_reserve(self, max_tokens: int, block_size: int) -> int:
        """Bytes the piecewise graphs of steps up to ``max_tokens`` tokens hold beyond the eager reserve (CUDA only):
        their memory pool, bounded by the temporaries of a forward of their largest bucket (measured at up to
        ``max_seq_len`` tokens, one sequence, and scaled by tokens: every activation is per token) plus the capture
        stream's cuBLAS workspaces (``CAPTURE_WORKSPACE_BYTES``), and their static ``StepBuffers``."""
        c = self.model.config
        top = token_buckets(max_tokens)[-1]
        n = min(top, self.max_seq_len)
        pool = self.profile_reserve(n, block_size) * top // n + CAPTURE_WORKSPACE_BYTES
        return pool + StepBuffers.nbytes(top, c.hidden_size, c.num_heads, c.head_dim, self.model.dtype)

    def profile_reserve(self, tokens: int, block_size: int) -> int:
        """Peak bytes a forward of one ``tokens``-token prefill allocates beyond what is live (CUDA only): the
        memory plan's measured non-KV reserve. Runs in a temporary KV cache of just those blocks."""
        c = self.model.config
        blocks = -(-tokens // block_size)
        tmp_kv = PagedKVCache(num_layers=c.num_layers, num_blocks=blocks + 1, block_size=block_size,
                              num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=self.model.dtype,
                              device=self.device)
        table = tmp_kv.allocate_seq("profile", tokens)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.run_eager([[0] * tokens], [0], [table], [-1], kv=tmp_kv)
        torch.cuda.synchronize(self.device)
        reserve = torch.cuda.max_memory_allocated(self.device) - before
        del tmp_kv
        torch.cuda.empty_cache()
        return int(reserve)
