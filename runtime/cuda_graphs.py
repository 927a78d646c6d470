"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (and per LoRA on/off).

A decode step of ``B`` sequences is padded up to the smallest bucket ``>= B`` (1, 2, 4, 8, then multiples
of 16 up to ``max_batch_size``). Each bucket's graph is captured the first time it is needed, after one
eager warm-up run, and replayed afterwards. What a graph reads is its static plan: the runner's
``DecodeBuffers`` (``multilora.runtime.runner``), written in place before each replay; this module only
captures and replays.

The captured work is the model forward and the logits of every row (float32 ``[bucket, vocab]``), so a
replay costs one launch; sampling runs after it on the same stream.

Graphs are used only where every kernel of the step is graph-safe: CUDA, and the Triton backends for
LoRA and attention (their launch grids depend on the bucket size, never on the lengths or slots).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

log = logging.getLogger("multilora")


def bucket_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 16, up to (and always including)
    ``max_batch_size``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted(set(sizes + [max_batch_size]))


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph (or a stand-in with replay(), in tests)
    logits: torch.Tensor  # float32 [bucket, vocab], written by each replay
    plan: Any  # the captured plan: keeps every tensor the graph reads alive


class DecodeGraphs:
    """Captured decode steps, keyed by (bucket, lora).

    Args:
        forward: ``forward(plan) -> logits`` float32 [bucket, vocab]: what is captured (the runner's).
        buckets: the batch sizes that get a graph (``bucket_sizes``).
        device: the CUDA device.
        capture: False runs ``forward(plan)`` eagerly at every step instead of replaying a graph: the same
            padded static-buffer step, testable on a CPU.
    """

    def __init__(self, forward: Callable[[Any], torch.Tensor], buckets: list[int], device: torch.device, *,
                 capture: bool = True) -> None:
        self._forward = forward
        self.buckets = buckets
        self.device = device
        self.capture = capture
        self._graphs: dict[Hashable, _Graph] = {}
        self._pool = None  # one memory pool shared by all graphs

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` rows, or None if it is larger than every bucket."""
        return next((b for b in self.buckets if b >= batch), None)

    def replay(self, key: Hashable, make_plan: Callable[[], Any]) -> torch.Tensor:
        """The logits of ``key``'s step, its static inputs already written: the graph is captured from
        ``make_plan()`` on first use, then replayed (``capture=False``: that plan is run eagerly)."""
        g = self._graphs.get(key)
        if g is None:
            plan = make_plan()
            graph, logits = self._record(plan) if self.capture else (None, None)
            g = self._graphs[key] = _Graph(graph, logits, plan)
            log.debug("decode graph for %s (capture=%s)", key, self.capture)
        if g.graph is None:
            return self._forward(g.plan)
        g.graph.replay()
        return g.logits

    def _record(self, plan: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up, then capture ``forward(plan)`` in a CUDA graph; (graph, its logits buffer)."""
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

    def reset(self) -> None:
        """Drop every captured graph (they are captured again on next use): after a change of something capture
        bakes in, such as ``DecoderModel.lora_side_max_tokens``."""
        self._graphs.clear()
        self._pool = None  # the old pool goes with its last graph; capturing into its handle again would fail

    @property
    def captured(self) -> list[Hashable]:
        """The keys (bucket, lora) that have a graph (or, with ``capture=False``, a plan)."""
        return sorted(self._graphs)
