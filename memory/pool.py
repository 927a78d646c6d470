"""The adapter weight pool: one flat buffer of device memory holding every resident adapter at its exact size.

Layout (the contract between this pool and the kernels in ``multilora.kernels``)
---------------------------------------------------------------------------------
The pool is ONE 1-D tensor ``buffer`` of ``num_pages * PAGE_ELEMS`` elements (dtype = model dtype), allocated
once. A **page** is ``PAGE_ELEMS = 64`` elements (128 B in bf16/fp16, 256 B in fp32): the unit of allocation.
A resident adapter owns ONE **extent**: a run of consecutive pages holding its **image**, which is, for each
(layer, module) it targets (layers outermost, modules in ``TARGET_MODULES`` order), with ``r`` = the rank of
THAT module::

    [ A: r x d_in ][ B^T: r x d_out ][ zeros up to the next page boundary ]       (row-major)

where ``A`` is PEFT's ``lora_A.weight`` [r, d_in] and ``B`` is ``lora_B.weight`` [d_out, r] (stored transposed,
so the expand kernel reads rows of B^T contiguously). Modules and layers the adapter does not target take no
space. Per-(layer, module, slot) metadata, on the pool's device, say where each region is::

    ranks     int32   [num_layers, 7, max_slots]   0 = the slot's adapter does not touch (l, m)
    scalings  float32 [num_layers, 7, max_slots]   lora_alpha / r (rsLoRA: / sqrt(r)); applied by the kernels
    offsets_a int64   [num_layers, 7, max_slots]   element offset of A in ``buffer`` (a multiple of PAGE_ELEMS)
    offsets_b int64   [num_layers, 7, max_slots]   = offsets_a + r * d_in

Element addresses (int64: pools exceed 2^31 elements)::

    A[slot](l, m)[j, k] = buffer[offsets_a[l, m, slot] + j * d_in  + k]
    B[slot](l, m)[n, j] = buffer[offsets_b[l, m, slot] + j * d_out + n]

so a kernel reads one offset per (slot, module), beside the rank, and then walks contiguous rows: there is no
per-rank-row indirection. Rows ``j >= r`` do not exist (no padding of ranks: bytes and reads are proportional to
each module's real rank); the image never holds scaled weights.

Alignment. Each (layer, module) starts on a page boundary, so ``offsets_a`` is a multiple of 64 elements and
``offsets_b`` a multiple of ``gcd(64, d_in)``; the kernels declare their offsets a multiple of
``LoRASlices.align`` (a power of two up to 16 dividing d_in, every d_out and column, and 64), which this holds.

Occupancy. An adapter takes ``sum over its (l, m) of ceil(r * (d_in + d_out) / 64)`` pages: its weight bytes in
the pool dtype plus less than one page of padding per (layer, module) it targets, zero when
``r * (d_in + d_out)`` is a multiple of 64 (every module of every Llama-family model: their widths are).

Worked example (SmolLM2-135M: 30 layers, hidden 576, q 576, k/v 192, MLP 1536; bf16). An adapter with
q_proj and v_proj at r = 8 on every layer has images of 8 * (576 + 576) = 9216 (144 pages) and
8 * (576 + 192) = 6144 (96 pages) elements per layer: 30 * 240 = 7200 pages = 921,600 B, exactly its weights.
Loaded at page 1000 into slot 3: layer 1's v_proj A is at ``offsets_a[1, v, 3] = (1000 + 240 + 144) * 64 =
88,576``, its B^T at ``offsets_b[1, v, 3] = 88,576 + 8 * 576 = 93,184``; row j = 5 of A is elements
``88,576 + 5 * 576 + [0, 576)``.

Allocation and compaction
-------------------------
Extents are placed first fit over a sorted list of free holes (pages); freeing merges a hole with its
neighbours. When a load finds no hole large enough but the free pages suffice, the pool **compacts**: it slides
every live extent down to the lowest free page in address order (device copies on the current stream, each
overlap-safe) and rewrites the moved slots' ``offsets_a`` / ``offsets_b`` in place, leaving one hole at the top.
So churn never leaves memory unusable: a load fails only when the pages or the slots do not suffice. The
metadata tensors are never reallocated, so CUDA graphs and kernels, which read them in place at every launch,
see the new offsets at the next step; the moves are ordered after earlier work on the current stream (kernels
of the previous step still reading the old places) and before later work.

Asynchronous loads. ``load(..., stream=s)`` copies on side stream ``s`` and records an event; compaction first
makes the current stream wait on every such event still pending (so no extent moves before its copy landed),
and a later side-stream load waits on the last compaction (so its copy cannot land in a place that a move is
still reading). ``free`` of a slot whose copy is pending makes the current stream wait on it too, so the next
owner's copy cannot be overtaken; and ``free`` records an event on the current stream that later side-stream loads
wait on, so a copy into freed pages cannot land while work queued before the free (a step still in flight, launched
before the one before it was read back) reads them. Nothing here synchronises the host.

Raw images (``PackedAdapter.finish``; ``multilora.kernels.image_finish``). On CUDA a raw image is copied into its
extent like any other (one copy) and then finished there in place (lora_B transposed through a scratch buffer, a
fused projection's shared A copied, every value checked finite): right after the copy on the same stream, or, with
``load(..., defer_finish=True)``, when ``finish_pending`` is called on the stream that will read the slot (the
adapter cache: at each step boundary, on the compute stream). Until then the slot holds raw values and must not be
read; ``unpack`` and ``nonfinite`` finish it first. A compaction may move an unfinished image: the finish runs
wherever the extent is when it is queued. On a CPU pool ``load`` finishes with torch ops from the source image.

The pool is the only owner of device memory for adapter weights: ``load`` copies the image and keeps no
reference to the source tensors.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import torch

from multilora.config import MODULE_INDEX, TARGET_MODULES, ModelConfig
from multilora.kernels.backends import to_device
from multilora.kernels.image_finish import SCRATCH_ELEMS, block_cols_for, finish_ops, finish_torch
from multilora.kernels.lora import LoRAModuleView
from multilora.memory.extents import Extents, move_down

#: Elements per page: the allocation unit and the alignment of every (layer, module) region.
PAGE_ELEMS = 64

#: Slots of a pool built without ``max_slots`` (metadata is 24 bytes per slot and (layer, module)).
DEFAULT_MAX_SLOTS = 256


class PoolFullError(RuntimeError):
    """Not enough free pages or slots in the adapter pool for an adapter."""


class ModuleWeights(Protocol):
    """One (layer, module) of an adapter as ``pack`` reads it (``runtime.adapters.LoRAModuleWeights``)."""

    a: torch.Tensor  # [r, d_in], PEFT's lora_A.weight (a meta tensor is enough for sizes)
    b: torch.Tensor  # [d_out, r], PEFT's lora_B.weight
    scaling: float


class AdapterWeights(Protocol):
    """An adapter as ``pack`` / ``pages_needed`` read it (``runtime.adapters.LoRAAdapter``)."""

    name: str | None
    modules: Mapping[tuple[int, str], ModuleWeights]

    @property
    def max_rank(self) -> int: ...


def host_footprint(nbytes: int, pinned: bool) -> int:
    """Bytes of host memory an allocation of ``nbytes`` really holds.

    Pinned tensors (``pin_memory=True``) come from torch's caching host allocator, which rounds every block up
    to the next power of two (``PowerOf2Ceil`` in ``aten/src/ATen/core/CachingHostAllocator.h``, torch 2.4-2.11
    default), so an 84 MB Llama-3-8B rank-16 image pins 128 MiB. Pageable memory is counted as asked.
    """
    if not pinned or nbytes <= 0:
        return max(nbytes, 0)
    return 1 << (nbytes - 1).bit_length()


def _pages(elems: int) -> int:
    return -(-elems // PAGE_ELEMS)


def image_layout(config: ModelConfig, ranks: Mapping[tuple[int, str], int]) -> tuple[dict[tuple[int, str], int], int]:
    """Where each (layer, module) of an adapter with these per-module ``ranks`` sits in its image:
    ``(offsets of A relative to the image start, image pages)``, in layer then ``TARGET_MODULES`` order."""
    offsets: dict[tuple[int, str], int] = {}
    pos = 0
    for key in sorted(ranks, key=lambda lm: (lm[0], MODULE_INDEX[lm[1]])):
        d_in, d_out = config.module_shape(key[1])
        offsets[key] = pos * PAGE_ELEMS
        pos += _pages(ranks[key] * (d_in + d_out))
    return offsets, pos


#: Bytes of one (layer, module, slot) entry of the pool's device slot table: ``ranks`` (int32), ``scalings``
#: (float32), ``offsets_a`` and ``offsets_b`` (int64), made in ``AdapterPool.__init__``.
SLOT_ENTRY_BYTES = 4 + 4 + 8 + 8


def slot_table_bytes(config: ModelConfig, max_slots: int) -> int:
    """Device bytes of a pool's slot table of ``max_slots`` slots: ``SLOT_ENTRY_BYTES x layers x target modules x
    max_slots`` (22 MB for Llama-3-8B at 4,096 slots; 54 GB at 10 million)."""
    return SLOT_ENTRY_BYTES * config.num_layers * len(TARGET_MODULES) * max_slots


def scratch_elems(config: ModelConfig, max_rank: int) -> int:
    """Elements of the scratch buffer a pool of ``max_rank`` finishes raw images in place with
    (``AdapterPool.scratch_elems``; ``multilora.kernels.image_finish.InPlacePlan``): the lora_B elements of the
    largest adapter it admits (every target module of every layer at ``max_rank``), capped at ``SCRATCH_ELEMS``
    (64 MiB of bf16), but at least its largest single lora_B (``max_rank`` x the widest d_out). Llama-3-8B, rank 16,
    bf16: 44 MB (one chunk); SmolLM2-135M, rank 16: 5.0 MB."""
    outs = [config.module_shape(m)[1] for m in TARGET_MODULES]
    return max(min(SCRATCH_ELEMS, config.num_layers * max_rank * sum(outs)), max_rank * max(outs))


def max_adapter_pages(config: ModelConfig, max_rank: int) -> int:
    """Pages of the largest adapter ``max_rank`` allows: every target module of every layer at ``max_rank``:
    ``layers * sum over the 7 modules of ceil(max_rank * (d_in + d_out) / PAGE_ELEMS)``."""
    return config.num_layers * sum(_pages(max_rank * sum(config.module_shape(m))) for m in TARGET_MODULES)


@dataclass
class PackedAdapter:
    """An adapter laid out as its pool image, ready to copy in (the host tier's format).

    ``data``: the image (module docstring), 1-D ``[num_pages * PAGE_ELEMS]`` in the pool dtype, on the CPU: in
    the host tier, a view of its ``block`` of the host arena (``multilora.memory.host_arena``: pinned when the
    pool is on CUDA, so the host -> GPU copy is one asynchronous ``cudaMemcpyAsync``; re-pointed by the arena
    when a compaction moves the block), else an ordinary tensor; ``ranks`` int32 / ``scalings`` float32 /
    ``offsets`` int64 (A's element offset relative to the image start; 0 where the rank is 0) ``[num_layers, 7]``.

    ``finish``: None for a finished image (the pool copies it as it is); for a *raw* image (read by
    ``read_image(..., raw=True)``: lora_B as the file stores it, a fused projection's later A regions unwritten,
    values unchecked), the ``multilora.kernels.image_finish.FinishOps`` that ``AdapterPool.load`` runs on the
    device after the copy. ``checked``: the values are known finite (always for a finished image; for a raw
    one, once a load of it passed the device check, or when its files were read and checked before).
    """

    data: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    offsets: torch.Tensor
    max_rank: int
    name: str | None = None
    block: Any = None  # the host arena's block holding ``data`` (``multilora.memory.host_arena``), if any
    finish: Any = None  # FinishOps of a raw image (kernels/image_finish.py), None when finished
    checked: bool = True

    @property
    def num_pages(self) -> int:
        return self.data.numel() // PAGE_ELEMS

    @property
    def nbytes(self) -> int:
        """Bytes of the image: also what it occupies in the pool."""
        return self.data.numel() * self.data.element_size()

    @property
    def footprint(self) -> int:
        """Host bytes the image holds, what the host tier's byte budget counts: its arena block's bytes
        (``HostBlock.held_bytes``: exactly ``nbytes`` with the engine's unit of one page) when it lives in the
        host arena, else ``nbytes`` (an ordinary tensor; for one from torch's pinned allocator see
        ``host_footprint``)."""
        return self.block.held_bytes if self.block is not None else self.nbytes


class PagePacker:
    """Builds one adapter's image (a :class:`PackedAdapter`) module by module, copying straight from the source
    tensors: one copy for A and one for B^T per module. Sources may have any floating dtype; each value is rounded
    once, to the pool dtype.

    The image is sized from the per-module ranks given up front, allocated uninitialised (ordinary pageable
    memory; or ``out``, e.g. a block of the pinned host arena) and every element is written once: the module's rows, then zeros up to its page boundary, so the
    result equals ``torch.zeros`` + copies bit for bit without a zero-fill pass. ``finish`` refuses an image with
    a declared module never ``put``. The copies are torch ops (they release the GIL). Not thread-safe; one packer
    per adapter (packers of one pool may run in parallel threads).
    """

    def __init__(self, pool: "AdapterPool", ranks: Mapping[tuple[int, str], int], name: str | None,
                 out: torch.Tensor | None = None) -> None:
        self.pool = pool
        self.name = name
        self._ranks = dict(ranks)
        self._offsets, pages = image_layout(pool.config, self._ranks)
        if out is None:
            self.data = torch.empty(pages * PAGE_ELEMS, dtype=pool.dtype)
        elif out.dtype != pool.dtype or out.dim() != 1 or out.numel() != pages * PAGE_ELEMS or out.device.type != "cpu":
            raise ValueError(f"adapter {name!r}: out must be a 1-D CPU {pool.dtype} tensor of {pages * PAGE_ELEMS} "
                             f"elements (its image), got {out.dtype} {tuple(out.shape)} on {out.device}")
        else:
            self.data = out
        nl, nm = pool.config.num_layers, len(TARGET_MODULES)
        self.ranks = torch.zeros(nl, nm, dtype=torch.int32)
        self.scalings = torch.zeros(nl, nm, dtype=torch.float32)
        self.offsets = torch.zeros(nl, nm, dtype=torch.int64)
        self._written: set[tuple[int, str]] = set()

    def put(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Write (layer, module)'s ``a`` [r, d_in] (PEFT's lora_A) and ``b`` [d_out, r] (lora_B; stored
        transposed) into the image. The tensors are copied; they are not kept.

        Raises:
            ValueError: a module not declared, shapes that do not fit it (or another rank than declared), or a
                module put twice.
        """
        d_in, d_out = self.pool.config.module_shape(module)
        r = self._ranks.get((layer, module))
        if r is None:
            raise ValueError(f"adapter {self.name!r}: {module} of layer {layer} was not declared to the packer")
        if tuple(a.shape) != (r, d_in) or tuple(b.shape) != (d_out, r):
            raise ValueError(
                f"adapter {self.name!r}: {module} of layer {layer}: expected A [{r}, {d_in}] and B [{d_out}, {r}] "
                f"(r = {r} as declared), got A {list(a.shape)} and B {list(b.shape)}"
            )
        if (layer, module) in self._written:
            raise ValueError(f"adapter {self.name!r}: {module} of layer {layer} packed twice")
        self._written.add((layer, module))
        data = self.data
        # B is stored transposed: its copy is strided (element by element); narrowing the dtype first (one
        # contiguous pass) makes it cheaper, widening happens in it (measured, bench/bench_adapter_load.py)
        if data.element_size() < b.element_size():
            b = b.to(data.dtype)
        oa = self._offsets[(layer, module)]
        ob = oa + r * d_in
        end = ob + r * d_out
        data[oa:ob].view(r, d_in).copy_(a)
        data[ob:end].view(r, d_out).copy_(b.t())
        data[end : oa + _pages(end - oa) * PAGE_ELEMS].zero_()  # to the page boundary: never read
        mi = MODULE_INDEX[module]
        self.ranks[layer, mi] = r
        self.scalings[layer, mi] = float(scaling)
        self.offsets[layer, mi] = oa

    def regions(self, layer: int, module: str, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Declare (layer, module) written by the caller instead of ``put``: the views ``(A [r, d_in], B^T
        [r, d_out])`` of the image that the caller must fill, every element, before ``finish`` (a reader that
        writes file bytes straight into the image); the padding up to the page boundary is zeroed here and the
        rank, scaling and offset recorded.

        Raises:
            ValueError: a module not declared, or one put (or given out) twice.
        """
        r = self._ranks.get((layer, module))
        if r is None:
            raise ValueError(f"adapter {self.name!r}: {module} of layer {layer} was not declared to the packer")
        if (layer, module) in self._written:
            raise ValueError(f"adapter {self.name!r}: {module} of layer {layer} packed twice")
        self._written.add((layer, module))
        d_in, d_out = self.pool.config.module_shape(module)
        oa = self._offsets[(layer, module)]
        ob = oa + r * d_in
        end = ob + r * d_out
        self.data[end : oa + _pages(end - oa) * PAGE_ELEMS].zero_()
        mi = MODULE_INDEX[module]
        self.ranks[layer, mi] = r
        self.scalings[layer, mi] = float(scaling)
        self.offsets[layer, mi] = oa
        return self.data[oa:ob].view(r, d_in), self.data[ob:end].view(r, d_out)

    def finish(self) -> PackedAdapter:
        """The image, once every declared module was ``put``.

        Raises:
            ValueError: a declared module was never put (its region would hold uninitialised memory).
        """
        missing = sorted(set(self._ranks) - self._written, key=lambda lm: (lm[0], MODULE_INDEX[lm[1]]))
        if missing:
            layer, module = missing[0]
            raise ValueError(f"adapter {self.name!r}: {len(missing)} declared module(s) never packed, the first "
                             f"{module} of layer {layer}")
        return PackedAdapter(data=self.data, ranks=self.ranks, scalings=self.scalings, offsets=self.offsets,
                             max_rank=int(self.ranks.max()) if self.ranks.numel() else 0, name=self.name)


class StreamOrder:
    """How the pool orders its copies against side streams: CUDA events (no host sync). For a CPU pool every copy
    is synchronous and these are no-ops. Tests substitute a recording fake to check the ordering logic."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def on(self, stream: Any):
        """Context in which copies go to ``stream`` (None: the current stream)."""
        return torch.cuda.stream(stream) if stream is not None and self.cuda else _nullcontext()

    def record(self, stream: Any = None) -> Any:
        """An event after the work queued so far on ``stream`` (None: the current stream); None on a CPU pool."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def wait(self, event: Any, stream: Any = None) -> None:
        """Make ``stream`` (None: the current stream) wait for ``event``."""
        if event is not None and self.cuda:
            (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(event)


class AdapterPool:
    """A fixed pool of ``num_pages`` pages for adapter weights, one exact-size extent per resident adapter
    (layout, compaction and stream ordering in the module docstring).

    Args:
        config: the base model's configuration (layers, module shapes).
        num_bytes: the pool's size; it takes ``num_bytes // page_bytes`` pages (``page_bytes = PAGE_ELEMS`` x
            element size), allocated now.
        max_rank: the largest rank an adapter may have (sets the rows of the kernels' rank intermediate).
        max_slots: most adapters resident at once (default ``DEFAULT_MAX_SLOTS``).
        dtype, device: of the buffer (the model's).
        order: how copies are ordered against side streams (default ``StreamOrder(device)``; tests pass fakes).
        buffer: a 1-D tensor of ``dtype`` on ``device`` to use instead of allocating one (a unified memory's arena,
            ``multilora.memory.unified``): the pool's page ``p`` is its elements ``[(base_page + p) * PAGE_ELEMS,
            ...)``, for ``p`` below ``capacity_pages``.
        base_page: the buffer page of the pool's page 0 (with ``buffer``).
        capacity_pages: the most pages ``resize`` may grow the pool to (default: the pages of ``num_bytes``).

    Raises:
        ValueError: a non-positive size, ``num_bytes`` below one page, or a ``buffer`` too small for
            ``base_page + capacity_pages`` pages or of another dtype or device.

    Thread safety: ``load``/``free``/``compact`` hold an internal lock; readers of the metadata tensors must not
    race with ``free`` of a slot they use (the adapter cache guarantees this with refcounts).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_bytes: int,
        max_rank: int = 256,
        max_slots: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        order: StreamOrder | None = None,
        buffer: torch.Tensor | None = None,
        base_page: int = 0,
        capacity_pages: int | None = None,
    ) -> None:
        max_slots = DEFAULT_MAX_SLOTS if max_slots is None else max_slots
        for arg, val in (("num_bytes", num_bytes), ("max_rank", max_rank), ("max_slots", max_slots)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"AdapterPool: {arg} must be a positive int, got {val!r}")
        self.config = config
        self.max_rank = max_rank
        self.max_slots = max_slots
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_elems = PAGE_ELEMS
        self.num_pages = num_bytes // self.page_bytes
        if self.num_pages < 1:
            raise ValueError(f"AdapterPool: num_bytes={num_bytes} is below one page ({self.page_bytes} bytes)")
        self.order = order if order is not None else StreamOrder(self.device)
        self.capacity_pages = self.num_pages if capacity_pages is None else capacity_pages
        if self.capacity_pages < self.num_pages:
            raise ValueError(f"AdapterPool: capacity_pages={capacity_pages} is below the {self.num_pages} pages of "
                             f"num_bytes={num_bytes}")
        if buffer is None:
            # Uninitialised on purpose: ``load`` writes a whole image (its padding included) before any slot reads it.
            self.buffer = torch.empty(self.capacity_pages * PAGE_ELEMS, dtype=dtype, device=self.device)
            base_page = 0
        elif (buffer.dim() != 1 or buffer.dtype != dtype or buffer.device.type != self.device.type
              or self.device.index not in (None, buffer.device.index)  # "cuda" is the current CUDA device
              or buffer.numel() < (base_page + self.capacity_pages) * PAGE_ELEMS or base_page < 0):
            raise ValueError(f"AdapterPool: buffer must be a 1-D {dtype} tensor on {self.device} of at least "
                             f"{(base_page + self.capacity_pages) * PAGE_ELEMS} elements (base_page {base_page} + "
                             f"capacity_pages {self.capacity_pages} pages of {PAGE_ELEMS}), got {buffer.dtype} "
                             f"{tuple(buffer.shape)} on {buffer.device}")
        else:
            self.buffer = buffer
        self.base_page = base_page
        self._base = base_page * PAGE_ELEMS  # element offset of page 0 in ``buffer``
        nl, nm = config.num_layers, len(TARGET_MODULES)
        self.ranks = torch.zeros(nl, nm, max_slots, dtype=torch.int32, device=self.device)
        self.scalings = torch.zeros(nl, nm, max_slots, dtype=torch.float32, device=self.device)
        self.offsets_a = torch.zeros(nl, nm, max_slots, dtype=torch.int64, device=self.device)
        self.offsets_b = torch.zeros(nl, nm, max_slots, dtype=torch.int64, device=self.device)
        self._d_in = torch.tensor([config.module_shape(m)[0] for m in TARGET_MODULES], dtype=torch.int64)

        self._space = Extents(self.num_pages)  # the free runs of pages (first fit; memory/extents.py)
        self._free_slots: list[int] = list(range(max_slots - 1, -1, -1))  # pop() gives low slots first
        self._extents: dict[int, tuple[int, int]] = {}  # slot -> (first page, pages)
        self._meta: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> host (ranks, relative offsets)
        self._pending: dict[int, Any] = {}  # slot -> event of its side-stream copy
        # raw images (``_finish_now``): scratch, per-slot finite flags (device, pinned host copy), pending checks
        self._scratch: torch.Tensor | None = None  # [scratch_elems()], allocated at the first raw load on CUDA
        self._unfinished: dict[int, tuple[Any, bool]] = {}  # slot -> (FinishOps, needs a check): copied, not finished
        self._scratch_free: Any = None  # the event after the last finish that used the scratch
        self._flags: torch.Tensor | None = None
        self._flags_host: torch.Tensor | None = None
        # slot -> (event after its finish, FinishOps, finish_torch's answer on a CPU pool else None)
        self._checks: dict[int, tuple[Any, Any, int | None]] = {}
        self._tiles: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}  # layout -> (pinned, device) tiles; LRU
        # event after the last compaction's moves, growth (``resize``) or free: a side-stream load waits for it, as the
        # pages it writes may still be read or written by work queued before on the current stream
        self._reuse_after: Any = None
        self.compactions = 0
        self.bytes_moved = 0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ accounting
    @property
    def page_bytes(self) -> int:
        """Bytes of one page (``PAGE_ELEMS * element size``)."""
        return PAGE_ELEMS * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_total(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def pages_free(self) -> int:
        return self._space.free_units

    @property
    def pages_used(self) -> int:
        return self.num_pages - self.pages_free

    @property
    def bytes_used(self) -> int:
        return self.pages_used * self.page_bytes

    @property
    def bytes_free(self) -> int:
        return self.pages_free * self.page_bytes

    @property
    def largest_hole_pages(self) -> int:
        """The largest run of free pages (what a load can take without compacting)."""
        return self._space.largest_hole

    @property
    def slots_used(self) -> int:
        return len(self._extents)

    def extent_of(self, slot: int) -> tuple[int, int]:
        """(first page, pages) of a resident slot's extent."""
        return self._extents[slot]

    def holes(self) -> list[tuple[int, int]]:
        """The free runs ``(first page, pages)``, by address."""
        return self._space.holes()

    def resident_slots(self) -> list[int]:
        return sorted(self._extents)

    def pages_needed(self, adapter: "AdapterWeights") -> int:
        """Pages an adapter's image takes (module docstring, "Occupancy"); ``a`` may be a meta tensor."""
        return image_layout(self.config, _module_ranks(adapter))[1]

    def bytes_needed(self, adapter: "AdapterWeights") -> int:
        return self.pages_needed(adapter) * self.page_bytes

    @property
    def max_adapter_pages(self) -> int:
        """Pages of the largest adapter ``max_rank`` allows (``max_adapter_pages``)."""
        return max_adapter_pages(self.config, self.max_rank)

    def can_fit(self, adapter: "AdapterWeights") -> bool:
        """Whether ``load`` would succeed now (compacting if it has to)."""
        return bool(self._free_slots) and self.pages_needed(adapter) <= self.pages_free

    # ------------------------------------------------------------------ views
    def module_view(self, layer: int, module: str) -> LoRAModuleView:
        d_in, d_out = self.config.module_shape(module)
        mi = MODULE_INDEX[module]
        return LoRAModuleView(
            buffer=self.buffer,
            ranks=self.ranks[layer, mi],
            scalings=self.scalings[layer, mi],
            offsets_a=self.offsets_a[layer, mi],
            offsets_b=self.offsets_b[layer, mi],
            d_in=d_in,
            d_out=d_out,
            max_rank=self.max_rank,
            offset_align=PAGE_ELEMS,
            layer=layer,
            module=module,
        )

    # ------------------------------------------------------------------ pack
    def pack(self, adapter: "AdapterWeights", *, transform: Any = None) -> PackedAdapter:
        """Lay an adapter out as its pool image on the host (see ``PackedAdapter``). ``transform(module, a, b) ->
        (a, b)``, if given, maps each module's factors first (a tensor-parallel rank keeps its shard of them).

        Raises:
            ValueError: its rank exceeds ``max_rank``.
        """
        packer = self.packer(_module_ranks(adapter), name=adapter.name)
        for (layer, module), w in adapter.modules.items():
            a, b = (w.a, w.b) if transform is None else transform(module, w.a, w.b)
            packer.put(layer, module, a, b, w.scaling)
        return packer.finish()

    def check_rank(self, max_rank: int, name: str | None = None) -> None:
        """Raises ValueError when ``max_rank`` exceeds the pool's ``max_rank``."""
        if max_rank > self.max_rank:
            raise ValueError(f"adapter {name!r}: rank {max_rank} exceeds the pool's max_rank {self.max_rank}")

    def packer(self, ranks: Mapping[tuple[int, str], int], *, name: str | None = None,
               out: torch.Tensor | None = None) -> PagePacker:
        """A :class:`PagePacker` for an adapter with these per-(layer, module) ranks (what ``pack`` uses;
        ``load_peft_adapter_into`` streams a file's modules into one); ``out``: the 1-D CPU tensor of the pool
        dtype to write the image into (default: a fresh one).

        Raises:
            ValueError: a rank above the pool's ``max_rank`` or below 1, an unknown layer or module, or an
                ``out`` that is not exactly the image's size and dtype.
        """
        self.check_rank(max(ranks.values(), default=0), name)
        for (layer, module), r in ranks.items():
            if module not in MODULE_INDEX or not 0 <= layer < self.config.num_layers or r < 1:
                raise ValueError(f"adapter {name!r}: no ({layer}, {module!r}) of rank {r} in this model's pool")
        return PagePacker(self, ranks, name, out)

    # ------------------------------------------------------------------ allocation
    def _take(self, pages: int) -> int | None:
        """First fit: the first page of a run of ``pages`` free pages, removed from the holes; None if no hole fits."""
        return self._space.take(pages)

    def _give(self, start: int, pages: int) -> None:
        """Return pages ``[start, start + pages)`` to the holes, merged with adjacent ones."""
        self._space.give(start, pages)

    def _move(self, dst: int, src: int, n: int) -> None:
        """Copy elements ``[src, src + n)`` of the buffer to ``[dst, dst + n)``, ``dst < src``, on the current
        stream (``multilora.memory.extents.move_down``: overlap-safe pieces)."""
        move_down(self.buffer, dst, src, n)

    def compact(self) -> int:
        """Slide every live extent down to the lowest free page (address order), rewriting the moved slots' offsets
        in place; afterwards the free pages form one hole at the top. Returns the pages moved.

        First makes the current stream wait on every pending side-stream load (no extent moves before its copy
        has landed); records an event that later side-stream loads wait on."""
        with self._lock:
            for ev in self._pending.values():
                self.order.wait(ev)
            self._pending.clear()
            moved = 0
            for slot, old, new, n in self._space.compact((slot, start, n, True)
                                                         for slot, (start, n) in self._extents.items()):
                self._move(self._base + new * PAGE_ELEMS, self._base + old * PAGE_ELEMS, n * PAGE_ELEMS)
                self._extents[slot] = (new, n)
                self._write_offsets(slot)
                moved += n
            self.compactions += 1
            self.bytes_moved += moved * self.page_bytes
            self._reuse_after = self.order.record()
            return moved

    def resize(self, num_pages: int) -> None:
        """Grow or shrink the pool to ``num_pages`` pages at its top (a unified memory moves its boundary with this;
        ``multilora.memory.unified``). Shrinking needs the pages above ``num_pages`` free: the pool compacts first
        when they are free but not one hole at the top (``compact``). After a growth, later side-stream loads wait
        for the work queued so far on the current stream (the new pages may still be written by it: they were KV
        blocks of earlier steps).

        Raises:
            ValueError: ``num_pages`` above ``capacity_pages`` or below 1, or a shrink past the free pages (nothing
                changes).
        """
        with self._lock:
            if not 1 <= num_pages <= self.capacity_pages:
                raise ValueError(f"AdapterPool.resize: num_pages must be in [1, {self.capacity_pages}], got {num_pages}")
            cut = self.num_pages - num_pages
            if cut > self.pages_free:
                raise ValueError(f"AdapterPool.resize: cannot shrink by {cut} pages, {self.pages_free} are free")
            if cut > self._space.top_hole:
                self.compact()
            self._space.resize(num_pages)
            if cut < 0:
                self._reuse_after = self.order.record()
            self.num_pages = num_pages

    @property
    def bytes_capacity(self) -> int:
        """Bytes of ``capacity_pages``: the most this pool can grow to."""
        return self.capacity_pages * self.page_bytes

    # ------------------------------------------------------------------ load / free
    def load(self, adapter: "AdapterWeights | PackedAdapter", *, stream: Any = None, timer: Any = None,
             slot: int | None = None, defer_finish: bool = False) -> int:
        """Copy an adapter's image into an extent (compacting first if no hole fits but the free pages do);
        return its slot.

        Args:
            adapter: a ``LoRAAdapter`` (packed first) or a ``PackedAdapter``.
            slot: a free slot to use (a tensor-parallel worker mirrors rank 0's slots); None = the lowest free one.
            stream: a CUDA stream for the copy (asynchronous from pinned memory); the caller must make the
                consuming stream wait for it (``torch.cuda.Event``) before reading the slot.
            timer: an object whose ``start(stream)`` / ``stop(stream)`` are called just before and after the
                image's copy (one copy; for a raw image finished now, its finish kernels too) (the adapter cache
                times host -> GPU loads with CUDA events this way).
            defer_finish: a raw image (``packed.finish``) on a CUDA pool is copied now and finished in place later,
                by ``finish_pending`` on the stream that calls it (the adapter cache calls it at each step boundary on
                the compute stream, where the finish kernels are never starved by the step's GEMMs); the slot must
                not be read before. False: finished right after the copy, on the same stream.

        Raises:
            ValueError: the adapter's rank exceeds ``max_rank``, or its image is not in the pool's dtype.
            PoolFullError: not enough free pages or slots (nothing is changed).
        """
        packed = adapter if isinstance(adapter, PackedAdapter) else self.pack(adapter)
        self.check_rank(packed.max_rank, packed.name)
        if packed.data.dtype != self.dtype or packed.data.dim() != 1 or packed.data.numel() % PAGE_ELEMS:
            raise ValueError(f"adapter {packed.name!r}: packed for another pool (image {packed.data.dtype} "
                             f"{tuple(packed.data.shape)}, pool {self.dtype} in pages of {PAGE_ELEMS} elements)")
        need = packed.num_pages
        with self._lock:
            if slot is not None and slot not in self._free_slots:
                raise ValueError(f"AdapterPool.load: slot {slot} is not free (resident: {sorted(self._extents)})")
            if not self._free_slots or need > self.pages_free:
                raise PoolFullError(
                    f"adapter pool full: adapter {packed.name!r} needs {need} page(s) ({need * self.page_bytes} "
                    f"bytes) and a slot; {self.pages_free} page(s) ({self.bytes_free} bytes) and "
                    f"{len(self._free_slots)} slot(s) free"
                )
            start = self._take(need) if need else 0
            if start is None:  # the free pages suffice but no hole does
                self.compact()
                start = self._take(need)
                assert start is not None, "after compaction the free pages are one hole"
            if slot is None:
                slot = self._free_slots.pop()
            else:
                self._free_slots.remove(slot)
            self._extents[slot] = (start, need)
            self._meta[slot] = (packed.ranks.to(torch.int32).clone(), packed.offsets.to(torch.int64).clone())
            try:
                self._write(slot, start, packed, stream, timer, defer_finish)
            except BaseException:
                self.free(slot)
                raise
        return slot

    def _write(self, slot: int, start: int, packed: PackedAdapter, stream: Any, timer: Any = None,
               defer_finish: bool = False) -> None:
        lo = self._base + start * PAGE_ELEMS
        fin = packed.finish
        if fin is not None and fin.numel != packed.data.numel():
            raise ValueError(f"adapter {packed.name!r}: a raw image of {packed.data.numel()} elements with finish ops "
                             f"for {fin.numel}")
        if stream is not None:
            # not before the moves out of these pages, nor before their last readers (``free``)
            self.order.wait(self._reuse_after, stream)
        answer = None
        with self.order.on(stream):
            if timer is not None:
                timer.start(stream)
            if fin is not None and not self.order.cuda:  # a CPU pool: torch ops, synchronous
                answer = finish_torch(packed.data, self.buffer[lo : lo + fin.numel], fin)
            else:  # the whole image in one copy: one cudaMemcpyAsync from pinned memory
                self.buffer[lo : lo + packed.data.numel()].copy_(packed.data, non_blocking=stream is not None)
                if fin is not None:
                    self._unfinished[slot] = (fin, not packed.checked)
                    if not defer_finish:
                        self._finish_now(slot)
            if timer is not None:
                timer.stop(stream)
        if stream is not None:
            self._pending[slot] = self.order.record(stream)
        if fin is not None and not self.order.cuda and not packed.checked:
            self._checks[slot] = (None, fin, answer)
        # (small host tensors queued without a host wait: ``to_device``. A plain ``.to(device)`` from pageable memory
        # synchronizes the stream: with a step in flight, as async scheduling keeps one, each of a load's four such
        # copies waited for it, and a pool miss cost a serving step ~5 ms of host time; session 28)
        self.ranks[:, :, slot] = to_device(packed.ranks, self.device)
        self.scalings[:, :, slot] = to_device(packed.scalings, self.device)
        self._write_offsets(slot)

    # ------------------------------------------------------------------ raw images (kernels/image_finish.py)
    def scratch_elems(self) -> int:
        """Elements of the scratch buffer raw images are finished in place with on CUDA (allocated at the first raw
        load; ``scratch_elems``; ``runtime.sizing`` counts it as working memory)."""
        return scratch_elems(self.config, self.max_rank)

    def _finish_now(self, slot: int) -> None:
        """Queue the in-place finish of a copied raw image (``_unfinished[slot]``) on the current stream: reset the
        slot's flag, ``triton_image_finish.finish_inplace`` over its extent as it is now (a compaction may have
        moved it since the copy), then the flag's copy to pinned host memory; the check's answer is read by
        ``nonfinite`` once the event recorded after it has completed."""
        from multilora.kernels import triton_image_finish as tk  # CUDA only (Triton)

        fin, check = self._unfinished.pop(slot)
        if self._scratch is None:
            self._scratch = torch.empty(self.scratch_elems(), dtype=self.dtype, device=self.device)
            self._flags = torch.full((self.max_slots,), tk.NO_BAD_OP, dtype=torch.int32, device=self.device)
            self._flags_host = torch.empty(self.max_slots, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        plan = fin.inplace_plan(self._scratch.numel(), block_cols_for(self.max_rank))
        # the tiles on the device, by the layout's content (adapters of one shape share them whatever their config
        # bytes), least recently used last out; uploaded from pinned memory without a host wait
        key = fin.content_key
        tiles = self._tiles.pop(key, None)
        if tiles is None:
            pinned = plan.tiles.pin_memory() if self.device.type == "cuda" else plan.tiles
            tiles = (pinned, pinned.to(self.device, non_blocking=True))  # (the pinned source lives with it)
        self._tiles[key] = tiles
        while len(self._tiles) > 64:
            self._tiles.pop(next(iter(self._tiles)))
        self.order.wait(self._scratch_free)  # the scratch's last user may have been another stream
        self._flags[slot : slot + 1].fill_(tk.NO_BAD_OP)
        tk.finish_inplace(self.buffer, self._base + self._extents[slot][0] * PAGE_ELEMS, plan, tiles[1],
                          self._scratch, self._flags, slot)
        self._scratch_free = self.order.record()
        if check:
            self._flags_host[slot : slot + 1].copy_(self._flags[slot : slot + 1], non_blocking=True)
            self._checks[slot] = (self.order.record(), fin, None)

    def finish_pending(self, slots: Any = ()) -> int:
        """Queue on the current stream the in-place finish of raw images loaded with ``defer_finish``: those of
        ``slots`` whatever their copy's state (the stream first waits for the copy: no host sync), and every other
        one whose copy has landed (its event completed). Later work on this stream reads them finished. Returns
        how many were queued. A no-op on a CPU pool (it finishes at ``load``)."""
        with self._lock:
            want = set(slots)
            done = 0
            landed = True  # copies land in the order they were queued: no query after the first still in flight
            for slot in list(self._unfinished):  # (each query may give the GIL away: bench/README.md, "Session 13")
                ev = self._pending.get(slot)
                if ev is not None and slot not in want and landed:
                    landed = ev.query()
                if slot in want or ev is None or landed:
                    self.order.wait(ev)
                    self._finish_now(slot)
                    done += 1
            return done

    def unfinished(self, slot: int) -> bool:
        """Whether the slot holds a raw image still to be finished (``load(..., defer_finish=True)``)."""
        return slot in self._unfinished

    def warm_finish(self) -> None:
        """Compile the device finish's kernel for this pool's dtype and tile width (``Engine.warmup``), on a tiny
        image of its own: no page of the pool is touched. A no-op on a CPU pool."""
        if not self.order.cuda:
            return
        from multilora.kernels import triton_image_finish as tk

        fin = finish_ops([(0, 0, 64, 1, 0), (64, 64, 4, 16, 1)], [(0, 128, 0)], ["a", "b"], 128)
        plan = fin.inplace_plan(64, block_cols_for(self.max_rank))
        buf = torch.zeros(128, dtype=self.dtype, device=self.device)
        flags = torch.full((1,), tk.NO_BAD_OP, dtype=torch.int32, device=self.device)
        tk.finish_inplace(buf, 0, plan, plan.tiles.to(self.device), torch.empty(64, dtype=self.dtype,
                                                                                   device=self.device), flags)

    def checks_answered(self) -> set[int]:
        """The slots whose device check ``nonfinite`` would answer without waiting, found with as few event queries as
        possible: the checks in the order they were queued, stopping at the first still running (those queued after
        it on its stream are not done either; one on another stream is then found at a later call). A torch event
        query may give the GIL away, and the engine's step thread can then wait behind the I/O threads for every
        one (bench/README.md, "Session 13")."""
        with self._lock:
            out = set()
            for slot, (ev, _, _) in self._checks.items():
                if ev is not None and not ev.query():
                    break
                out.add(slot)
            return out

    def check_ready(self, slot: int) -> bool:
        """Whether ``nonfinite(slot)`` would answer without waiting: no check pending, or the load it belongs to
        has landed (its CUDA event completed)."""
        with self._lock:
            if slot in self._unfinished:
                return not self._unfinished[slot][1]
            entry = self._checks.get(slot)
            return entry is None or entry[0] is None or entry[0].query()

    def nonfinite(self, slot: int) -> str | None:
        """The device check of a slot loaded from a raw image not known finite: None if every value is finite (or
        the slot needs no check), else the key of the file tensor the first non-finite value came from. Waits
        (host sync) for the slot's copy and finish if they have not run (a deferred finish is queued now, on the
        current stream); the answer is given once per load."""
        with self._lock:
            if slot in self._unfinished:
                self.finish_pending((slot,))
            entry = self._checks.pop(slot, None)
            if entry is None:
                return None
            ev, fin, answer = entry
            if self.order.cuda:
                from multilora.kernels.triton_image_finish import NO_BAD_OP

                ev.synchronize()
                op = int(self._flags_host[slot])
                bad = None if op == NO_BAD_OP else op
            else:
                bad = answer - 1 if answer else None
            return None if bad is None else fin.keys[bad]

    def needs_check(self, slot: int) -> bool:
        """Whether ``nonfinite(slot)`` has an answer pending (the slot was loaded from an unchecked raw image)."""
        return slot in self._checks or (slot in self._unfinished and self._unfinished[slot][1])

    def _write_offsets(self, slot: int) -> None:
        """``offsets_a`` / ``offsets_b`` of a slot from its extent and its image's relative offsets (0 where the
        rank is 0), written in place."""
        ranks, rel = self._meta[slot]
        used = ranks > 0
        a = torch.where(used, rel + self._base + self._extents[slot][0] * PAGE_ELEMS, 0)
        b = torch.where(used, a + ranks.to(torch.int64) * self._d_in, 0)
        self.offsets_a[:, :, slot] = to_device(a, self.device)  # (no host wait: ``_write``)
        self.offsets_b[:, :, slot] = to_device(b, self.device)

    def unpack(self, slot: int, name: str | None = None, *, out: torch.Tensor | None = None) -> PackedAdapter:
        """Copy a resident slot's image and metadata back to the host (the inverse of ``load``: loading the result
        gives the same bits), into ``out`` (a 1-D CPU tensor of the pool dtype and the image's size, e.g. a host
        arena block) or a fresh tensor. The copy is complete when this returns.

        Raises:
            ValueError: ``out`` of another size or dtype.
        """
        with self._lock:
            start, n = self._extents[slot]
            ev = self._pending.get(slot)
            self.order.wait(ev)
            if slot in self._unfinished:  # a raw image not yet finished: finish it first (current stream)
                self._finish_now(slot)
            if out is None:
                host = torch.empty(n * PAGE_ELEMS, dtype=self.dtype)
            elif out.dtype != self.dtype or out.dim() != 1 or out.numel() != n * PAGE_ELEMS:
                raise ValueError(f"unpack: out must be a 1-D {self.dtype} tensor of {n * PAGE_ELEMS} elements, got "
                                 f"{out.dtype} {tuple(out.shape)}")
            else:
                host = out
            host.copy_(self.buffer[self._base + start * PAGE_ELEMS : self._base + (start + n) * PAGE_ELEMS])
            ranks, rel = self._meta[slot]
            # copies, not views: on a CPU pool .cpu() would alias the metadata that free() / the next load rewrite
            scalings = self.scalings[:, :, slot].to("cpu", copy=True)
            return PackedAdapter(data=host, ranks=ranks.clone(), scalings=scalings, offsets=rel.clone(),
                                 max_rank=int(ranks.max()), name=name)

    def free(self, slot: int) -> None:
        """Return a slot's extent to the holes. Raises KeyError if the slot is not resident."""
        with self._lock:
            start, n = self._extents.pop(slot)
            self.order.wait(self._pending.pop(slot, None))  # the next owner's copy comes after this one
            self._checks.pop(slot, None)
            self._unfinished.pop(slot, None)
            del self._meta[slot]
            self.ranks[:, :, slot] = 0
            self.scalings[:, :, slot] = 0.0
            self.offsets_a[:, :, slot] = 0
            self.offsets_b[:, :, slot] = 0
            self._give(start, n)
            self._free_slots.append(slot)
            # the pages' last readers may still be queued (a step launched before its predecessor was read back:
            # the engine's async scheduling): the next side-stream copy into them waits for that work
            self._reuse_after = self.order.record()


def _module_ranks(adapter: "AdapterWeights") -> dict[tuple[int, str], int]:
    return {key: int(w.a.shape[0]) for key, w in adapter.modules.items()}
