"""The LoRA apply op: shrink + expand for a batch in which every token names its own adapter slot.

Semantics (for each fused slice ``i`` with output columns ``[c_i, c_i + d_out_i)``)::

    for every token t with s = token_slots[t] >= 0 and r = ranks_i[s] > 0:
        y[t, c_i : c_i + d_out_i] += scalings_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T
    rows with s == -1 (and modules an adapter does not touch, r == 0) are left exactly as they were.

``A_i[s]`` [r, d_in] and ``B_i[s]`` [d_out_i, r] are read from the adapter pool at the slot's per-module offsets
(``offsets_a_i[s]``, ``offsets_b_i[s]``; layout: ``multilora.memory.pool``); shrink is ``v = x A^T`` (d_in -> r),
expand is ``y += scaling * v B^T`` (r -> d_out). Accumulation is in float32.

Two descriptors feed the op, both passed explicitly (nothing is read from module-global state):

- ``LoRASlices`` (``lora_slices``): one layer's fused projection in the pool, built once when the pool is
  bound and validated then; it never changes (the metadata tensors it points at are rewritten in place by the
  pool when adapters load, leave or move, and read at every call).
- ``LoRAPlan`` (``build_lora_plan``): which slot each token of the step uses, with its chunk table, built
  once per engine step. Its tensors may also be static buffers rewritten in place between calls (a
  CUDA-graph decode step): no backend caches anything derived from their values.

Backends: ``"torch"`` (``lora_apply_torch``, this file; the CPU path and the test oracle) and ``"triton"``
(``multilora.kernels.triton_sgmv``). ``lora_apply(..., backend=None)`` picks triton for CUDA tensors when it
is importable, else torch (``resolve_backend``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from multilora.kernels.backends import select_triton, to_device


@dataclass(frozen=True)
class LoRAModuleView:
    """Where one (layer, module) lives in the adapter pool: what a kernel needs to read every slot's A and B
    (layout: ``multilora.memory.pool``, which builds these with ``AdapterPool.module_view``).

    All tensors are shared with the pool (no copies) and read in place at every call: the pool may rewrite the
    offsets between calls (compaction). For a slot ``s`` of rank ``r = ranks[s] > 0``, row ``j < r`` of A is
    ``buffer[offsets_a[s] + j * d_in : ... + d_in]`` and row ``j`` of B^T is
    ``buffer[offsets_b[s] + j * d_out : ... + d_out]``.
    """

    buffer: torch.Tensor  # [num_elems], the pool's flat buffer
    ranks: torch.Tensor  # int32 [max_slots]
    scalings: torch.Tensor  # float32 [max_slots]
    offsets_a: torch.Tensor  # int64 [max_slots], elements into buffer; a multiple of offset_align
    offsets_b: torch.Tensor  # int64 [max_slots]; offsets_a + r * d_in
    d_in: int
    d_out: int
    max_rank: int  # the pool's largest rank (rows of the kernels' rank intermediate)
    offset_align: int  # every offsets_a value is a multiple of this (the pool's page, 64 elements)
    layer: int
    module: str


# ---------------------------------------------------------------------------------------------- fused slices
#: Most slices of one fused projection (q/k/v is 3): the kernels find an output tile's slice from three
#: boundaries passed as scalars (no memory read before the tile's first load).
MAX_SLICES = 4


@dataclass(frozen=True)
class LoRASlices:
    """One layer's fused projection in the pool (q/k/v, gate/up, o or down): 1 to ``MAX_SLICES`` slices, all from
    one pool and with one ``d_in``, laid side by side in the columns of ``y``.

    Build it with ``lora_slices(views)``, which validates everything that cannot change between calls.

    Attributes:
        views: one ``LoRAModuleView`` per slice, in the column order of ``y``.
        table: int64 ``[2, num_slices]`` on the pool's device, contiguous, one row per field: ``0`` d_out, ``1``
            col (the slice's first column in ``y``). Kernels read per-slice values here.
        meta_stride: elements from one slice's ``ranks`` (and ``scalings``, ``offsets_a``, ``offsets_b``) row to the
            next's: slice ``i`` reads ``ranks[i * meta_stride + slot]`` from ``views[0].ranks`` (and likewise the
            offsets). The slices of a fused projection are consecutive target modules of one layer, so their rows
            are evenly spaced in the pool's ``[layers, 7, max_slots]`` tables (``meta_stride = max_slots``); a
            kernel then finds a slot's rank and offsets without waiting for a table read (the table is cold in L2
            at each launch: one DRAM round trip that gated the rank load cost 2-4 us per layer at batch 1 on an
            H200).
        d_in: the input width every slice shares.
        d_out: the sum of the slices' widths (columns of ``y``).
        align: the largest power of two up to 16 dividing ``d_in``, every width and column of the table and the
            pool's ``offset_align``, so it divides every ``offsets_a`` and ``offsets_b`` value too (``offsets_b =
            offsets_a + r * d_in``): what the kernels may assume of the offsets and widths they read (Triton
            specialises integer arguments on divisibility by 16 and vectorises the row loads and stores with it;
            values read from memory carry no such fact unless it is declared).

    Example: q/k/v of layer 1 of SmolLM2-135M (hidden 576, q 576, k/v 192) in a pool with ``max_slots = 8``
    (``ranks``/``offsets`` are ``[layers, 7, max_slots]``, so module ``m``'s row sits ``8 * m`` elements after
    q's: ``meta_stride = 8``; ``align = 16``)::

        table = [[576, 192, 192],    # d_out
                 [  0, 576, 768]]    # col
    """

    views: tuple[LoRAModuleView, ...]
    table: torch.Tensor
    d_in: int
    d_out: int
    meta_stride: int
    align: int = 1

    @property
    def num_slices(self) -> int:
        return len(self.views)

    @property
    def buffer(self) -> torch.Tensor:
        """The pool's flat buffer ``[num_elems]`` every slice reads."""
        return self.views[0].buffer

    @property
    def ranks(self) -> torch.Tensor:
        """Slice ``i``'s ranks start ``i * meta_stride`` elements after this: ``views[0].ranks``."""
        return self.views[0].ranks

    @property
    def scalings(self) -> torch.Tensor:
        """Slice ``i``'s scalings start ``i * meta_stride`` elements after this: ``views[0].scalings``."""
        return self.views[0].scalings

    @property
    def offsets_a(self) -> torch.Tensor:
        """Slice ``i``'s A offsets start ``i * meta_stride`` elements after this: ``views[0].offsets_a``."""
        return self.views[0].offsets_a

    @property
    def offsets_b(self) -> torch.Tensor:
        """Slice ``i``'s B^T offsets start ``i * meta_stride`` elements after this: ``views[0].offsets_b``."""
        return self.views[0].offsets_b

    @property
    def max_slots(self) -> int:
        return self.views[0].ranks.shape[0]

    @property
    def max_rank_rows(self) -> int:
        """Rank rows of the kernels' intermediate per token and slice: the pool's ``max_rank``."""
        return self.views[0].max_rank


def _elem_offset(t: torch.Tensor, base: torch.Tensor, what: str) -> int:
    delta = t.data_ptr() - base.data_ptr()
    if delta % t.element_size():
        raise ValueError(f"views: {what} is not a whole number of elements away from the first slice's")
    return delta // t.element_size()


_META = (("ranks", torch.int32), ("scalings", torch.float32), ("offsets_a", torch.int64), ("offsets_b", torch.int64))


def lora_slices(views: Sequence[LoRAModuleView]) -> LoRASlices:
    """Describe the fused slices ``views`` (in the column order of ``y``) for ``lora_apply``; checked once here.

    Raises:
        ValueError: no views or more than ``MAX_SLICES``; views from different pools (buffer) or with different
            ``d_in`` or ``max_rank``; ranks that are not int32, scalings that are not float32 or offsets that are
            not int64, not contiguous ``[max_slots]`` or not on the pool's device; metadata rows that are not
            evenly spaced (slices that are not consecutive target modules of one layer); a non-contiguous or
            non-1-D pool buffer. Each message names the module.
    """
    views = tuple(views)
    if not 1 <= len(views) <= MAX_SLICES:
        raise ValueError(f"views: expected 1 to {MAX_SLICES} LoRAModuleViews (fused slices), got {len(views)}")
    v0 = views[0]
    device, max_slots = v0.buffer.device, v0.ranks.shape[0]
    if v0.buffer.dim() != 1 or not v0.buffer.is_contiguous():
        raise ValueError(f"views: the pool buffer of {v0.module} must be contiguous and 1-D, got shape "
                         f"{tuple(v0.buffer.shape)}")
    spacing = {name: [] for name, _ in _META}
    for v in views:
        if v.buffer.data_ptr() != v0.buffer.data_ptr():
            raise ValueError(f"views: fused slices must come from one pool ({v.module} does not)")
        if v.d_in != v0.d_in:
            raise ValueError(f"views: fused slices share one d_in; {v.module} has {v.d_in}, {v0.module} {v0.d_in}")
        if v.max_rank != v0.max_rank or v.offset_align != v0.offset_align:
            raise ValueError(f"views: max_rank / offset_align of {v.module} differ from {v0.module}'s")
        for name, dtype in _META:
            t = getattr(v, name)
            if t.dtype != dtype:
                raise ValueError(f"views: {v.module} {name} must be {dtype}, got {t.dtype}")
            if t.dim() != 1 or t.shape[0] != max_slots or t.stride(0) != 1 or t.device != device:
                raise ValueError(f"views: {v.module} {name} must be contiguous [{max_slots}] on {device}, got "
                                 f"shape {tuple(t.shape)}, stride {t.stride()} on {t.device}")
            spacing[name].append(_elem_offset(t, getattr(v0, name), f"{v.module} {name}"))
    stride = spacing["ranks"][1] if len(views) > 1 else 0
    for i, v in enumerate(views):
        for name, _ in _META:
            if spacing[name][i] != i * stride:
                raise ValueError(f"views: the slices' ranks, scalings and offsets rows must be evenly spaced "
                                 f"(consecutive target modules of one layer); {v.module}'s {name} row is "
                                 f"{spacing[name][i]} elements from {v0.module}'s, expected {i * stride}")
    widths = [v.d_out for v in views]
    cols = np.cumsum([0] + widths[:-1]).tolist()
    rows = [widths, cols]
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    align = 16
    while align > 1 and any(v % align for v in [v0.d_in, v0.offset_align, *widths, *cols]):
        align //= 2
    return LoRASlices(views=views, table=table, d_in=v0.d_in, d_out=sum(widths), meta_stride=stride, align=align)


# ---------------------------------------------------------------------------------------------- step plan
@dataclass(frozen=True)
class LoRAPlan:
    """Which adapter slot each token of a step uses, and the chunk table the kernels walk.

    Attributes:
        token_slots: int32 ``[num_tokens]`` on the compute device; ``-1`` = no adapter.
        chunks: int32 ``[4, max(num_tokens, 1)]`` on the same device, contiguous; rows ``sorted_tokens``,
            ``chunk_slot``, ``chunk_start``, ``chunk_len`` (below).
        block_m: the most tokens a chunk holds (what ``chunks`` was built with).
        has_lora: False when no token has an adapter (every op is then a no-op).

    Chunk table. Tokens are stably sorted by slot (tokens with slot -1 dropped) and cut into **chunks** of at
    most ``block_m`` tokens of one slot, chunk after chunk in sorted order; a kernel program takes one chunk
    (for decode with distinct adapters a chunk is one token: BGMV). Entries past the chunks hold slot ``-1``
    (start 0, length 0), and sorted entries past the adapted tokens hold token 0. Worked example with
    ``token_slots = [1, 2, 3, 2, 3, 2, 3, -1]`` and ``block_m = 2``::

        sorted_tokens = [0, 1, 3, 5, 2, 4, 6, 0]     # tokens grouped by slot (stable); tail padded with 0
        chunk_slot    = [1, 2, 2, 3, 3, -1, -1, -1]   # one entry per possible chunk, -1 = none
        chunk_start   = [0, 1, 3, 4, 6, 0, 0, 0]      # into sorted_tokens
        chunk_len     = [1, 2, 1, 2, 1, 0, 0, 0]

    Invariants: the chunks tile ``sorted_tokens[:n]`` (``n`` adapted tokens) in order, slots ascending;
    ``chunk_len <= block_m``. Token 7 (slot -1) is in no chunk and is never touched (``lora_delta`` writes zeros
    there).

    The tensors may be static buffers rewritten in place between calls (a CUDA-graph decode step): every
    backend derives what it needs from them at call time, nothing is cached from their values, but for
    ``num_segments``: a plan whose tensors are rewritten must have it None or a bound that holds for every rewrite
    (``build_lora_plan`` sets the exact count of its own table; a table rewritten with more distinct slots under it
    would leave chunks without a program: wrong results, no error).
    """

    token_slots: torch.Tensor
    chunks: torch.Tensor
    block_m: int
    has_lora: bool
    #: at most this many distinct slots in the step: exact for a plan built for one step (``build_lora_plan``), the
    #: engine's batch for the static plans of its piecewise graphs (a step holds at most ``max_batch_size``
    #: sequences); the Triton launches then size their grid by it instead of the pool's ``max_slots``
    #: (``triton_sgmv.num_chunks``). None: any grouping (the bound by ``max_slots``)
    num_segments: int | None = None
    #: the most runs of one slot (maximal stretches of consecutive tokens on the same slot, -1 included) that any
    #: ``RUN_BLOCK``-token block of the step holds, blocks taken in token order from token 0: a prefill of whole
    #: prompts has 1 or 2 per block, a decode batch of distinct adapters up to ``RUN_BLOCK``. Kernels that take
    #: consecutive tokens instead of chunks visit a block's slots one after the other (``triton_sgmv.glu_shrink``):
    #: this bounds their passes. Exact for a plan built for one step (``build_lora_plan``); None: unknown (the static
    #: plans of CUDA graphs, rewritten in place)
    max_block_runs: int | None = None

    def __post_init__(self) -> None:
        ts, c = self.token_slots, self.chunks
        if ts.dim() != 1 or ts.dtype != torch.int32:
            raise ValueError(f"token_slots: expected int32 [num_tokens], got {ts.dtype} {tuple(ts.shape)}")
        want = (4, max(ts.shape[0], 1))
        if tuple(c.shape) != want or c.dtype != torch.int32 or not c.is_contiguous() or c.device != ts.device:
            raise ValueError(f"chunks: expected contiguous int32 {list(want)} on {ts.device}, got {c.dtype} "
                             f"{tuple(c.shape)} strides {c.stride()} on {c.device}")
        if self.block_m < 1:
            raise ValueError(f"block_m: expected >= 1, got {self.block_m}")
        for name in ("num_segments", "max_block_runs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"{name}: expected None or an int >= 0, got {v!r}")

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    def slot_groups(self) -> list[tuple[int, torch.Tensor]]:
        """For each distinct slot ``>= 0`` in ascending order, the int64 indices of its tokens (ascending, on
        the plan's device), read from ``chunks`` now (a host sync on a GPU). For the example above:
        ``[(1, [0]), (2, [1, 3, 5]), (3, [2, 4, 6])]``."""
        c = self.chunks.cpu().numpy()
        live = np.flatnonzero(c[1] >= 0)
        if not live.size:
            return []
        slot, start, length = c[1, live], c[2, live], c[3, live]
        first = np.ones(live.size, dtype=bool)
        np.not_equal(slot[1:], slot[:-1], out=first[1:])
        first = np.flatnonzero(first)  # each slot's first chunk
        ends = np.empty_like(first)  # one past each slot's last token in sorted_tokens
        ends[:-1] = start[first[1:]]
        ends[-1] = start[-1] + length[-1]
        assert start[0] == 0, "chunks tile sorted_tokens from its start"
        index = torch.from_numpy(c[0, : ends[-1]].astype(np.int64)).to(self.token_slots.device)
        counts = (ends - start[first]).tolist()
        return list(zip(slot[first].tolist(), index.split(counts)))


#: ``LoRAPlan.max_block_runs``' block, in tokens
RUN_BLOCK = 64


def max_block_runs(slots: np.ndarray, block: int = RUN_BLOCK) -> int:
    """The most runs of one slot in any ``block``-token block of ``slots`` (``LoRAPlan.max_block_runs``; 0 for no
    tokens). Worked example, ``block = 4``: ``[1, 1, 2, -1 | 3, 3, 3, 3 | 5]`` has 3, 1 and 1 runs: 3."""
    T = slots.size
    if T == 0:
        return 0
    starts = np.ones(T, dtype=np.int64)  # 1 where a run starts within its block (a block's first token always)
    np.not_equal(slots[1:], slots[:-1], out=starts[1:], casting="unsafe")
    starts[::block] = 1
    return int(np.add.reduceat(starts, np.arange(0, T, block)).max())


def block_m_for(num_tokens: int) -> int:
    """Tokens per chunk: 16 for decode-sized batches (one token per chunk when adapters are distinct),
    larger tiles for prefill. A function of the token count only (CUDA-graph friendly)."""
    return 16 if num_tokens <= 512 else 64


def _host_slots(token_slots: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(token_slots, torch.Tensor):
        return token_slots.detach().to("cpu", torch.int64).numpy().reshape(-1)
    return np.asarray(token_slots, dtype=np.int64).reshape(-1)


def fill_chunk_table(out: np.ndarray, token_slots: Sequence[int] | np.ndarray | torch.Tensor, block_m: int) -> None:
    """Write the chunk table of ``token_slots`` (``LoRAPlan``) into ``out`` in place: int32 ``[4, n]`` with
    ``n >= len(token_slots)``; entries past the chunks are padding (sorted 0, slot -1, start 0, len 0) up to
    ``n``. ``token_slots``: host ints (sequence or ndarray) or a tensor (read back to the host). Built with
    numpy in a fixed number of vectorised steps (no Python loop over tokens or chunks).

    Raises:
        ValueError: ``out`` is not an int32 ndarray of shape ``[4, n >= T]``, or ``block_m < 1``.
    """
    slots = _host_slots(token_slots)
    T = slots.size
    if not isinstance(out, np.ndarray) or out.dtype != np.int32 or out.ndim != 2 or out.shape[0] != 4 or out.shape[1] < T:
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"out: expected an int32 numpy array of shape [4, n >= {T}], got {got}")
    if block_m < 1:
        raise ValueError(f"block_m: expected >= 1, got {block_m}")
    order = np.argsort(slots, kind="stable")
    order = order[np.count_nonzero(slots < 0) :]  # the -1 tokens sort first
    n = order.size
    out[0, :n] = order
    out[0, n:] = 0
    c = 0
    if n:
        s = slots[order]
        pos = np.arange(n)
        starts = np.zeros(n, dtype=np.int64)  # the first sorted position of each position's run of one slot
        np.copyto(starts[1:], pos[1:], where=s[1:] != s[:-1])
        np.maximum.accumulate(starts, out=starts)
        first = np.flatnonzero((pos - starts) % block_m == 0)  # chunk starts: a run's start, then every block_m
        c = first.size  # <= n <= T
        out[1, :c] = s[first]
        out[2, :c] = first
        out[3, : c - 1] = first[1:] - first[:-1]  # chunks tile [0, n): each ends where the next starts
        out[3, c - 1] = n - first[-1]
    out[1, c:] = -1
    out[2:, c:] = 0


def chunk_table(token_slots: Sequence[int] | np.ndarray | torch.Tensor, block_m: int,
                device: torch.device | str) -> torch.Tensor:
    """The chunk table of ``token_slots`` (``LoRAPlan``): int32 ``[4, max(T, 1)]`` on ``device``."""
    slots = _host_slots(token_slots)
    out = np.empty((4, max(slots.size, 1)), dtype=np.int32)
    fill_chunk_table(out, slots, block_m)
    return torch.from_numpy(out).to(device)


def build_lora_plan(token_slots: Sequence[int] | torch.Tensor, device: torch.device | str = "cpu", *,
                    block_m: int | None = None) -> LoRAPlan:
    """Build the per-step LoRA plan from one slot id per token (``-1`` = no adapter).

    Args:
        token_slots: ``[num_tokens]`` ints (list or tensor), each ``-1`` or a resident slot.
        device: where the plan's tensors live (the model's device); both go in one host-to-device copy.
        block_m: tokens per chunk (default ``block_m_for(num_tokens)``).

    Raises:
        ValueError: a slot id below -1 or a tensor that is not 1-D.
    """
    slots = torch.as_tensor(token_slots, dtype=torch.int64).cpu()
    if slots.dim() != 1:
        raise ValueError(f"token_slots: expected a 1-D sequence of slot ids, got shape {tuple(slots.shape)}")
    if slots.numel() and int(slots.min()) < -1:
        raise ValueError(f"token_slots: slot ids must be >= -1, got {int(slots.min())}")
    s = slots.numpy()
    T, W = s.size, max(s.size, 1)
    bm = block_m_for(T) if block_m is None else block_m
    host = np.empty(4 * W + T, dtype=np.int32)  # [chunks (4 x W) | token_slots (T)]: one copy to the device
    chunks = host[: 4 * W].reshape(4, W)
    fill_chunk_table(chunks, s, bm)
    host[4 * W :] = s
    dev = to_device(torch.from_numpy(host), device)  # (pinned, non-blocking on CUDA)
    live = chunks[1][chunks[1] >= 0]  # the chunks' slots, ascending: the step's distinct slots are its runs
    segments = int(np.count_nonzero(live[1:] != live[:-1])) + 1 if live.size else 0
    return LoRAPlan(token_slots=dev[4 * W :], chunks=dev[: 4 * W].view(4, W), block_m=bm,
                    has_lora=bool(chunks[1, 0] >= 0), num_segments=segments, max_block_runs=max_block_runs(s))


# ---------------------------------------------------------------------------------------------- the op
def _check(y: torch.Tensor, x: torch.Tensor, slices: LoRASlices, plan: LoRAPlan) -> None:
    if not isinstance(slices, LoRASlices):
        raise ValueError(f"slices: expected a LoRASlices (lora_slices(views)), got {type(slices).__name__}")
    if x.dim() != 2 or y.dim() != 2:
        raise ValueError(f"x and y must be 2-D [num_tokens, features], got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[0] != plan.num_tokens or y.shape[0] != plan.num_tokens:
        raise ValueError(
            f"plan has {plan.num_tokens} tokens but x has {x.shape[0]} rows and y has {y.shape[0]} rows"
        )
    if x.shape[1] != slices.d_in:
        raise ValueError(f"x: expected {slices.d_in} features for module {slices.views[0].module}, got {x.shape[1]}")
    if y.shape[1] != slices.d_out:
        raise ValueError(f"y: expected {slices.d_out} columns (sum of fused slice widths), got {y.shape[1]}")


def gather_adapter(view: LoRAModuleView, slot: int) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """(A [r, d_in], B^T [r, d_out], scaling, r) of one slot for one module: views of the pool buffer at the
    slot's offsets (read now: a host sync on a GPU)."""
    r = int(view.ranks[slot])
    oa, ob = int(view.offsets_a[slot]), int(view.offsets_b[slot])
    a = view.buffer[oa : oa + r * view.d_in].view(r, view.d_in)
    bt = view.buffer[ob : ob + r * view.d_out].view(r, view.d_out)
    return a, bt, float(view.scalings[slot]), r


def lora_apply_torch(y: torch.Tensor, x: torch.Tensor, slices: LoRASlices, plan: LoRAPlan) -> torch.Tensor:
    """Torch reference of ``lora_apply``: a loop over the distinct slots of the batch (fp32 math), read from
    ``plan.chunks`` at call time (``LoRAPlan.slot_groups``). The LoRA term is rounded to y's dtype before the add,
    then the sum (peft's ``base_layer(x) + lora_B(lora_A(x)) * scaling``; the Triton kernels round the same way)."""
    if not plan.has_lora:
        return y
    groups = plan.slot_groups()
    col = 0
    for v in slices.views:
        ys = y[:, col : col + v.d_out]
        for slot, idx in groups:
            a, bt, scaling, r = gather_adapter(v, slot)
            if r == 0:
                continue
            xs = x.index_select(0, idx).float()  # [n_s, d_in]
            delta = (xs @ a.float().t()) @ bt.float()  # shrink [n_s, r], expand [n_s, d_out]
            delta.mul_(scaling)
            ys.index_copy_(0, idx, (ys.index_select(0, idx).float() + delta.to(y.dtype).float()).to(y.dtype))
        col += v.d_out
    return y


def lora_delta_torch(out: torch.Tensor, x: torch.Tensor, slices: LoRASlices, plan: LoRAPlan) -> torch.Tensor:
    """Torch reference of ``lora_delta``: ``lora_apply_torch`` on ``out`` zeroed first."""
    return lora_apply_torch(out.zero_(), x, slices, plan)


def resolve_backend(backend: str | None, x: torch.Tensor) -> Callable:
    """The apply function for ``backend`` ("torch", "triton" or None = triton on CUDA if available).

    Raises:
        ValueError: an unknown backend name, or "triton" when it cannot be used.
    """
    mod = select_triton(backend, x, "triton_sgmv")
    return lora_apply_torch if mod is None else mod.lora_apply_triton


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    slices: LoRASlices,
    plan: LoRAPlan,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Add every token's LoRA delta to ``y`` in place (semantics in the module docstring).

    Args:
        y: ``[num_tokens, slices.d_out]`` base output, float16/bfloat16/float32; updated in place.
        x: ``[num_tokens, slices.d_in]`` layer input, same device.
        slices: the fused slices (``lora_slices``: e.g. q, k, v), in the column order of ``y``.
        plan: the step's ``LoRAPlan``.
        backend: ``"torch"``, ``"triton"`` or None (triton on CUDA when available, else torch).

    Returns:
        ``y``.

    Raises:
        ValueError: shapes that disagree with each other, with the slices or with the plan; ``slices`` not a
            ``LoRASlices``; an unknown backend.
    """
    _check(y, x, slices, plan)
    return resolve_backend(backend, x)(y, x, slices, plan)


def lora_delta(
    out: torch.Tensor,
    x: torch.Tensor,
    slices: LoRASlices,
    plan: LoRAPlan,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Write every token's LoRA term into ``out``: what ``lora_apply`` would add to ``y`` (rounded to out's dtype the
    same way: ``lora_apply`` on a zeroed ``y`` gives the same bits), and 0 in the rows of tokens without an adapter
    (slot -1) and in the columns of slices their adapter does not target (rank 0). ``out``'s old values are never
    read: the Triton backend writes every element in its expand, with no zeroing launch and no read of ``out``
    (``runtime.model``'s side-stream LoRA, whose term the op after the projection adds).

    Args:
        out: ``[num_tokens, slices.d_out]`` float16/bfloat16/float32 (the pool's dtype); overwritten.
        x, slices, plan, backend: as for ``lora_apply``.

    Returns:
        ``out``.

    Raises:
        ValueError: as ``lora_apply``, for ``out`` in place of y.
    """
    _check(out, x, slices, plan)
    mod = select_triton(backend, x, "triton_sgmv")
    return (lora_delta_torch if mod is None else mod.lora_delta_triton)(out, x, slices, plan)
