"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (and per LoRA on/off).

A decode step of ``B`` sequences is padded up to the smallest bucket ``>= B`` (1, 2, 4, 8, then multiples
of 16 up to ``max_batch_size``). Each bucket's graph is captured the first time it is needed, after one
eager warm-up run, and replayed afterwards. Everything that changes between steps lives in static
buffers written before the replay: input ids, positions, block tables, context lengths, KV slots, the
tokens' adapter slots and the LoRA chunk table. Padding rows use token 0 at position 0, context length 1,
a block table of zeros and KV slot 0: they read and write only the cache's reserved null block 0
(``multilora.memory.kv_cache``) and name no adapter (slot -1), so they never touch a real sequence.

The static buffers are views of one device byte buffer, filled from a pinned host buffer of the same layout
by one host-to-device copy per step. The host side is written with numpy, and a block-table row only when
that row's table changed, so the host work of a step is a few dozen small numpy operations whatever the batch.

The captured work is the model forward and the logits of every row (float32 ``[bucket, vocab]``), so a
replay costs one launch; sampling runs after it on the same stream.

Graphs are used only where every kernel of the step is graph-safe: CUDA, and the Triton backends for
LoRA and attention (their launch grids depend on the bucket size, never on the lengths or slots).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from multilora.kernels import LoRAPlan, block_m_for
from multilora.kernels.attention import AttentionMetadata, _extend_metadata

log = logging.getLogger("multilora")


def bucket_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 16, up to (and always including)
    ``max_batch_size``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted(set(sizes + [max_batch_size]))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # float32 [bucket, vocab], written by each replay
    chunk_table: torch.Tensor | None  # int32 [4, bucket] LoRA chunk table (a view of the shared buffer), or None
    plan: object  # the captured StepPlan: keeps every tensor the graph reads (e.g. a kernel's tile table) alive


class DecodeGraphs:
    """Captured decode steps for one engine (model, KV cache, adapter pool).

    Args:
        model: the ``LlamaModel`` (its pool views bound).
        kv: the ``PagedKVCache``; block 0 is the null block padding rows write to.
        max_batch_size: the largest bucket.
        max_blocks: block-table width (blocks of a ``max_seq_len`` sequence).
        lora_backend, attention_backend: passed to the forward (must be graph-safe: "triton" or None on CUDA).
        capture: False runs the same padded, static-buffer step eagerly instead of replaying a graph (the
            same static plan, any LoRA backend): the buffer and padding logic, testable on a CPU.
    """

    def __init__(self, model, kv, *, max_batch_size: int, max_blocks: int, max_seq_len: int,
                 lora_backend: str | None, attention_backend: str | None, capture: bool = True) -> None:
        self.model, self.kv = model, kv
        self.device = model.device
        self.buckets = bucket_sizes(max_batch_size)
        self.max_blocks = max_blocks
        self.max_seq_len = max_seq_len
        self.lora_backend, self.attention_backend = lora_backend, attention_backend
        self.capture = capture
        n, w, dev = self.buckets[-1], max_blocks, self.device
        # One byte buffer per side, 64-byte aligned fields; a step copies the prefix up to its bucket's last
        # block-table row. The chunk field holds [4, bucket] for the bucket being replayed (contiguous): only
        # one graph runs at a time, so every LoRA graph reads the same field.
        fields = [("input_ids", torch.int64, (n,)), ("positions", torch.int64, (n,)),
                  ("slot_mapping", torch.int64, (n,)), ("seq_lens", torch.int32, (n,)),
                  ("token_slots", torch.int32, (n,)), ("chunk", torch.int32, (4 * n,)),
                  ("block_tables", torch.int32, (n, w))]
        spans, off = {}, 0
        for name, dtype, shape in fields:
            nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            spans[name] = (off, nbytes, dtype, shape)
            off += -(-nbytes // 64) * 64
        self._dev = torch.zeros(off, dtype=torch.uint8, device=dev)
        self._host = torch.zeros(off, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        host = self._host.numpy()
        self._h: dict[str, np.ndarray] = {}
        views = {}
        for name, (o, nbytes, dtype, shape) in spans.items():
            views[name] = self._dev[o : o + nbytes].view(dtype).view(shape)
            self._h[name] = host[o : o + nbytes].view(np.dtype(str(dtype).replace("torch.", ""))).reshape(shape)
        self.input_ids, self.positions = views["input_ids"], views["positions"]
        self.slot_mapping, self.seq_lens = views["slot_mapping"], views["seq_lens"]
        self.token_slots, self.block_tables = views["token_slots"], views["block_tables"]
        self._chunk = views["chunk"]  # int32 [4 * n]: the replayed bucket's [4, bucket] chunk table
        self._h["seq_lens"][:] = 1
        self._h["token_slots"][:] = -1
        self._dev.copy_(self._host)
        self._rows: list[list[int]] = [[] for _ in range(n)]  # each host block-table row as last written ([] = zeros)
        self._bt_off, self._row_bytes = spans["block_tables"][0], 4 * w
        self._arange = np.arange(n)
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None  # recorded after each host -> device copy
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.last_index = torch.arange(n, dtype=torch.int64, device=dev)
        self._graphs: dict[tuple[int, bool], _Graph] = {}
        self._pool = None  # one memory pool shared by all graphs
        model.ensure_rope_positions(max_seq_len)  # never grown inside a capture

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` rows, or None if it is larger than every bucket."""
        return next((b for b in self.buckets if b >= batch), None)

    # ------------------------------------------------------------------------------- plan views
    def _plans(self, B: int, lora: bool):
        from multilora.runtime.model import StepPlan

        attn = AttentionMetadata(
            query_start_loc=self.query_start_loc[: B + 1], seq_lens=self.seq_lens[:B],
            block_tables=self.block_tables[:B], slot_mapping=self.slot_mapping[:B],
            block_size=self.kv.block_size, q_lens=(1,) * B, seq_lens_host=(self.max_seq_len,) * B,
            max_query_len=1, max_seq_len=self.max_seq_len, extra={"static": True},
        )
        _extend_metadata(attn)  # static for a decode batch of B sequences
        # the static buffers themselves: each step's slots and chunk table are staged into them before it runs
        plan = LoRAPlan(token_slots=self.token_slots[:B], chunks=self._chunk[: 4 * B].view(4, B), block_m=16,
                        has_lora=lora)
        return StepPlan(input_ids=self.input_ids[:B], positions=self.positions[:B], q_lens=(1,) * B,
                        last_index=self.last_index[:B], attn=attn, lora=plan)

    def _forward(self, plan) -> torch.Tensor:
        hidden = self.model.forward(plan, self.kv, lora_backend=self.lora_backend,
                                    attention_backend=self.attention_backend)
        return self.model.compute_logits(hidden)

    def _capture(self, B: int, lora: bool) -> _Graph:
        assert block_m_for(B) == 16, "decode buckets are at most 512 rows"
        plan = self._plans(B, lora)
        table = plan.lora.chunks if lora else None
        if table is not None:
            table.zero_()
            table[1].fill_(-1)  # no chunks: padding-only warm-up (the step's own table is written after capture)
        graph, logits = self._record(plan)
        log.debug("captured decode graph for batch %d (lora=%s)", B, lora)
        return _Graph(graph, logits, table, plan)

    def _record(self, plan) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up, then capture ``_forward(plan)`` in a CUDA graph; (graph, its logits buffer)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            self._forward(plan)  # warm-up: compiles kernels, settles allocator and cuBLAS workspaces
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(plan)
        return graph, logits

    # ----------------------------------------------------------------------------------- replay
    def run(self, *, token_ids: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
            token_slots: Sequence[int], chunk_table: torch.Tensor | None) -> torch.Tensor:
        """Replay the decode step for ``B = len(token_ids)`` sequences; float32 logits ``[B, vocab]`` (device).

        Args:
            token_ids: the token each sequence adds; positions: its position (= context length - 1).
            block_tables: each sequence's blocks (covering position + 1 tokens).
            token_slots: each sequence's adapter slot (-1 = none).
            chunk_table: the LoRA chunk table (``multilora.kernels.chunk_table`` of ``token_slots`` with
                ``block_m = 16``, int32 [4, B] on the host) or None when no sequence has an adapter.
        """
        B = len(token_ids)
        bucket = self.bucket_for(B)
        lora = chunk_table is not None
        key = (bucket, lora)
        g = self._graphs.get(key)
        if g is None and self.capture:
            g = self._graphs[key] = self._capture(bucket, lora)
        size = self._stage(B, bucket, token_ids, positions, block_tables, token_slots, chunk_table)
        self._dev[:size].copy_(self._host[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        if not self.capture:  # eager: the same buffers, padding and static plan, run instead of replayed
            self._graphs[key] = None
            return self._forward(self._plans(bucket, lora))[:B]
        g.graph.replay()
        return g.logits[:B]

    def _stage(self, B: int, bucket: int, token_ids: Sequence[int], positions: Sequence[int],
               block_tables: Sequence[Sequence[int]], token_slots: Sequence[int], chunk_table) -> int:
        """Write the step into the pinned host buffer; return how many bytes of it the step's copy needs."""
        if self._copied is not None:  # the previous step's copy reads this buffer (normally long done: the
            self._copied.synchronize()  # engine reads each step's sampled ids back before the next step)
        h, bs = self._h, self.kv.block_size
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
        seq = h["seq_lens"]
        seq[:B] = p + 1
        seq[B:] = 1
        ts = h["token_slots"]
        ts[:B] = token_slots
        ts[B:] = -1
        if chunk_table is not None:
            ct = chunk_table.numpy() if isinstance(chunk_table, torch.Tensor) else np.asarray(chunk_table)
            c = h["chunk"][: 4 * bucket].reshape(4, bucket)
            c[:, :B] = ct[:, :B]
            c[:, B:] = 0
            c[1, B:] = -1
        return self._bt_off + bucket * self._row_bytes

    @property
    def captured(self) -> list[tuple[int, bool]]:
        return sorted(self._graphs)
