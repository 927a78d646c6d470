"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (and per LoRA on/off).

A decode step of ``B`` sequences is padded up to the smallest bucket ``>= B`` (1, 2, 4, 8, then multiples
of 16 up to ``max_batch_size``). Each bucket's graph is captured the first time it is needed, after one
eager warm-up run, and replayed afterwards. Everything that changes between steps lives in static
buffers written before the replay: input ids, positions, block tables, context lengths, KV slots, the
tokens' adapter slots and the LoRA chunk table. Padding rows use token 0 at position 0, context length 1,
a block table of zeros and KV slot 0: they read and write only the cache's reserved null block 0
(``multilora.memory.kv_cache``) and name no adapter (slot -1), so they never touch a real sequence.

The captured work is the model forward and the logits of every row (float32 ``[bucket, vocab]``), so a
replay costs one launch; sampling runs after it on the same stream.

Graphs are used only where every kernel of the step is graph-safe: CUDA, and the Triton backends for
LoRA and attention (their launch grids depend on the bucket size, never on the lengths or slots).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from multilora.kernels import LoRAPlan
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
    chunk_table: torch.Tensor | None  # int32 [4, bucket] LoRA chunk table, or None without LoRA
    plan: object  # the captured StepPlan: keeps every tensor the graph reads (e.g. a kernel's tile table) alive


class DecodeGraphs:
    """Captured decode steps for one engine (model, KV cache, adapter pool).

    Args:
        model: the ``LlamaModel`` (its pool views bound).
        kv: the ``PagedKVCache``; block 0 is the null block padding rows write to.
        max_batch_size: the largest bucket.
        max_blocks: block-table width (blocks of a ``max_seq_len`` sequence).
        lora_backend, attention_backend: passed to the forward (must be graph-safe: "triton" or None on CUDA).
        capture: False runs the same padded, static-buffer step eagerly instead of replaying a graph (with
            a LoRA plan built per step): the buffer and padding logic, testable on a CPU.
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
        n, dev = self.buckets[-1], self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.token_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.last_index = torch.arange(n, dtype=torch.int64, device=dev)
        # one pinned staging row per step: ids, positions, slots, seq_lens, token slots, then block tables
        self._host = torch.zeros(5 * n + n * max_blocks, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._graphs: dict[tuple[int, bool], _Graph] = {}
        self._pool = None  # one memory pool shared by all graphs
        model.ensure_rope_positions(max_seq_len)  # never grown inside a capture

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` rows, or None if it is larger than every bucket."""
        return next((b for b in self.buckets if b >= batch), None)

    # ------------------------------------------------------------------------------- plan views
    def _plans(self, B: int, lora: bool, chunk_table: torch.Tensor | None):
        from multilora.runtime.model import StepPlan

        attn = AttentionMetadata(
            query_start_loc=self.query_start_loc[: B + 1], seq_lens=self.seq_lens[:B],
            block_tables=self.block_tables[:B], slot_mapping=self.slot_mapping[:B],
            block_size=self.kv.block_size, q_lens=(1,) * B, seq_lens_host=(self.max_seq_len,) * B,
            max_query_len=1, max_seq_len=self.max_seq_len, extra={"static": True},
        )
        _extend_metadata(attn)  # static for a decode batch of B sequences
        extra = {"sgmv": {16: chunk_table}} if lora else {}
        plan = LoRAPlan(token_slots=self.token_slots[:B], num_tokens=B, slot_ids=(0,) if lora else (),
                        token_index=(), has_lora=lora, extra=extra)
        return StepPlan(input_ids=self.input_ids[:B], positions=self.positions[:B], q_lens=(1,) * B,
                        last_index=self.last_index[:B], attn=attn, lora=plan)

    def _forward(self, plan) -> torch.Tensor:
        hidden = self.model.forward(plan, self.kv, lora_backend=self.lora_backend,
                                    attention_backend=self.attention_backend)
        return self.model.compute_logits(hidden)

    def _capture(self, B: int, lora: bool) -> _Graph:
        from multilora.kernels.triton_sgmv import block_m_for

        assert block_m_for(B) == 16, "decode buckets are at most 512 rows"
        table = torch.zeros(4, B, dtype=torch.int32, device=self.device) if lora else None
        if table is not None:
            table[1].fill_(-1)  # no chunks: padding-only warm-up
        plan = self._plans(B, lora, table)
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
        log.debug("captured decode graph for batch %d (lora=%s)", B, lora)
        return _Graph(graph, logits, table, plan)

    # ----------------------------------------------------------------------------------- replay
    def run(self, *, token_ids: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]],
            token_slots: Sequence[int], chunk_table: torch.Tensor | None) -> torch.Tensor:
        """Replay the decode step for ``B = len(token_ids)`` sequences; float32 logits ``[B, vocab]`` (device).

        Args:
            token_ids: the token each sequence adds; positions: its position (= context length - 1).
            block_tables: each sequence's blocks (covering position + 1 tokens).
            token_slots: each sequence's adapter slot (-1 = none).
            chunk_table: the LoRA chunk table (``triton_sgmv._chunk_table`` of ``token_slots`` with
                ``BLOCK_M = 16``, int32 [4, B] on the host) or None when no sequence has an adapter.
        """
        B = len(token_ids)
        bucket = self.bucket_for(B)
        lora = chunk_table is not None
        key = (bucket, lora)
        g = self._graphs.get(key)
        if g is None and self.capture:
            g = self._graphs[key] = self._capture(bucket, lora)
        n, w, bs = self.buckets[-1], self.max_blocks, self.kv.block_size
        h = self._host
        h.zero_()
        h[0:B] = torch.tensor(list(token_ids))
        pos = torch.tensor(list(positions))
        h[n : n + B] = pos
        tables = torch.zeros(B, w, dtype=torch.int64)
        for b, bt in enumerate(block_tables):
            tables[b, : len(bt)] = torch.tensor(list(bt))
        h[2 * n : 2 * n + B] = tables.gather(1, (pos // bs)[:, None]).squeeze(1) * bs + pos % bs
        h[3 * n : 4 * n] = 1
        h[3 * n : 3 * n + B] = pos + 1
        h[4 * n : 5 * n] = -1
        h[4 * n : 4 * n + B] = torch.tensor(list(token_slots))
        h[5 * n : 5 * n + B * w] = tables.flatten()
        dev = h[: 5 * n + bucket * w].to(self.device, non_blocking=True)
        self.input_ids.copy_(dev[0:n])
        self.positions.copy_(dev[n : 2 * n])
        self.slot_mapping.copy_(dev[2 * n : 3 * n])
        self.seq_lens.copy_(dev[3 * n : 4 * n])
        self.token_slots.copy_(dev[4 * n : 5 * n])
        self.block_tables[:bucket].copy_(dev[5 * n : 5 * n + bucket * w].view(bucket, w))
        if not self.capture:  # eager: the same buffers and padding, a LoRA plan of the padded slots
            from multilora.kernels import build_lora_plan
            from multilora.runtime.model import StepPlan

            self._graphs[key] = None
            plan = self._plans(bucket, False, None)
            slots = list(token_slots) + [-1] * (bucket - B)
            plan = StepPlan(input_ids=plan.input_ids, positions=plan.positions, q_lens=plan.q_lens,
                            last_index=plan.last_index, attn=plan.attn, lora=build_lora_plan(slots, device=self.device))
            return self._forward(plan)[:B]
        if lora:
            full = torch.zeros(4, bucket, dtype=torch.int32)
            full[1].fill_(-1)
            full[:, :B] = chunk_table[:, :B]
            g.chunk_table.copy_(full.to(self.device, non_blocking=True))
        g.graph.replay()
        return g.logits[:B]

    @property
    def captured(self) -> list[tuple[int, bool]]:
        return sorted(self._graphs)
