"""Steps replayed from CUDA graphs: decode steps whole, one graph per batch-size bucket (and per LoRA on/off)
(``DecodeGraphs``), and prefill and mixed steps piecewise, per token bucket (``PiecewiseGraphs``, below).

A decode step of ``B`` sequences is padded up to the smallest bucket ``>= B`` (1, 2, 4, 8, then multiples
of 16 up to ``max_batch_size``). Each bucket's graph is captured the first time it is needed, after one
eager warm-up run, and replayed afterwards. What a graph reads is its static plan: the runner's
``DecodeBuffers`` (``multilora.runtime.runner``), written in place before each replay; this module only
captures and replays.

The captured work is the model forward and the logits of every row (float32 ``[bucket, vocab]``), so a
replay costs one launch; sampling runs after it on the same stream.

Graphs are used only where every kernel of the step is graph-safe: CUDA, and the Triton backends for
LoRA and attention (their launch grids depend on the bucket size, never on the lengths or slots).

**Piecewise graphs.** A prefill or mixed step's attention has a launch grid that follows the step's prompt
lengths (its tile table), so it cannot be replayed. Everything else of a layer is per-token work whose launches
depend on the token count only. ``PiecewiseGraphs`` pads a step of ``T`` tokens to the smallest token bucket
``>= T`` (``token_buckets``) and replays ``num_layers + 1`` graphs: the first runs the embeddings up to layer 0's
RoPE and KV write, each next one a layer's o projection through the next layer's KV write, the last one ending
with the final norm; the runner's eager attention of layer ``i`` runs between graphs ``i`` and ``i + 1`` over
the step's real tokens, reading and writing static buffers. Eagerly, the host launching the ~20 kernels per
layer takes longer than the GPU runs them for steps of up to ~1,500 tokens (``bench/profile_decode.py
--mixed-tokens``); replayed, the host launches one graph and one attention kernel per layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

log = logging.getLogger("multilora")


def token_buckets(max_tokens: int) -> list[int]:
    """Step sizes (tokens) that get piecewise graphs: multiples of 16 up to 128, of 64 up to 512, of 128 up to
    1,024, then of 256, up to and including ``max_tokens`` rounded up to a multiple of 16 (at most 1/8 of a step
    past 128 tokens is padding). Empty for ``max_tokens < 1``."""
    if max_tokens < 1:
        return []
    top = -(-max_tokens // 16) * 16
    sizes, t = [], 16
    while t < top:
        sizes.append(t)
        t += 16 if t < 128 else 64 if t < 512 else 128 if t < 1024 else 256
    return sizes + [top]


def bucket_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 16, up to (and always including)
    ``max_batch_size``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted(set(sizes + [max_batch_size]))


class CaptureStream:
    """The one CUDA stream that every graph capture of an engine (decode and piecewise) and its warm-up run on,
    made on first use. cuBLAS keeps a workspace per (handle, stream) for the life of the process (32 MiB each on
    sm_90, through torch's caching allocator): one stream holds one, which the memory plan counts
    (``runner.CAPTURE_WORKSPACE_BYTES``); a new stream per capture held one more for every bucket captured."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None

    def get(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream


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
                 capture: bool = True, stream: CaptureStream | None = None) -> None:
        self._forward = forward
        self.buckets = buckets
        self.device = device
        self.capture = capture
        self._graphs: dict[Hashable, _Graph] = {}
        self._pool = None  # one memory pool shared by all graphs
        #: the stream every capture's warm-up and capture run on (``CaptureStream``; the runner shares one with the
        #: piecewise graphs). A new stream per capture once held one more cuBLAS workspace for every bucket
        #: captured (the GPU memory-regression test saw +32 MiB when a later step first reached a new bucket).
        self.stream = stream if stream is not None else CaptureStream(device)

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
        stream = self.stream.get()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            self._forward(plan)  # warm-up: compiles kernels, settles allocator and cuBLAS workspaces
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # captured on the warm-up's stream, whose cuBLAS workspace the warm-up settled (torch.cuda.graph's own
        # default capture stream would be a second one)
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, stream=stream):
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


@dataclass
class _Pieces:
    graphs: list[Any] | None  # torch.cuda.CUDAGraph per piece (None: run eagerly, ``capture=False``)
    ctx: Any  # the captured context: keeps every tensor the graphs read alive


class PiecewiseGraphs:
    """Prefill and mixed steps replayed piecewise (module docstring), keyed by (token bucket, lora).

    Args:
        num_pieces: graphs per step (``num_layers + 1``).
        buckets: the token counts that get graphs (``token_buckets``).
        device: the CUDA device.
        capture: False runs every piece eagerly at each step instead (the same padded static-buffer step,
            testable on a CPU).
    """

    def __init__(self, num_pieces: int, buckets: list[int], device: torch.device, *, capture: bool = True,
                 stream: CaptureStream | None = None) -> None:
        self.num_pieces = num_pieces
        self.buckets = buckets
        self.device = device
        self.capture = capture
        self._steps: dict[Hashable, _Pieces] = {}
        self._pool = None  # one memory pool for every piece of every bucket (one step replays at a time)
        self.stream = stream if stream is not None else CaptureStream(device)  # and one capture stream (``_record``)

    def bucket_for(self, tokens: int) -> int | None:
        """The smallest bucket holding ``tokens``, or None if it is larger than every bucket."""
        return next((b for b in self.buckets if b >= tokens), None)

    def run(self, key: Hashable, make_ctx: Callable[[], Any], piece: Callable[[Any, int], None],
            between: Callable[[int], None]) -> None:
        """One step of ``key``, its static inputs already written: ``piece(ctx, k)`` for k = 0 .. num_pieces - 1
        (replayed from graphs; captured on first use from ``ctx = make_ctx()``, after one eager run of the whole
        step), with ``between(k)`` run eagerly after every piece but the last."""
        p = self._steps.get(key)
        if p is None:
            ctx = make_ctx()
            graphs = self._record(ctx, piece, between) if self.capture else None
            p = self._steps[key] = _Pieces(graphs, ctx)
            log.debug("piecewise graphs for %s (capture=%s)", key, self.capture)
        if p.graphs is None:
            self._eager(p.ctx, piece, between)
            return
        last = self.num_pieces - 1
        for k, g in enumerate(p.graphs):
            g.replay()
            if k < last:
                between(k)

    def _eager(self, ctx: Any, piece: Callable[[Any, int], None], between: Callable[[int], None]) -> None:
        """The step's pieces run eagerly, ``between(k)`` after every piece but the last."""
        last = self.num_pieces - 1
        with torch.inference_mode():
            for k in range(self.num_pieces):
                piece(ctx, k)
                if k < last:
                    between(k)

    def _record(self, ctx: Any, piece: Callable[[Any, int], None], between: Callable[[int], None]) -> list[Any]:
        """Run the step once eagerly (compiles kernels, settles cuBLAS; a step is idempotent: its KV writes and
        outputs are the same when it runs again), then capture each piece in its own graph, on the one capture
        stream, into the shared pool. (``capture_begin``/``capture_end`` directly: ``torch.cuda.graph`` would synchronize and
        empty the allocator's cache around each of the ``num_pieces`` captures.)"""
        self._eager(ctx, piece, between)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream(self.device)
        # one capture stream for every piece: cuBLAS keeps a workspace per stream, so a stream per capture held one
        # workspace each in the pool (a 214 MB pool instead of ~20 MB for 10 buckets, H200; pytorch issue #99196)
        stream = self.stream.get()
        torch.cuda.synchronize(self.device)
        graphs = []
        with torch.inference_mode(), torch.cuda.stream(stream):
            for k in range(self.num_pieces):
                g = torch.cuda.CUDAGraph()
                g.capture_begin(pool=self._pool)
                try:
                    piece(ctx, k)
                finally:
                    g.capture_end()
                graphs.append(g)
        main.wait_stream(stream)
        return graphs

    def reset(self) -> None:
        """Drop every captured step (captured again on next use)."""
        self._steps.clear()
        self._pool = None

    @property
    def captured(self) -> list[Hashable]:
        """The keys (bucket, lora) that have graphs (or, with ``capture=False``, a context)."""
        return sorted(self._steps)
