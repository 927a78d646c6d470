"""disk -> host, the fast way: a safetensors adapter read straight into its pool image (the adapter cache's reload).

What :func:`read_image` does, per (layer, module) in the image's order (layers, then ``TARGET_MODULES``):

- lora_A ``[r, d_in]`` is row-major in the file exactly as the image's A region is, so when the file dtype is the
  pool dtype its bytes are read (one ``preadv``) **straight into the image**: no scratch buffer, no copy;
- lora_B ``[d_out, r]`` is read into a small per-thread scratch buffer and copied transposed into the image's
  B^T region (numpy's strided copy of the bit patterns; torch's converting ``copy_`` when the file dtype differs);
- each tensor is checked finite right after it is read, while it is still in cache, in the file's dtype, as every
  other load checks it (two integer max-reductions over its bit patterns, ``_finite``), unless the caller has
  verified these very files before (``verified``: the cache's reload of a file version it already read);
- the padding up to each page boundary is zeroed.

A file read from the disk (its first bytes not in the page cache) is read in pieces of ``PIPELINE_PIECE_BYTES``,
each piece's transposes and checks running on a finish thread while the next piece is read (``_scatter_pipelined``);
a file in the page cache is finished after the whole read.

**The copy plan is cached.** Everything but the bytes (the header parsed and validated against the adapter config
and the model, which key goes where in the image, the ranks, scalings and offsets) is a pure function of the
config file's bytes, the header's bytes, the model and the pool: adapters of one training recipe share it, so a
reload of the thousandth such adapter parses nothing and runs one short loop of reads and copies (about 3 Python
operations per tensor, instead of ~40 in the general path). The plan is made by the same validation code as every
other load (``_build_modules`` on ``meta`` tensors), and any error, on any path, is re-derived by the general path
(:func:`~multilora.runtime.adapters.load.read_packed_adapter`), so a file is refused with exactly the messages of
every other load. A tensor of a dtype float32 does not hold exactly (float64, float8) or a pickle file takes the
general path, with the same ``out``. The file is read with plain reads (never memory-mapped), its stamp taken at
open and checked after the read ("changed while it was being read").

The image is bit-identical to ``read_packed_adapter``'s (``tests/test_adapter_fastpath.py``, every file dtype into
every pool dtype; ``tests/test_model_phi3.py``, fused projections). Measured against a plain sequential read of
the same files by ``bench/bench_adapter_load.py``.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from multilora.config import MODULE_INDEX, ModelConfig
from multilora.kernels.image_finish import FinishOps, finish_ops
from multilora.memory.pool import PAGE_ELEMS, AdapterPool, PackedAdapter, image_layout
from multilora.runtime.adapters.disk import _IOV_MAX, OpenFile, check_directory, read_whole, weights_path
from multilora.runtime.adapters.files import SAFETENSORS_NAME, _parse_header
from multilora.runtime.adapters.load import (_EXACT_IN_F32, LoRAAdapter, _build_modules, load_peft_adapter,
                                             read_packed_adapter)
from multilora.runtime.adapters.spec import CONFIG_NAME, AdapterError, _config_json, _parse_config
from multilora.runtime.adapters.targets import _parse_key, _resolve_targets
from multilora.runtime.sharding import shard_lora

#: same-size integer dtypes: a transposed copy between bit patterns (numpy's strided copy loop is 1.3-4x faster
#: than torch's for the small ranks of LoRA, measured on a 2-core x86 CPU; both release the GIL)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PLANS_KEPT = 64
#: elements per finite-check call of a whole image (two numpy reductions per chunk, each releasing the GIL and taking
#: it back). 16 Mi elements since session 29: with the batched lora_B read (``_BATCH_B_BYTES``) the check's calls were
#: most of a read's GIL hand-offs (1 Mi-element chunks, 2 MiB of bf16 in one core's L2: 84 calls per 84 MB image), and
#: each waits up to a switch interval beside a step thread running Python. ``bench/read_contention.py`` on a 2-core
#: CPU (bench/results/session29/read_contention_cpu*.json; 4, 16 and 64 Mi compared), Llama-3-8B rank-16 image:
#: beside an always-busy thread 83.6-89.0 -> 37.5-48.0 ms (the read without any check: 29.0-34.7), beside one busy
#: 60-80% of the time 40.5-50.9 -> 38.4-44.0 ms; alone 25-31 ms either way (within this CPU's noise; the second
#: reduction of a chunk now reads DRAM, not L2). In the engine (H200 host, ``bench_adapter_throughput.py ...
#: --counts 2048 [--check-chunk 1048576]``, bench/results/session30/call1): 53.4% with 1 Mi chunks against 49.6% and
#: 53.6% with 16 Mi, within the runs' spread: no engine difference seen (before: 1 << 20).
_CHECK_CHUNK = 16 << 20
_DEFER_CHECK = True  # False: check tensor by tensor while in cache (an A/B switch for bench_adapter_load.py)
#: lora_B bytes per scatter read into the per-thread scratch (then transposed into the image while in one core's
#: L2: 16 MiB groups read 5-10% slower than tensor-by-tensor reads on a 2-core CPU, 0.25-4 MiB 0-10% faster with 2
#: threads); _SCATTER False: one read per tensor (the A/B switch of bench_adapter_load.py)
_SCATTER_BYTES = 1 << 20
_SCATTER = True
#: an image whose lora_B bytes are at most this many is read in one pass with every lora_B in the per-thread scratch,
#: laid out by module and layer, and each module's B^T of every layer placed by one strided numpy call (``_Batch``)
#: instead of one call per (layer, module): each call gives the GIL up and must take it back, which beside a step
#: thread running Python costs up to a switch interval (``bench/read_contention.py``, session 28). In the engine
#: (H200 host, ``bench_adapter_throughput.py ... --counts 2048 [--read-batch-bytes 0]``, alternated in one run,
#: bench/results/session29/call1): warm batch at 58.8% and 56.2% of the no-adapter tokens/s against 50.2% and 48.6%
#: with the groups, its 34 reads in 1.58-1.72 s against 1.96-2.12 s. 0: off (the groups of ``_SCATTER_BYTES``, what
#: ran before)
_BATCH_B_BYTES = 64 << 20
#: True: before an image is read, the whole weight file is asked of the OS at once (``OpenFile.will_need``:
#: ``posix_fadvise(WILLNEED)``), so that a read from a cold page cache keeps the disk's queue full instead of waiting
#: on the readahead of one read at a time (a file in the page cache: one system call more). Off until measured on the
#: GPU host (session 32 wrote it with no device time left): ``python bench/bench_adapter_load.py --cold --modules
#: q_proj,k_proj,v_proj,o_proj --rank 32 --adapters 12 --threads 1,4``, provider ``ours_readahead`` against ``ours``
#: and ``plain``. Issue 13's S4
#: read 0.89 GB/s (all readers) against a plain cold read's 1.61 in session 32 (``bench/results/session32``).
READ_AHEAD = False
#: Threads one image's reads are split over (``_read_in_file_order``, the scatter reads of both finishes): the file's
#: tensors cut into that many runs of about equal bytes, in file order, read at once (``preadv`` releases the GIL),
#: the first on the calling thread, so that one cold read keeps several requests in the disk's queue (an NVMe drive
#: reads faster at a deeper queue; S4's reads were ~1.1 in flight at a time in session 32). 1: one thread (what ran
#: before). Off until measured on the GPU host (written in session 34 without one): ``python
#: bench/bench_adapter_load.py --cold ... --providers plain,ours,ours_split``, with ``bench/cold_read_patterns.py``'s
#: rows "rest split in 2 / 4 threads" for the disk's own answer.
SPLIT_READ_THREADS = 1
#: images of fewer bytes are read on one thread (a split costs a hand-off per run)
SPLIT_READ_MIN_BYTES = 4 << 20
#: The host finish pipelined under the read (session 37): an image read through the batched lora_B scratch
#: (``_scatter_batched``'s case) is read in pieces of about this many bytes, in file order, by the calling thread, and
#: each piece's finish runs on a finish thread (``_finish_executor``) while the next piece is read: lora_B^T placed
#: for the (layer, module)s whose A and B have both landed by that piece, a fused projection's A shared, and those
#: modules' whole image regions (A, B^T, page padding) checked finite, which together is the serial path's work and
#: check (``_pipeline``). The serial host finish added ~45% to a cold one-reader read on the H200 host (0.99 against
#: 1.43 GB/s plain, bench/results/session36); the read alone ran at 1.54. Pipelined in 4 MiB pieces, cold reads of
#: S4-like files (H100 host, ``bench_adapter_load.py --cold``, bench/results/session37) went from 75% / 89% / 96% of
#: a plain read with 1 / 2 / 4 readers to 106% / 107% / 103% (on another H100 host, with ``PIPELINE_COLD_ONLY``:
#: 71% / 89% -> 96% / 96% at 1 / 2 readers). 0: off (the finish after the whole read). Only reads from the disk are
#: pipelined (``PIPELINE_COLD_ONLY``).
PIPELINE_PIECE_BYTES = 4 << 20
#: True: pipeline only a read from the disk. The first contiguous run of the first piece is read with
#: ``OpenFile.read_cached`` (``preadv2(RWF_NOWAIT)``); if the page cache held all of it, the rest is read and finished
#: as by the serial path. Always pipelined in the one-batch bench at 2,048 adapters (files in the page cache, the
#: step thread busy in Python), the warm batch fell from 54-56% to 46-50% of the no-adapter tokens/s (H100 host,
#: bench/results/session37): its finish threads spent ~1.9x the serial finish's thread time, mostly waiting for the
#: GIL. False: every read of at least two pieces pipelined. Where the platform cannot tell (no ``RWF_NOWAIT``), the
#: read is pipelined.
PIPELINE_COLD_ONLY = True
#: finish threads shared by every reader (read once, when the pool is made on first use)
PIPELINE_FINISH_THREADS = 4
#: True: a batched read's finish after the whole read (a file in the page cache with ``PIPELINE_COLD_ONLY``, or
#: pipelining off) is spread over the finish threads: each module's lora_B^T copies (cut into jobs of about equal
#: bytes) at once, then the whole-image finite check in as many parts. The same numpy calls as the serial finish,
#: run side by side, where the pipelined finish's many small calls lost to the GIL (session 37). Off until measured
#: on the GPU host (written without one): the one-batch bench's ``--parallel-finish on``, and the load bench's row
#: ``ours_host_finish_parallel``.
PARALLEL_FINISH = False
#: what the reads with pipelining on did, counted since the process started (``pipeline_counts``)
_pipe_counts = {"pipelined": 0, "cached_serial": 0}
_pipe_counts_lock = threading.Lock()
_split_pool = None
_split_pool_lock = threading.Lock()
_finish_pool = None


def _split_executor(workers: int):
    """The shared pool that runs split reads' runs past the first (made on first use, grown if asked for more)."""
    global _split_pool
    from concurrent.futures import ThreadPoolExecutor

    with _split_pool_lock:
        if _split_pool is None or _split_pool._max_workers < workers:
            _split_pool = ThreadPoolExecutor(workers, thread_name_prefix="multilora-split-read")
        return _split_pool

def _finish_executor():
    """The shared pool that runs pipelined reads' finish pieces (``PIPELINE_PIECE_BYTES``) and the parallel finish's
    jobs (``PARALLEL_FINISH``), made on first use."""
    global _finish_pool
    from concurrent.futures import ThreadPoolExecutor

    with _split_pool_lock:
        if _finish_pool is None:
            _finish_pool = ThreadPoolExecutor(PIPELINE_FINISH_THREADS, thread_name_prefix="multilora-read-finish")
        return _finish_pool


_scratch = threading.local()


def _scratch_bytes(nbytes: int) -> torch.Tensor:
    """A per-thread ``uint8`` scratch buffer of at least ``nbytes``, grown to powers of two from 64 KiB and never
    shrunk: every lora_B of an image of at most ``_BATCH_B_BYTES`` (64 MiB for a Llama-3-8B rank-16 all-module one,
    8 MiB at rank 8 on q/k/v/o), else a group of ``_SCATTER_BYTES`` or one lora_B, per thread that reads adapters
    (docs/memory.md, section 4)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _scratch.buf = torch.empty(max(1 << (max(nbytes, 1) - 1).bit_length(), 1 << 16), dtype=torch.uint8)
        _scratch.np = None  # its numpy view (_scratch_np) follows the new buffer
    return buf[:nbytes]


def _scratch_np(nbytes: int) -> np.ndarray:
    """:func:`_scratch_bytes` as a numpy ``uint8`` array (the same per-thread buffer), without a torch call once the
    buffer is large enough."""
    arr = getattr(_scratch, "np", None)
    if arr is None or arr.size < nbytes:
        _scratch_bytes(nbytes)  # grows the torch buffer; the numpy view covers all of it
        arr = _scratch.np = _scratch.buf.numpy()
    return arr[:nbytes]


@dataclass(frozen=True)
class _Tensor:
    """A file tensor: its bytes ``[begin, begin + nbytes)``, dtype, shape and key."""

    key: str
    begin: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Module:
    """One targeted (layer, module) of the file: its A and B and, per slice of the image (one; three for a fused
    qkv_proj), the element offsets of A and B^T and B's rows ``[row, row + rows)``."""

    a: _Tensor
    b: _Tensor
    r: int
    d_in: int
    slices: tuple[tuple[int, int, int, int], ...]  # (offset of A, offset of B^T, first row of B, rows)
    name: str = ""  # the module (q_proj, ...): what ``_batches`` groups by


@dataclass(frozen=True)
class _Batch:
    """lora_B of one module over layers whose B^T regions are ``stride`` elements apart in the image (one slice each,
    one rank, one width): in the scratch they sit one after another from ``offs[0]`` (bytes), so one strided
    copy places them all. ``stride`` None: the regions are not evenly spaced (per-layer ranks), or the module is a
    fused projection of several slices: placed one by one."""

    modules: tuple[_Module, ...]  # by image offset
    offs: tuple[int, ...]  # each module's lora_B offset in the scratch (bytes), in ``modules`` order: consecutive
    stride: int | None


@dataclass(frozen=True)
class _Plan:
    data_start: int
    file_size: int
    numel: int  # of the image
    modules: tuple[_Module, ...]
    pads: tuple[tuple[int, int], ...]  # element ranges to zero
    ranks: torch.Tensor
    scalings: torch.Tensor
    offsets: torch.Tensor
    max_rank: int
    adapter: LoRAAdapter  # its modules hold meta tensors and the scalings
    reads: tuple[tuple[int, bool, _Module], ...] = ()  # every tensor (begin, is lora_B, its module) in file order
    finish: FinishOps | None = None  # what the pool does on the device to a raw read of this layout
    batches: tuple[_Batch, ...] = ()  # every lora_B, by module (``_batches``)
    b_where: dict = field(default=None, compare=False, repr=False)  # id(module) -> its lora_B's scratch offset
    b_bytes: int = 0  # the scratch bytes they take (each lora_B in its file dtype)
    pipes: dict = field(default_factory=dict, compare=False, repr=False)  # piece bytes -> _pipeline's pieces

    def __post_init__(self) -> None:  # (from ``batches``, once per plan: a read looks each module up)
        object.__setattr__(self, "b_where", {id(m): o for bt in self.batches for m, o in zip(bt.modules, bt.offs)})


def _batches(modules: list[_Module]) -> tuple[tuple[_Batch, ...], int]:
    """Every module's lora_B grouped for ``_scatter_batched``: by (module, rank, widths, dtype), each group in image
    order with its scratch offset; a group's stride when its B^T regions are evenly spaced (uniform layers), else
    None. Returns the batches and the scratch bytes they take."""
    groups: dict[tuple, list[_Module]] = {}
    for m in modules:
        key = (m.name, m.r, m.d_in, tuple(rows for _, _, _, rows in m.slices), m.b.dtype)
        groups.setdefault(key, []).append(m)
    out, off = [], 0
    for ms in groups.values():
        ms.sort(key=lambda m: m.slices[0][1])
        obs = [m.slices[0][1] for m in ms]
        steps = {b - a for a, b in zip(obs, obs[1:])}
        stride = (steps.pop() if steps else 0) if len(steps) <= 1 and len(ms[0].slices) == 1 else None
        offs = []
        for m in ms:
            offs.append(off)
            off += m.b.nbytes
        out.append(_Batch(tuple(ms), tuple(offs), stride))
    return tuple(out), off


_plans: "OrderedDict[tuple, _Plan]" = OrderedDict()
_plans_lock = threading.Lock()


#: Bit patterns of non-finite values: a float is NaN or +-inf exactly when its exponent bits are all ones, i.e.
#: as a signed integer it is >= the first (+inf) or, as an unsigned one, >= the second (-inf): every finite
#: positive is below +inf's pattern, every finite negative below -inf's (IEEE 754; bfloat16 is float32's top half).
_INF_BITS = {torch.bfloat16: (0x7F80, 0xFF80), torch.float16: (0x7C00, 0xFC00),
             torch.float32: (0x7F800000, 0xFF800000)}
_UNSIGNED = {2: np.uint16, 4: np.uint32}


def _finite(x: torch.Tensor) -> bool:
    """Whether every value of the contiguous CPU tensor ``x`` is finite: two integer max-reductions over its bit
    patterns (numpy's vectorised loops; ~2x ``torch.aminmax`` on bfloat16), ``aminmax`` for other dtypes."""
    if x.numel() == 0:
        return True
    bounds = _INF_BITS.get(x.dtype)
    if bounds is None:
        lo, hi = torch.aminmax(x)
        return math.isfinite(float(lo)) and math.isfinite(float(hi))
    return _finite_bits(x.view(_BITS[x.element_size()]).numpy(), bounds)


def _finite_bits(signed: np.ndarray, bounds: tuple[int, int]) -> bool:
    """:func:`_finite` on the signed-integer bit patterns ``signed`` (a 1-D numpy array) of a float dtype whose
    ``_INF_BITS`` are ``bounds``. numpy only: no torch call in the I/O threads' per-tensor loop (each torch call
    releases and retakes the GIL, and 4 threads doing that per tensor read slower together than one alone:
    ``bench_adapter_load.py``, bench/README.md)."""
    return signed.size == 0 or (int(signed.max()) < bounds[0] and int(signed.view(_UNSIGNED[signed.itemsize]).max())
                                < bounds[1])


def read_image(path: str | os.PathLike, config: ModelConfig, pool: AdapterPool, *, name: str | None = None,
               allow_pickle: bool = False, out: torch.Tensor | None = None, verified: bool = False,
               raw: bool = False) -> tuple[LoRAAdapter, PackedAdapter | None]:
    """disk -> host: read, validate and lay out an adapter as its ``pool`` image, the fast way (module docstring).

    Args:
        out: the image's destination, a 1-D CPU tensor of the pool dtype and exactly the image's size (the adapter
            cache passes a block of the pinned host arena); default a fresh tensor.
        verified: the caller has read these very files before and their values passed the finite check (the
            adapter cache: a host copy was made from them, and their stamps are unchanged since, checked before
            and after this read): the per-tensor finite checks are skipped (a quarter of the read's time).
        path, config, pool, name, allow_pickle: as for
            :func:`~multilora.runtime.adapters.load.read_packed_adapter`.

    Returns:
        ``(adapter, packed)`` as :func:`read_packed_adapter`: ``packed`` is None when the adapter's rank exceeds
        ``pool.max_rank``, else its ``data`` is ``out`` (or the fresh tensor) holding the image.

    Raises:
        AdapterError: as :func:`read_packed_adapter`, with the same messages (the files, the header, keys, shapes,
            dtypes, non-finite values, a file that changed while it was read). ValueError: an ``out`` of the wrong
            size or dtype.
    """
    try:
        return _read(Path(path), config, pool, name, allow_pickle, out, verified, raw)
    except AdapterError as fast:
        # the error path is rare: the general path names the problem exactly as every other load does (it checks
        # each module's values before the next one's shape, where the plan checks every shape first)
        read_packed_adapter(path, config, pool, name=name, allow_pickle=allow_pickle)
        raise fast


def read_adapter(path: str | os.PathLike, config: ModelConfig, pool: AdapterPool, *, name: str | None = None,
                 allow_pickle: bool = False, preload: bool = True, max_rank: int | None = None,
                 shard: tuple[int, int] | None = None) -> tuple[LoRAAdapter, PackedAdapter | None]:
    """What ``Engine.load_adapter`` reads: with ``preload``, the whole adapter validated and laid out as ``pool``'s
    image (:func:`read_image`, the cache's reload path: 5.4 against 24 ms per rank-8 q/k/v/o Llama-3-8B adapter on a
    2-core x86 CPU, the same image and errors; a tensor-parallel shard through
    :func:`~multilora.runtime.adapters.load.read_packed_adapter`); without, the config and the safetensors
    header only (names, shapes, dtypes, ranks: no tensor data; :func:`read_header`, which parses a header only once
    per config and header bytes; a pickle file is read whole and packed anyway).

    Returns:
        ``(adapter, packed)``: ``adapter``'s modules hold ``meta`` tensors for a safetensors file; ``packed`` is
        the host image, or None when nothing was read (header only).

    Raises:
        AdapterError: as :func:`load_peft_adapter`, or a rank above ``max_rank`` (the engine's max_lora_rank).
    """
    if preload and (shard is None or shard[1] == 1):  # read, check and pack in one pass: the fast path (4-5x)
        adapter, packed = read_image(path, config, pool, name=name, allow_pickle=allow_pickle)
        if packed is None:  # a rank above the pool's: the general path validates the values and refuses it alike
            adapter, packed = read_packed_adapter(path, config, pool, name=name, allow_pickle=allow_pickle)
    elif preload:  # a tensor-parallel shard: the general path slices each module
        adapter, packed = read_packed_adapter(path, config, pool, name=name, allow_pickle=allow_pickle, shard=shard)
    elif shard is None or shard[1] == 1:  # the header through the copy plans cached by its bytes (the same checks)
        adapter, packed = read_header(path, config, pool, name=name, allow_pickle=allow_pickle), None
    else:
        adapter, packed = load_peft_adapter(path, config, name=name, allow_pickle=allow_pickle, header_only=True), None
    if max_rank is not None and adapter.max_rank > max_rank:
        raise AdapterError(f"{path}: adapter rank {adapter.max_rank} exceeds the engine's max_lora_rank {max_rank} "
                           f"(raise it to {adapter.max_rank} or more: Engine(max_lora_rank={adapter.max_rank}), "
                           f"--max-lora-rank {adapter.max_rank})", path=path)
    if packed is None and not any(w.a.device.type == "meta" for w in adapter.modules.values()):
        transform = None if shard is None or shard[1] == 1 else (
            lambda m, a, b: shard_lora(m, a, b, config, *shard))
        packed = pool.pack(adapter, transform=transform)  # header_only still reads a pickle file whole
    return adapter, packed


def read_header(path: str | os.PathLike, config: ModelConfig, pool: AdapterPool, *, name: str | None = None,
                allow_pickle: bool = False) -> LoRAAdapter:
    """What ``Engine.load_adapter(preload=False)`` validates, the config and the safetensors header, through the
    cached copy plan (module docstring): registering the thousandth adapter of one training recipe reads two small
    files and parses nothing (``load_peft_adapter(header_only=True)`` parses and validates every key each time:
    about 10 ms of Python for a Llama-3-8B adapter of 448 tensors; bench/README.md, "Session 13").

    Returns:
        what ``load_peft_adapter(path, config, name=name, allow_pickle=allow_pickle, header_only=True)`` returns
        (modules of ``meta`` tensors; a pickle file, or tensors of a dtype float32 does not hold exactly, take that
        general path itself).

    Raises:
        AdapterError: as ``load_peft_adapter(..., header_only=True)``, with its messages (re-derived by it).
    """
    try:
        adapter = _header(Path(path), config, pool, name)
    except AdapterError as fast:
        load_peft_adapter(path, config, name=name, allow_pickle=allow_pickle, header_only=True)
        raise fast
    if adapter is None:
        return load_peft_adapter(path, config, name=name, allow_pickle=allow_pickle, header_only=True)
    return adapter


def _config_and_weights(root: Path):
    """The directory checked, its config read: ``(config path, its bytes, its stamp, the safetensors path)``, or None
    when there is no safetensors file (missing: the general path's error; a pickle: the general path)."""
    check_directory(root)
    cfg_path = root / CONFIG_NAME
    cfg_bytes, cfg_stamp = read_whole(cfg_path, missing=f"missing: an adapter directory must hold {CONFIG_NAME}")
    wpath = weights_path(root)
    if wpath is None or wpath.name != SAFETENSORS_NAME:
        return None
    return cfg_path, cfg_bytes, cfg_stamp, wpath


def _header(root: Path, config, pool, name) -> LoRAAdapter | None:
    found = _config_and_weights(root)
    if found is None:  # no file (its error) or a pickle: the general path
        return None
    cfg_path, cfg_bytes, cfg_stamp, wpath = found
    with OpenFile(wpath) as f:
        plan = _plan_of(f, root, wpath, cfg_path, cfg_bytes, cfg_stamp, config, pool)
        f.check_unchanged()
    if plan is None:
        return None
    return _named(plan if isinstance(plan, LoRAAdapter) else plan.adapter, name, root, cfg_stamp, f)


def _plan_of(f: OpenFile, root, wpath, cfg_path, cfg_bytes, cfg_stamp, config, pool) -> "_Plan | LoRAAdapter | None":
    """The copy plan of an open file: the cached one for these config and header bytes (and file size), else made
    and kept (``_make_plan``)."""
    head = f.read(0, 8) if f.size >= 8 else b""
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    header = f.read(8, n) if 0 <= n <= f.size - 8 and n <= 100_000_000 else None
    key = (repr(config), pool.dtype, pool.max_rank, cfg_bytes, header)
    plan = _cached(key) if header is not None else None
    if plan is None or plan.file_size != f.size:
        plan = _make_plan(f, root, wpath, cfg_path, cfg_bytes, cfg_stamp, config, pool, header)
        if header is not None and isinstance(plan, _Plan):
            _keep(key, plan)
    return plan


def _read(root: Path, config, pool, name, allow_pickle, out, verified=False, raw=False):
    found = _config_and_weights(root)
    if found is None:  # no file (its error) or a pickle: the general path
        return read_packed_adapter(root, config, pool, name=name, allow_pickle=allow_pickle, out=out)
    cfg_path, cfg_bytes, cfg_stamp, wpath = found
    f = OpenFile(wpath)
    try:
        if READ_AHEAD:
            f.will_need()
        try:
            plan = _plan_of(f, root, wpath, cfg_path, cfg_bytes, cfg_stamp, config, pool)
            packed = _execute(plan, f, wpath, pool, name, out, verified, raw) if isinstance(plan, _Plan) else None
            f.check_unchanged()
        except AdapterError:
            f.check_unchanged()  # a file written while it was read explains any error on its values better
            raise
    finally:
        f.close()
    if plan is None:  # float64 / float8 tensors: rounded through float32 by the general path
        return read_packed_adapter(root, config, pool, name=name, allow_pickle=allow_pickle, out=out)
    if isinstance(plan, LoRAAdapter):  # a rank above the pool's: nothing to pack
        return _named(plan, name, root, cfg_stamp, f), None
    return _named(plan.adapter, name, root, cfg_stamp, f), packed


def _named(adapter: LoRAAdapter, name, root, cfg_stamp, f) -> LoRAAdapter:
    return LoRAAdapter(name=name, path=str(root), config=adapter.config, modules=dict(adapter.modules),
                       files=(cfg_stamp, f.stamp))


def _cached(key) -> _Plan | None:
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
        return plan


def _keep(key, plan: _Plan) -> None:
    with _plans_lock:
        _plans[key] = plan
        while len(_plans) > _PLANS_KEPT:
            _plans.popitem(last=False)


def _make_plan(f, root, wpath, cfg_path, cfg_bytes, cfg_stamp, config, pool,
               header: bytes | None = None) -> "_Plan | LoRAAdapter | None":
    """Validate the header against the config and the model (the code every load runs) and lay out the copies;
    None for dtypes the general path must round through float32, the adapter alone for a rank above the pool's.
    ``header``: the header's bytes when the caller read them already (not read again)."""
    raw = _config_json(cfg_bytes, cfg_path)
    spec = _parse_config(raw, cfg_path)
    targets = _resolve_targets(spec, config, cfg_path)
    entries = _parse_header(f, header)
    keys = sorted(entries)
    metas = {k: torch.empty(e.shape, dtype=e.dtype, device="meta") for k, e in entries.items()}
    modules, _ = _build_modules(wpath, metas, keys, targets, config, spec, cfg_path)  # keys, shapes, dtypes
    adapter = LoRAAdapter(name=None, path=str(root), config=raw, modules=modules, files=(cfg_stamp, f.stamp))
    if any(e.dtype not in _EXACT_IN_F32 for e in entries.values()):
        return None
    if adapter.max_rank > pool.max_rank:
        return adapter
    by_key: dict[tuple[int, str, str], str] = {}
    for k in keys:  # (validated above: every key maps)
        layer, module, kind = _parse_key(k, config, wpath)
        by_key[(layer, module, kind)] = k
    order = {m: MODULE_INDEX[config.lora_slices(m)[0]] for m in config.lora_modules}  # as _build_modules
    targeted = sorted(targets, key=lambda lm: (lm[0], order[lm[1]]))
    ranks = {(layer, part): targets[(layer, module)].r for layer, module in targeted
             for part in config.lora_slices(module)}
    offsets_of, pages = image_layout(config, ranks)
    nl = config.num_layers
    ranks_t = torch.zeros(nl, 7, dtype=torch.int32)
    scalings_t = torch.zeros(nl, 7, dtype=torch.float32)
    offsets_t = torch.zeros(nl, 7, dtype=torch.int64)
    plan_modules, pads = [], []
    ops: list[tuple[int, int, int, int, int]] = []
    groups: list[tuple[int, int, int]] = []
    op_keys: list[str] = []
    for layer, module in targeted:
        r = targets[(layer, module)].r
        d_in = config.module_shape(module)[0]
        scaling = float(targets[(layer, module)].scaling(spec.use_rslora))
        tens = []
        for kind in ("A", "B"):
            e = entries[by_key[(layer, module, kind)]]
            tens.append(_Tensor(by_key[(layer, module, kind)], e.begin, e.end - e.begin, e.dtype, e.shape))
        slices, row = [], 0
        group_start, first_op = offsets_of[(layer, config.lora_slices(module)[0])], len(ops)
        for part in config.lora_slices(module):
            d_out = config.module_shape(part)[1]
            oa = offsets_of[(layer, part)]
            ob = oa + r * d_in
            end = ob + r * d_out
            slices.append((oa, ob, row, d_out))
            pad_end = _page_end(oa, end)
            pads.append((end, pad_end))
            # the device finish: A from the first slice's region, B^T from B's rows, the zero padding as read
            ops += [(group_start, oa, r * d_in, 1, 0), (ob, ob, d_out, r, 1)] + (
                [(end, end, pad_end - end, 1, 0)] if pad_end > end else [])
            op_keys += [tens[0].key, tens[1].key] + ([""] if pad_end > end else [])
            row += d_out
            mi = MODULE_INDEX[part]
            ranks_t[layer, mi], scalings_t[layer, mi], offsets_t[layer, mi] = r, scaling, oa
        groups.append((group_start, pad_end, first_op))
        plan_modules.append(_Module(tens[0], tens[1], r, d_in, tuple(slices), module))
    batches, b_bytes = _batches(plan_modules)
    return _Plan(data_start=min((m.a.begin for m in plan_modules), default=0), file_size=f.size,
                 numel=pages * PAGE_ELEMS, modules=tuple(plan_modules), pads=tuple(p for p in pads if p[1] > p[0]),
                 ranks=ranks_t, scalings=scalings_t, offsets=offsets_t,
                 max_rank=int(ranks_t.max()) if ranks_t.numel() else 0, adapter=adapter,
                 reads=tuple(sorted(((t.begin, t is m.b, m) for m in plan_modules for t in (m.a, m.b)),
                                    key=lambda x: x[0])),
                 finish=finish_ops(ops, groups, op_keys, pages * PAGE_ELEMS), batches=batches, b_bytes=b_bytes)


def _nonfinite(wpath: Path, t: _Tensor, x: torch.Tensor) -> AdapterError:
    bad = int((~torch.isfinite(x)).sum())
    return AdapterError(f"{wpath}: tensor {t.key!r}: expected finite values, got {bad} non-finite (NaN/inf) of "
                        f"{x.numel()}", path=wpath, key=t.key)


def _place_b(img: np.ndarray, m: _Module, xb: np.ndarray) -> None:
    """lora_B's bit patterns ``xb`` (flat ``[d_out * r]``, the file's layout) into the image as B^T, per slice."""
    xb = xb.reshape(-1, m.r)  # [d_out, r]
    for _, ob, row, rows in m.slices:
        np.copyto(img[ob : ob + m.r * rows].reshape(m.r, rows), xb[row : row + rows].T)


def _share_a(img: np.ndarray, m: _Module) -> None:
    """A fused projection's slices share A: the first slice's A copied to the others."""
    oa0, n = m.slices[0][0], m.r * m.d_in
    for oa, _, _, _ in m.slices[1:]:
        img[oa : oa + n] = img[oa0 : oa0 + n]


def _scatter_into(plan: _Plan, f: OpenFile, img: np.ndarray, img_bytes: memoryview, esize: int) -> None:
    """Every tensor in the pool dtype: the file's tensors read in file order by scatter reads
    (``OpenFile.read_scatter``: one ``preadv`` for up to 1024 tensors, the GIL released for all of them), each
    lora_A straight into its place in the image, the lora_B of up to ``_SCATTER_BYTES`` at a time into the
    per-thread scratch buffer and from there transposed into the image (numpy); then a fused projection's A
    copied to its other slices. The image's values are not checked here (the caller checks the whole image)."""
    # at most _SCATTER_BYTES (or the largest lora_B) and no more than this file's lora_B need: small adapters do
    # not grow the per-thread scratch
    sizes = [m.b.nbytes for m in plan.modules]
    cap = max(min(_SCATTER_BYTES, sum(sizes)), max(sizes, default=0))
    scratch = _scratch_np(cap)
    bufs: list[memoryview] = []
    pending: list[tuple[_Module, int]] = []  # the group's lora_B and where each sits in the scratch
    start = nxt = used = 0

    def flush() -> None:
        nonlocal used
        if bufs:
            f.read_scatter(bufs, start)
        for m, off in pending:
            _place_b(img, m, scratch[off : off + m.b.nbytes].view(img.dtype))
        bufs.clear()
        pending.clear()
        used = 0

    for begin, is_b, m in plan.reads:
        t = m.b if is_b else m.a
        if bufs and (begin != nxt or (is_b and used + t.nbytes > cap)):  # a gap, or the scratch is full
            flush()
        if not bufs:
            start = begin
        if is_b:
            bufs.append(memoryview(scratch[used : used + t.nbytes]))
            pending.append((m, used))
            used += t.nbytes
        else:
            oa = m.slices[0][0] * esize
            bufs.append(img_bytes[oa : oa + t.nbytes])
        nxt = begin + t.nbytes
    flush()
    for m in plan.modules:
        _share_a(img, m)


def _read_in_file_order(plan: _Plan, f: OpenFile, img_bytes: memoryview, esize: int, b_bufs) -> None:
    """Every tensor of ``plan`` read in file order by scatter reads (``OpenFile.read_scatter``: one ``preadv`` per
    contiguous run of up to 1024 buffers): each lora_A into its first slice's A region of the image, each lora_B into
    the buffers ``b_bufs(module)`` gives (together exactly its bytes, in file order). With ``SPLIT_READ_THREADS`` > 1
    (and at least ``SPLIT_READ_MIN_BYTES``) the buffers are cut into that many runs of about equal bytes read at once;
    every run has landed (or failed) when this returns."""
    items = _file_items(plan.reads, img_bytes, esize, b_bufs)
    total = sum(len(b) for _, b in items)
    k = SPLIT_READ_THREADS if total >= SPLIT_READ_MIN_BYTES else 1
    if k <= 1 or len(items) < 2:
        _read_items(f, items)
        return
    groups, cut, acc = [], 0, 0  # k runs of about total / k bytes each, in file order
    for i, (_, b) in enumerate(items):
        acc += len(b)
        if acc >= total * (len(groups) + 1) / k and len(groups) < k - 1:
            groups.append(items[cut : i + 1])
            cut = i + 1
    groups.append(items[cut:])
    futures = [_split_executor(4 * (k - 1)).submit(_read_items, f, g) for g in groups[1:] if g]
    try:
        _read_items(f, groups[0])
    finally:  # (every run lands before the caller may reuse or free the buffers, even if one failed)
        results = _wait_all(futures)
    _raise_any(results)


def _file_items(reads, img_bytes: memoryview, esize: int, b_bufs) -> list[tuple[int, memoryview]]:
    """``reads`` (file offset, is lora_B, module), in file order, as (file offset, buffer) items: each lora_A's
    first-slice A region of the image, each lora_B's buffers ``b_bufs(module)`` (together exactly its bytes)."""
    items: list[tuple[int, memoryview]] = []
    for begin, is_b, m in reads:
        if is_b:
            for b in b_bufs(m):
                items.append((begin, b))
                begin += len(b)
        else:
            oa = m.slices[0][0] * esize
            items.append((begin, img_bytes[oa : oa + m.a.nbytes]))
    return items


def _wait_all(futures: list) -> list:
    """Each future's result, or its exception, once every one has ended."""
    return [fu.exception() or fu.result() for fu in futures]


def _raise_any(results: list) -> list:
    """``results`` (``_wait_all``'s), or the first exception among them raised."""
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed
    return results


def _finite_range(img: np.ndarray, lo: int, hi: int, bounds) -> bool:
    """Whether ``img[lo:hi]`` (bit patterns) is all finite, checked in chunks of ``_CHECK_CHUNK`` elements."""
    return all(_finite_bits(img[x : min(x + _CHECK_CHUNK, hi)], bounds) for x in range(lo, hi, _CHECK_CHUNK))


def _page_end(start: int, end: int) -> int:
    """``end`` rounded up to whole pages from ``start`` (a slice's region with its zero padding, ``_make_plan``)."""
    return start + -(-(end - start) // PAGE_ELEMS) * PAGE_ELEMS


def _read_items(f: OpenFile, items: list[tuple[int, memoryview]]) -> None:
    """``items`` (file offset, buffer) in file order, read by one ``read_scatter`` per contiguous run."""
    bufs: list[memoryview] = []
    start = nxt = 0
    for begin, b in items:
        if bufs and begin != nxt:  # a gap in the file: read what is gathered
            f.read_scatter(bufs, start)
            bufs = []
        if not bufs:
            start = begin
        bufs.append(b)
        nxt = begin + len(b)
    if bufs:
        f.read_scatter(bufs, start)


def _scatter_batched(plan: _Plan, f: OpenFile, img: np.ndarray, img_bytes: memoryview, esize: int,
                     bounds=None) -> bool | None:
    """``_scatter_into`` in one pass (an image of at most ``_BATCH_B_BYTES`` of lora_B): the file's tensors read in
    file order by scatter reads, each lora_A straight into the image, each lora_B into its place in the per-thread
    scratch (by module, then layer: ``plan.batches``); then each module's B^T of every layer placed by one strided
    copy (a batch of evenly spaced regions; else one copy per layer), and a fused projection's A copied to its other
    slices. About a dozen numpy calls and reads per image instead of a few hundred: each gives the GIL up. Returns
    ``_finish_batched``'s answer (``bounds``: the finite check's, with ``PARALLEL_FINISH``)."""
    scratch = _scratch_np(plan.b_bytes)
    where = plan.b_where  # id(module) -> its lora_B's offset in the scratch (the plan's modules: ids stable)
    _read_in_file_order(plan, f, img_bytes, esize,
                        lambda m: [memoryview(scratch[where[id(m)] : where[id(m)] + m.b.nbytes])])
    return _finish_batched(plan, img, scratch, bounds)


def _finish_batched(plan: _Plan, img: np.ndarray, scratch: np.ndarray, bounds) -> bool | None:
    """The batched read's finish once every tensor has landed: each batch's lora_B^T placed, a fused projection's A
    shared. With ``PARALLEL_FINISH``, the placements run as jobs of about equal bytes on the finish threads and,
    with ``bounds``, the whole image is checked finite in parts there too: returns whether it is (None without
    ``bounds``, or serially: the caller checks). Every job has ended when this returns or raises."""
    if not PARALLEL_FINISH:
        for bt in plan.batches:
            _place_run(img, scratch, bt, 0, len(bt.modules))
        for m in plan.modules:
            _share_a(img, m)
        return None
    pool = _finish_executor()
    target = max(1, plan.b_bytes // (2 * PIPELINE_FINISH_THREADS))  # ~2 jobs per thread, whole modules each
    jobs = []
    for bt in plan.batches:
        i, acc = 0, 0
        for j, m in enumerate(bt.modules):
            acc += m.b.nbytes
            if acc >= target or j == len(bt.modules) - 1:
                jobs.append((bt, i, j + 1))
                i, acc = j + 1, 0
    _run_all(pool, [(_place_run, (img, scratch, bt, i, j)) for bt, i, j in jobs])
    for m in plan.modules:
        _share_a(img, m)
    if bounds is None:
        return None
    part = -(-img.size // PIPELINE_FINISH_THREADS)
    return all(_run_all(pool, [(_finite_range, (img, lo, min(lo + part, img.size), bounds))
                               for lo in range(0, img.size, part)]))


def _run_all(pool, calls: list) -> list:
    """Every ``(fn, args)`` of ``calls`` run on ``pool``; their results once every one has ended (also when a submit
    fails part-way), the first failure raised after all have."""
    futures = []
    try:
        for fn, args in calls:
            futures.append(pool.submit(fn, *args))
    finally:
        results = _wait_all(futures)
    return _raise_any(results)


def _place_run(img: np.ndarray, scratch: np.ndarray, bt: _Batch, i: int, j: int) -> None:
    """lora_B of ``bt.modules[i:j]`` (in the scratch from ``bt.offs[i]``, one after another) placed as B^T: one
    strided copy when the batch's regions are evenly spaced, else one copy per module."""
    m0 = bt.modules[i]
    if bt.stride is None:
        for m, off in zip(bt.modules[i:j], bt.offs[i:j]):
            _place_b(img, m, scratch[off : off + m.b.nbytes].view(img.dtype))
        return
    n, r, d_out, ob0 = j - i, m0.r, m0.slices[0][3], m0.slices[0][1]
    src = scratch[bt.offs[i] : bt.offs[i] + n * m0.b.nbytes].view(img.dtype).reshape(n, d_out, r)
    isz = img.itemsize
    dst = np.lib.stride_tricks.as_strided(img[ob0:], shape=(n, r, d_out),
                                          strides=(bt.stride * isz, d_out * isz, isz), writeable=True)
    np.copyto(dst, src.transpose(0, 2, 1))


@dataclass(frozen=True)
class _Piece:
    """One piece of a pipelined read (``PIPELINE_PIECE_BYTES``): what it reads, then what its finish does."""

    reads: tuple[tuple[int, bool, _Module], ...]  # (file offset, is lora_B, module), in file order
    done: tuple[_Module, ...]  # the modules whose A and B have both landed once this piece is read
    runs: tuple[tuple[_Batch, int, int], ...]  # their lora_B: (batch, i, j) for ``_place_run``
    checks: tuple[tuple[int, int], ...]  # their image regions (element ranges, adjacent ones merged)


def _region(m: _Module) -> tuple[int, int]:
    """A module's whole image region: its first slice's A to its last slice's page padding (``_make_plan``)."""
    oa, ob, _, rows = m.slices[-1]
    return m.slices[0][0], _page_end(oa, ob + m.r * rows)


def _pipeline(plan: _Plan, piece_bytes: int) -> tuple[_Piece, ...] | None:
    """``plan``'s reads cut into pieces of about ``piece_bytes`` (at tensor boundaries, in file order) and each
    piece's finish; None when that gives one piece, or when the modules' regions do not tile the image (the whole
    image is then checked at the end, as the serial path does). Cached on the plan."""
    if piece_bytes in plan.pipes:
        return plan.pipes[piece_bytes]
    cuts, acc = [[]], 0
    for rd in plan.reads:
        if acc >= piece_bytes:
            cuts.append([])
            acc = 0
        cuts[-1].append(rd)
        acc += (rd[2].b if rd[1] else rd[2].a).nbytes
    regions = sorted(_region(m) for m in plan.modules)
    tiled = all(a[1] == b[0] for a, b in zip(regions, regions[1:])) and (
        not regions or (regions[0][0] == 0 and regions[-1][1] == plan.numel))
    pieces = None
    if len(cuts) > 1 and tiled:
        last: dict[int, int] = {}  # id(module) -> the piece that completes it
        for p, cut in enumerate(cuts):
            for _, _, m in cut:
                last[id(m)] = p
        where = {id(m): (bt, i) for bt in plan.batches for i, m in enumerate(bt.modules)}
        pieces = []
        for p, cut in enumerate(cuts):
            done = tuple(m for m in plan.modules if last[id(m)] == p)
            runs: list[list] = []
            for bt, i in sorted((where[id(m)] for m in done), key=lambda w: (id(w[0]), w[1])):
                if runs and runs[-1][0] is bt and runs[-1][2] == i:
                    runs[-1][2] = i + 1
                else:
                    runs.append([bt, i, i + 1])
            checks: list[list[int]] = []
            for lo, hi in sorted(_region(m) for m in done):
                if checks and checks[-1][1] == lo:
                    checks[-1][1] = hi
                else:
                    checks.append([lo, hi])
            pieces.append(_Piece(tuple(cut), done, tuple(tuple(r) for r in runs), tuple(tuple(c) for c in checks)))
        pieces = tuple(pieces)
    plan.pipes[piece_bytes] = pieces
    return pieces


def _finish_piece(piece: _Piece, img: np.ndarray, scratch: np.ndarray, bounds) -> bool:
    """A piece's finish (on a finish thread): its modules' B^T placed and A shared, then, with ``bounds``, whether
    their image regions are all finite (True without)."""
    for bt, i, j in piece.runs:
        _place_run(img, scratch, bt, i, j)
    for m in piece.done:
        _share_a(img, m)
    return bounds is None or all(_finite_range(img, lo, hi, bounds) for lo, hi in piece.checks)


def pipeline_counts() -> dict[str, int]:
    """How the reads with ``PIPELINE_PIECE_BYTES`` on went since the process started: ``pipelined`` (the finish
    under the read) and ``cached_serial`` (``PIPELINE_COLD_ONLY``: the first bytes were in the page cache, so the
    finish ran after the read)."""
    with _pipe_counts_lock:
        return dict(_pipe_counts)


def _count(kind: str) -> None:
    with _pipe_counts_lock:
        _pipe_counts[kind] += 1


def _skip(items: list[tuple[int, memoryview]], n: int) -> list[tuple[int, memoryview]]:
    """``items`` (file offset, buffer), contiguous in the file, without their first ``n`` bytes."""
    out = []
    for begin, b in items:
        k = min(n, len(b))
        n -= k
        if k < len(b):
            out.append((begin + k, b[k:]))
    return out


def _scatter_pipelined(plan: _Plan, pieces: tuple[_Piece, ...], f: OpenFile, img: np.ndarray,
                       img_bytes: memoryview, esize: int, bounds) -> bool | None:
    """``_scatter_batched`` with each piece's finish on a finish thread while the calling thread reads the next
    (``PIPELINE_PIECE_BYTES``). With ``PIPELINE_COLD_ONLY``, a file whose first bytes are all in the page cache is
    read and finished as by ``_scatter_batched`` instead. Returns whether every value checked was finite (True when
    ``bounds`` is None: no check), or None when the finish was serial (the caller checks the whole image). Every
    finish has run (or failed) when this returns or raises, so the caller may reuse the buffers."""
    scratch = _scratch_np(plan.b_bytes)
    where = plan.b_where
    b_bufs = lambda m: [memoryview(scratch[where[id(m)] : where[id(m)] + m.b.nbytes])]  # noqa: E731

    def items_of(piece: _Piece) -> list[tuple[int, memoryview]]:
        return _file_items(piece.reads, img_bytes, esize, b_bufs)

    first = items_of(pieces[0])
    run = [first[0]]  # the first contiguous run of the first piece: probed in the page cache
    for begin, b in first[1:]:
        if begin != run[-1][0] + len(run[-1][1]) or len(run) == _IOV_MAX:  # (read_cached's one call)
            break
        run.append((begin, b))
    got = f.read_cached([b for _, b in run], run[0][0])
    first = _skip(first, got or 0)
    if PIPELINE_COLD_ONLY and got is not None and got >= sum(len(b) for _, b in run):  # in the page cache
        _count("cached_serial")
        _read_items(f, first + [it for p in pieces[1:] for it in items_of(p)])
        return _finish_batched(plan, img, scratch, bounds)
    _count("pipelined")
    pool = _finish_executor()
    futures = []
    try:
        for k, piece in enumerate(pieces):
            _read_items(f, first if k == 0 else items_of(piece))
            futures.append(pool.submit(_finish_piece, piece, img, scratch, bounds))
    finally:  # (every finish ends before the caller may reuse the image or the scratch, even if a read failed)
        results = _wait_all(futures)
    return all(_raise_any(results))


def _scatter_raw(plan: _Plan, f: OpenFile, img_bytes: memoryview, esize: int) -> None:
    """Every tensor in the pool dtype, read raw: in file order by scatter reads (``OpenFile.read_scatter``, up
    to 1024 buffers per ``preadv``), each lora_A into its first slice's A region, each slice's rows of lora_B
    (contiguous in the file) into that slice's B region as they are. No copy, no check: the device finish
    (``plan.finish``) transposes B, fills the other slices' A and checks the values."""
    # B's rows of each slice, in row order: contiguous in the file
    _read_in_file_order(plan, f, img_bytes, esize, lambda m: [img_bytes[ob * esize : (ob + m.r * rows) * esize]
                                                             for _, ob, _, rows in m.slices])


def _execute(plan: _Plan, f: OpenFile, wpath: Path, pool: AdapterPool, name, out, verified: bool,
             raw: bool = False) -> PackedAdapter:
    dtype = pool.dtype
    if out is None:
        out = torch.empty(plan.numel, dtype=dtype)
    elif out.dtype != dtype or out.dim() != 1 or out.numel() != plan.numel or out.device.type != "cpu":
        raise ValueError(f"adapter {name!r}: out must be a 1-D CPU {dtype} tensor of {plan.numel} elements (its "
                         f"image), got {out.dtype} {tuple(out.shape)} on {out.device}")
    esize = out.element_size()
    bits = _BITS[esize]
    img = out.view(bits).numpy()  # the image's bit patterns, [numel]
    img_bytes = memoryview(out.view(torch.uint8).numpy())
    bounds = _INF_BITS.get(dtype)
    # the same-dtype paths below make no torch call per tensor (numpy views and loops, which release the GIL for
    # the bytes, and Python): a torch call drops and retakes the GIL, and the cache's I/O threads contend for it
    for lo, hi in plan.pads:
        img[lo:hi] = 0
    # every tensor in the pool dtype (the common case): one finite check of the whole image at the end, in chunks
    # large enough for numpy to release the GIL (per-tensor checks held it: 448 pairs of small reductions per
    # Llama-3-8B adapter, serialised across the I/O threads); a failure is then traced to its tensor
    same = bounds is not None and all(m.a.dtype == dtype and m.b.dtype == dtype for m in plan.modules)
    if raw and same and plan.finish is not None:
        _scatter_raw(plan, f, img_bytes, esize)
        return _packed(plan, out, name, finish=plan.finish, checked=verified)
    deferred = _DEFER_CHECK and not verified and same
    verified = verified or deferred
    scatter = same and verified and _SCATTER  # no per-tensor check to make: read in file order
    finite = None  # (the pipelined read's answer for the whole image, when it checked it)
    pieces = (_pipeline(plan, PIPELINE_PIECE_BYTES) if scatter and 0 < plan.b_bytes <= _BATCH_B_BYTES
              and PIPELINE_PIECE_BYTES > 0 and SPLIT_READ_THREADS <= 1 else None)
    if pieces is not None:
        finite = _scatter_pipelined(plan, pieces, f, img, img_bytes, esize, bounds if deferred else None)
    elif scatter and 0 < plan.b_bytes <= _BATCH_B_BYTES:
        finite = _scatter_batched(plan, f, img, img_bytes, esize, bounds if deferred else None)
    elif scatter:
        _scatter_into(plan, f, img, img_bytes, esize)
    for m in () if scatter else plan.modules:
        a, b, r, d_in = m.a, m.b, m.r, m.d_in
        oa0 = m.slices[0][0]
        if a.dtype == dtype:  # straight into the image, checked while in cache
            f.read_into(img_bytes[oa0 * esize : oa0 * esize + a.nbytes], a.begin)
            if not verified and not (_finite_bits(img[oa0 : oa0 + r * d_in], bounds) if bounds else
                                     _finite(out[oa0 : oa0 + r * d_in])):
                raise _nonfinite(wpath, a, out[oa0 : oa0 + r * d_in])
        else:
            x = _scratch_bytes(a.nbytes).view(a.dtype)
            f.read_into(memoryview(x.view(torch.uint8).numpy()), a.begin)
            if not verified and not _finite(x):
                raise _nonfinite(wpath, a, x)
            out[oa0 : oa0 + r * d_in].copy_(x)
        _share_a(img, m)
        if b.dtype == dtype:
            xn = _scratch_np(b.nbytes)
            f.read_into(memoryview(xn), b.begin)
            xb = xn.view(img.dtype)  # B's bit patterns, [d_out * r]
            if not verified and not (_finite_bits(xb, bounds) if bounds else _finite(torch.from_numpy(xb).view(dtype))):
                raise _nonfinite(wpath, b, torch.from_numpy(xb).view(dtype))
            _place_b(img, m, xb)
            continue
        x = _scratch_bytes(b.nbytes).view(b.dtype)  # another dtype: converted by torch's copy
        f.read_into(memoryview(x.view(torch.uint8).numpy()), b.begin)
        if not verified and not _finite(x):
            raise _nonfinite(wpath, b, x)
        xb = x.view(-1, r)
        for _, ob, row, rows in m.slices:
            out[ob : ob + r * rows].view(r, rows).copy_(xb[row : row + rows].t())
    if deferred and not (finite if finite is not None else _finite_range(img, 0, img.size, bounds)):
        for m in plan.modules:  # which tensor (the image holds A and B^T: the same values)
            oa = m.slices[0][0]
            if not _finite_bits(img[oa : oa + m.r * m.d_in], bounds):
                raise _nonfinite(wpath, m.a, out[oa : oa + m.r * m.d_in])
            if not all(_finite_bits(img[ob : ob + m.r * rows], bounds) for _, ob, _, rows in m.slices):
                # every slice of B (a fused projection's B covers them all): its count and size, as the file's
                raise _nonfinite(wpath, m.b, torch.cat([out[ob : ob + m.r * rows] for _, ob, _, rows in m.slices]))
        raise AdapterError(f"{wpath}: expected finite values, got non-finite (NaN/inf) ones", path=wpath)
    return _packed(plan, out, name)


def _packed(plan: _Plan, out: torch.Tensor, name, **raw) -> PackedAdapter:
    """The image ``out`` with the plan's metadata (copies: the plan is shared), finished or (``raw``) not."""
    return PackedAdapter(data=out, ranks=plan.ranks.clone(), scalings=plan.scalings.clone(),
                         offsets=plan.offsets.clone(), max_rank=plan.max_rank, name=name, **raw)
