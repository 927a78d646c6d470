"""Loading: one path that validates an adapter's tensors against its targets and hands each module to a
sink: float32 copies for :func:`load_peft_adapter`, the caller's sink for :func:`load_peft_adapter_into`
(``AdapterPool.packer`` for :func:`read_packed_adapter`, the engine's disk -> host path), none for a
header-only validation."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol

import torch

from multilora.config import MODULE_INDEX, TARGET_MODULES, ModelConfig
from multilora.memory.pool import AdapterPool, PackedAdapter
from multilora.runtime.sharding import ShardSink
from multilora.runtime.adapters.disk import FileStamp, check_directory, read_whole
from multilora.runtime.adapters.files import (SAFETENSORS_NAME, _LazyTensors, _read_weights, dtype_name,
                                              require_weights_path)
from multilora.runtime.adapters.spec import CONFIG_NAME, AdapterError, _config_json, _fmt_shape, _parse_config, _Spec
from multilora.runtime.adapters.targets import _PEFT_PREFIX, _overlap_hint, _parse_key, _resolve_targets, _Target


@dataclass(frozen=True)
class LoRAModuleWeights:
    """The LoRA weights of one (layer, module).

    Attributes:
        a: PEFT's ``lora_A.weight``, shape ``[r, in_features]``, float32, CPU, contiguous.
        b: PEFT's ``lora_B.weight``, shape ``[out_features, r]``, float32, CPU, contiguous.
        scaling: the factor applied to ``(x A^T) B^T``: ``lora_alpha / r`` (LoRA paper), or
            ``lora_alpha / sqrt(r)`` with ``use_rslora`` (rsLoRA, Kalajdzievski 2023), with this module's
            ``r`` and ``lora_alpha`` after ``rank_pattern`` / ``alpha_pattern``. Never folded into ``b``.
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        """The module's rank ``r`` (rows of ``a``)."""
        return int(self.a.shape[0])


@dataclass
class LoRAAdapter:
    """A loaded, validated PEFT LoRA adapter.

    Attributes:
        name: the name the caller gave it (None if none was given).
        path: the directory it was loaded from.
        config: the raw ``adapter_config.json`` dict.
        modules: ``(layer, module) -> LoRAModuleWeights`` for every targeted projection, ``module`` one of
            ``TARGET_MODULES``; ordered by layer, then ``TARGET_MODULES`` order. A target of Phi-3's fused
            ``qkv_proj`` / ``gate_up_proj`` is here as its slices (q/k/v, gate/up), each with the shared A and its
            rows of B (see ``_build_modules``).
        files: the stamps (device, inode, size, mtime_ns, ctime_ns) of ``adapter_config.json`` and of the weight
            file as they were read (``()`` for an adapter not read from files); equal to
            ``multilora.runtime.adapter_cache.files_fingerprint(path)`` while neither file changes.
    """

    name: str | None
    path: str
    config: dict = field(repr=False)
    modules: dict[tuple[int, str], LoRAModuleWeights] = field(repr=False)
    files: tuple[FileStamp, ...] = field(default=(), repr=False)

    @property
    def max_rank(self) -> int:
        """The largest rank over the modules (0 if there are none)."""
        return max((w.rank for w in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of all ``a`` and ``b`` tensors."""
        return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size() for w in self.modules.values())

    def target_summary(self) -> str:
        """One line for logs, e.g. ``"r=8 alpha=16 on q_proj,v_proj x 30 layers"``.

        Ranks and alphas that vary over modules (``rank_pattern`` / ``alpha_pattern``) are shown as
        ``min..max``; ``rslora`` is appended for rsLoRA scaling.
        """
        if not self.modules:
            return "no modules"
        ranks = sorted({w.rank for w in self.modules.values()})
        rslora = bool(self.config.get("use_rslora", False))
        # alpha = scaling * r (or * sqrt(r)); rounded so float noise does not show up as a range
        alphas = sorted(
            {float(f"{w.scaling * (math.sqrt(w.rank) if rslora else w.rank):.6g}") for w in self.modules.values()}
        )

        def span(vals: list[float]) -> str:
            fmt = [f"{v:g}" for v in (vals[0], vals[-1])]
            return fmt[0] if len(vals) == 1 else f"{fmt[0]}..{fmt[1]}"

        mods = [m for m in TARGET_MODULES if any(mm == m for _, mm in self.modules)]
        layers = {layer for layer, _ in self.modules}
        text = f"r={span(ranks)} alpha={span(alphas)} on {','.join(mods)} x {len(layers)} layer"
        text += "" if len(layers) == 1 else "s"
        return text + (" rslora" if rslora else "")


#: File dtypes whose values float32 holds exactly: converting them straight to the pool dtype rounds once,
#: exactly as the float32 copy then the pool dtype did. Others (float64, float8) still go through float32 first.
_EXACT_IN_F32 = (torch.float32, torch.bfloat16, torch.float16)

#: File dtypes read as LoRA weights. The float8 formats (safetensors F8_E4M3, F8_E5M2 and their FNUZ variants)
#: are cast to float32, then to the pool dtype, exactly: every float8 value is a float16, bfloat16 and float32
#: value. Refused: integers, bool, complex, and F8_E8M0 (a power-of-two scale format, up to 2^127: no float16).
_WEIGHT_DTYPES = (torch.float64, *_EXACT_IN_F32) + tuple(getattr(torch, n) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


def _all_finite(x: torch.Tensor) -> bool:
    """Whether every value of a floating-point tensor is finite, in one reduction pass without temporaries.

    ``aminmax`` propagates NaN, and a +inf / -inf is the max / min, so both ends are finite exactly when
    every value is. On CPU this is ~10x faster than ``torch.isfinite(x).all()`` (which builds two boolean
    tensors); it was most of the cost of loading an adapter."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


class ModuleSink(Protocol):
    """Where the loading path puts each validated module: the caller's for :func:`load_peft_adapter_into`
    (e.g. ``AdapterPool.packer``), float32 copies for :func:`load_peft_adapter`."""

    def put(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None: ...


class _Float32Copies:
    """:func:`load_peft_adapter`'s sink: keeps each module as float32, CPU, contiguous tensors in ``modules``
    (in ``put`` order). A tensor that already is one is kept as it is, not copied: ``load_peft_adapter``
    reads the file whole, so its tensors are its own."""

    def __init__(self) -> None:
        self.modules: dict[tuple[int, str], LoRAModuleWeights] = {}

    def put(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        self.modules[(layer, module)] = LoRAModuleWeights(
            a=a.to(torch.float32).contiguous(), b=b.to(torch.float32).contiguous(), scaling=scaling
        )


def _match_keys(
    wpath: Path, keys: list[str], targets: dict[tuple[int, str], _Target], config: ModelConfig, cfg_path: Path
) -> dict[tuple[int, str], dict[str, str]]:
    """Check every tensor key against the targets: ``(layer, module) -> {"A": key, "B": key}``.

    Raises AdapterError for a key that names no targeted module's lora_A / lora_B, a duplicate, a targeted
    module without tensors, and a lora_A without its lora_B or the reverse."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key in keys:
        layer, module, kind = _parse_key(key, config, wpath, hint=lambda: "; " + _other_model(config, cfg_path))
        if (layer, module) not in targets:
            raise AdapterError(
                f"{wpath}: tensor {key!r}: {config.hf_module_name(layer, module)} is not targeted by {cfg_path.name} "
                f"(target_modules / layers_to_transform); expected tensors only for the "
                f"{len(targets)} targeted module(s)",
                path=wpath,
                key=key,
            )
        slot = found.setdefault((layer, module), {})
        if kind in slot:
            raise AdapterError(
                f"{wpath}: tensor {key!r}: duplicate lora_{kind} for {config.hf_module_name(layer, module)} "
                f"(also given as {slot[kind]!r})",
                path=wpath,
                key=key,
            )
        slot[kind] = key

    for (layer, module), t in targets.items():
        kinds = found.get((layer, module), {})
        if not kinds:
            raise AdapterError(
                f"{wpath}: no lora_A / lora_B tensors for {t.name}, which {cfg_path.name} targets; expected "
                f"'{_PEFT_PREFIX}{t.name}.lora_A.weight' and '.lora_B.weight'"
                + _other_model_hint(found, layer, config, cfg_path),
                path=wpath,
                key=f"{_PEFT_PREFIX}{t.name}.lora_A.weight",
            )
        for have, miss in (("A", "B"), ("B", "A")):
            if have in kinds and miss not in kinds:
                raise AdapterError(
                    f"{wpath}: tensor {kinds[have]!r}: lora_{have} of {t.name} has no matching lora_{miss}; "
                    f"expected both lora_A and lora_B, got only lora_{have}",
                    path=wpath,
                    key=kinds[have],
                )
    return found


def _other_model(config: ModelConfig, cfg_path: Path) -> str:
    """The words for an adapter that looks made for another base model: what its config names and what this base
    model is, so the two can be compared (``the adapter was probably made for another base model (...)``)."""
    try:
        base = json.loads(cfg_path.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    named = f"{cfg_path.name} names base_model_name_or_path {base!r}; " if base else ""
    return (f"the adapter was probably made for another base model ({named}this base model is a "
            f"{config.architecture} of {config.num_layers} layers, hidden size {config.hidden_size})")


def _other_model_hint(found: dict[tuple[int, str], dict[str, str]], layer: int, config: ModelConfig,
                      cfg_path: Path) -> str:
    """For a targeted layer with no tensors while the file stops at an earlier layer: the likely cause, an adapter
    made for a base model with fewer layers (or a file cut short); else ""."""
    last = max((l for l, _ in found), default=-1)
    if not found or layer <= last:
        return ""
    return (f". The file has tensors for layers 0-{last} only and this base model has {config.num_layers} layers: "
            f"the file was written incompletely, or " + _other_model(config, cfg_path))


def _checked_values(x: torch.Tensor, key: str, wpath: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a tensor's dtype and values: ``(values, meta)``.

    ``values`` is ``x`` on the CPU in the file's dtype, or float32 for dtypes float32 does not hold exactly
    (float64, ...), so that rounding it to a pool dtype later rounds once, as a float32 copy did; ``meta`` is
    a ``meta`` tensor of ``x``'s shape and file dtype. A ``meta`` ``x`` (a header-only read) is both, its
    values unchecked: they are checked when they are read. Raises AdapterError: a dtype not in
    ``_WEIGHT_DTYPES`` (named as the file names it and as torch does); non-finite values."""
    if x.dtype not in _WEIGHT_DTYPES:
        raise AdapterError(
            f"{wpath}: tensor {key!r}: expected a floating-point dtype ("
            f"{', '.join(dtype_name(d).split(' ')[0] for d in _WEIGHT_DTYPES)}), got {dtype_name(x.dtype)}",
            path=wpath, key=key,
        )
    if x.device.type == "meta":
        return x, x
    file_dtype = x.dtype
    # (no-op calls skipped: this runs for every tensor, hundreds per adapter)
    if x.requires_grad:
        x = x.detach()
    if x.device.type != "cpu":
        x = x.to(device="cpu")
    if file_dtype not in _EXACT_IN_F32:
        x = x.to(torch.float32)
    if not _all_finite(x):
        bad = int((~torch.isfinite(x)).sum())
        raise AdapterError(
            f"{wpath}: tensor {key!r}: expected finite values, got {bad} non-finite (NaN/inf) of {x.numel()}",
            path=wpath,
            key=key,
        )
    return x, torch.empty(x.shape, dtype=file_dtype, device="meta")


def _build_modules(
    wpath: Path,
    tensors: Mapping[str, torch.Tensor],
    keys: list[str],
    targets: dict[tuple[int, str], _Target],
    config: ModelConfig,
    spec: _Spec,
    cfg_path: Path,
    open_sink: Callable[[dict[tuple[int, str], int]], ModuleSink | None] | None = None,
) -> tuple[dict[tuple[int, str], LoRAModuleWeights], ModuleSink | None]:
    """The loading path: validate the tensors against the targets and hand each module to a sink.

    Every key is checked first (:func:`_match_keys`); then ``open_sink(ranks)`` (``(layer, module) -> r`` of every
    targeted module, in layer then ``TARGET_MODULES`` order), if given, gives the sink
    (or None); then, module by module in layer, then ``TARGET_MODULES`` order, lora_A then lora_B is taken from
    ``tensors`` (so a lazy mapping reads one tensor at a time), its shape, dtype and values checked
    (:func:`_checked_values`), and the pair goes to ``sink.put(layer, module, a, b, scaling)`` (a lazy mapping's
    scratch buffers hold one pair: two tensors are taken per ``put``, no more). Nothing is
    kept: returns ``(modules, sink)``, the modules holding ``meta`` tensors of the file's shapes and dtypes
    and the scalings.

    A target of a fused projection (Phi-3's ``qkv_proj`` [q + 2 kv, hidden], ``gate_up_proj`` [2 inter, hidden];
    ``ModelConfig.lora_slices``) is read as one pair, A [r, hidden] and B [fused_out, r], and put as one module
    per slice: each slice carries the same A and its own rows of B (``q_proj`` rows ``[0, q)``, ``k_proj``
    ``[q, q + kv)``, ...), with the projection's scaling. ``y[:, rows] += s * (x A^T) B[rows]^T`` slice by slice
    is peft's ``s * (x A^T) B^T`` on the fused output, the same numbers; the cost is that A's bytes are then held
    once per slice (three times for qkv_proj, twice for gate_up_proj) in the pool and in the modules."""
    found = _match_keys(wpath, keys, targets, config, cfg_path)
    order = {m: MODULE_INDEX[config.lora_slices(m)[0]] for m in config.lora_modules}
    targeted = sorted(targets, key=lambda lm: (lm[0], order[lm[1]]))
    # the sink sees the modules it is given: a fused target's slices (q/k/v, gate/up), each at the target's rank
    ranks = {(layer, part): targets[(layer, module)].r for layer, module in targeted
             for part in config.lora_slices(module)}
    sink = None if open_sink is None else open_sink(ranks)
    modules: dict[tuple[int, str], LoRAModuleWeights] = {}
    for (layer, module) in targeted:
        t = targets[(layer, module)]
        d_in, d_out = config.module_shape(module)
        pair = []
        for kind, expect, what in (("A", (t.r, d_in), "[r, in_features]"), ("B", (d_out, t.r), "[out_features, r]")):
            key = found[(layer, module)][kind]
            x = tensors[key]
            if tuple(x.shape) != expect:
                features = 1 if kind == "A" else 0  # in_features of A, out_features of B: the base model's
                if tuple(x.shape) == expect[::-1] and expect[0] != expect[1]:
                    other = f"; it is transposed (PEFT stores lora_{kind} as {what})"
                elif x.dim() == 2 and x.shape[features] != expect[features]:
                    other = "; " + _other_model(config, cfg_path)
                else:
                    other = ""
                raise AdapterError(
                    f"{wpath}: tensor {key!r}: expected shape {_fmt_shape(expect)} ({what} with r={t.r} from "
                    f"{t.r_source} in {cfg_path.name}, in/out features of {module} from the base model), "
                    f"got {_fmt_shape(x.shape)}" + other + _overlap_hint(spec.rank_pattern, t.name),
                    path=wpath,
                    key=key,
                )
            pair.append(_checked_values(x, key, wpath))
        (a, meta_a), (b, meta_b) = pair
        scaling = float(t.scaling(spec.use_rslora))
        row = 0
        for part in config.lora_slices(module):  # a fused projection: one module per slice, A shared
            rows = slice(row, row + config.module_shape(part)[1])
            row = rows.stop
            if sink is not None:
                sink.put(layer, part, a, b[rows], scaling)
            modules[(layer, part)] = LoRAModuleWeights(a=meta_a, b=meta_b[rows], scaling=scaling)
    return modules, sink


def load_peft_adapter(
    path: str | os.PathLike,
    config: ModelConfig,
    *,
    name: str | None = None,
    allow_pickle: bool = False,
    header_only: bool = False,
) -> LoRAAdapter:
    """Load and validate a PEFT LoRA adapter directory for the base model ``config``.

    Args:
        path: a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``.
        config: the base model; sets the number of layers and each projection's (in, out) features.
        name: stored as ``LoRAAdapter.name``.
        allow_pickle: if the directory has only ``adapter_model.bin`` (a pickle), load it with
            ``torch.load(weights_only=True, map_location="cpu")`` instead of refusing it.
        header_only: validate everything but the values from the config and the safetensors header alone
            (no tensor data is read): the returned modules hold ``meta``-device tensors of the right shapes.
            The non-finite check then happens when the values are read. A pickle file is always read.

    Returns:
        A LoRAAdapter whose ``modules[(layer, module)]`` holds ``a`` [r, in] and ``b`` [out, r] (float32,
        CPU, contiguous, whatever dtype the file had) and ``scaling`` = ``lora_alpha / r`` (LoRA paper, Hu et
        al. 2021) or ``lora_alpha / sqrt(r)`` with ``use_rslora`` (rsLoRA, Kalajdzievski 2023), with ``r`` and
        ``lora_alpha`` per module after ``rank_pattern`` / ``alpha_pattern``. Served as PEFT serves them, with no
        error: ``bias`` "all" / "lora_only" when the weight file has no bias tensor (plain LoRA), and
        ``fan_in_fan_out: true`` (taken as false with a warning, as PEFT takes it for nn.Linear).

    Raises:
        AdapterError: missing files or directory; malformed JSON (with its position); a config that is not
            plain LoRA (DoRA or another variant, ``modules_to_save``, a trained base-model bias in the weight
            file, ``lora_bias``, a base-mutating ``init_lora_weights``, ``peft_type`` other than LORA) or has
            ``r <= 0``; targets other than the seven projections (embed_tokens, lm_head: not supported yet) or
            no targeted module at all; a tensor key that does not map to a targeted (layer, module) lora_A /
            lora_B weight; a shape that does not fit (expected vs got); lora_A without lora_B or the reverse;
            a targeted module without tensors; non-finite or non-float values; a pickle without
            ``allow_pickle``; odd paths (a symlink loop, a dangling symlink, a directory or FIFO where a file
            belongs: said as such); a malformed safetensors file (header length past the end, bad JSON,
            unknown dtypes, offsets that overlap, leave gaps or run past the end, sizes that disagree with
            shapes); a file that changed while it was read (rewritten in place). The message names the file
            and key.
    """
    root, cfg_path, raw, spec, targets, cfg_stamp = _read_spec(path, config)
    wpath, tensors, keys, stamp = _read_weights(root, allow_pickle, header_only)
    if header_only and wpath.name == SAFETENSORS_NAME:  # meta tensors, no values: nothing to keep
        modules, _ = _build_modules(wpath, tensors, keys, targets, config, spec, cfg_path)
        return LoRAAdapter(name=name, path=str(root), config=raw, modules=modules, files=(cfg_stamp, stamp))
    copies = _Float32Copies()  # (a pickle file is always read whole)
    _build_modules(wpath, tensors, keys, targets, config, spec, cfg_path, lambda _max_rank: copies)
    return LoRAAdapter(name=name, path=str(root), config=raw, modules=copies.modules, files=(cfg_stamp, stamp))


def load_peft_adapter_into(
    path: str | os.PathLike,
    config: ModelConfig,
    open_sink: Callable[[dict[tuple[int, str], int]], ModuleSink | None],
    *,
    name: str | None = None,
    allow_pickle: bool = False,
) -> tuple[LoRAAdapter, ModuleSink | None]:
    """:func:`load_peft_adapter`, streaming each module's weights into a sink instead of returning them.

    The engine's disk -> host path (reload and ``load_adapter(preload=True)``) with ``AdapterPool.packer``
    as the sink: tensors stay in the file's dtype (no float32 copies; dtypes that float32 does not hold
    exactly, such as float64, are still rounded to float32 first, so the pool gets bit-identical values),
    are read one at a time, checked (same checks, order and messages as :func:`load_peft_adapter`,
    non-finite values included) and passed to ``sink.put(layer, module, a, b, scaling)`` in layer, then
    ``TARGET_MODULES`` order. ``a`` / ``b`` may be views of read buffers that are reused for the next module's:
    the sink must copy them before it returns.

    Args:
        open_sink: called with the rank of every targeted (layer, module) (a dict in layer, then ``TARGET_MODULES``
            order) once the config and every tensor key are validated, before any value is read; returns the sink,
            or None to validate without keeping values.
        path, config, name, allow_pickle: as for :func:`load_peft_adapter`.
        shard: ``(rank, size)`` of a tensor-parallel engine: the image holds that rank's shard of every module
            (``runtime.parallel.shard_lora``; ``pool`` is then a pool of the rank's shape, ``config`` the full model's).

    Returns:
        ``(adapter, sink)``: the adapter's modules hold ``meta`` tensors (the file's shapes and dtypes) and
        the scalings; the sink is what ``open_sink`` returned.

    Raises:
        AdapterError: as :func:`load_peft_adapter`. Whatever ``open_sink`` or ``sink.put`` raise.
    """
    root, cfg_path, raw, spec, targets, cfg_stamp = _read_spec(path, config)
    wpath, tensors, keys, stamp = _read_weights(root, allow_pickle, lazy=True)
    lazy = tensors if isinstance(tensors, _LazyTensors) else None
    try:
        modules, sink = _build_modules(wpath, tensors, keys, targets, config, spec, cfg_path, open_sink)
        if lazy is not None:
            lazy.check_unchanged()
    except AdapterError:
        if lazy is not None:  # a file written while it was read explains any error on its values better
            lazy.check_unchanged()
        raise
    finally:
        if lazy is not None:
            lazy.close()
    return LoRAAdapter(name=name, path=str(root), config=raw, modules=modules, files=(cfg_stamp, stamp)), sink


def read_packed_adapter(path: str | os.PathLike, config: ModelConfig, pool: AdapterPool, *, name: str | None = None,
                        allow_pickle: bool = False,
                        out: torch.Tensor | None = None,
                        shard: tuple[int, int] | None = None) -> tuple[LoRAAdapter, PackedAdapter | None]:
    """disk -> host: read, validate and lay out an adapter as its ``pool`` image in one pass.

    The general path (``read_image``, what the engine's reload and ``load_adapter(preload=True)`` run, falls back to
    it for pickles, float64 / float8 files, ranks above the pool's and errors; a tensor-parallel shard's preload
    runs it): :func:`load_peft_adapter_into` streams
    each module, in the file's dtype, into ``pool.packer`` (no float32 copies, no zero-fill pass); the image
    is bit-identical to ``pool.pack(load_peft_adapter(...))`` and the errors are the same.

    Args:
        pool: the pool whose layout and dtype the image takes (only its ``packer`` is used; nothing is loaded).
        out: where to write the image (``AdapterPool.packer``'s ``out``: a 1-D CPU tensor of the pool dtype and
            the image's size), default a fresh tensor.
        path, config, name, allow_pickle: as for :func:`load_peft_adapter`.

    Returns:
        ``(adapter, packed)``: the adapter's modules hold ``meta`` tensors (shapes, file dtypes) and the
        scalings; ``packed`` is None when its rank exceeds ``pool.max_rank`` (the values are validated anyway),
        else its ``data`` is the exact-size image (``multilora.memory.pool``) in the pool dtype on the CPU (pinned
        for a CUDA pool) and its ``ranks`` int32 / ``scalings`` float32 / ``offsets`` int64 are ``[num_layers, 7]``.

    Raises:
        AdapterError: as :func:`load_peft_adapter`.
    """
    def open_sink(ranks: dict[tuple[int, str], int]):
        if max(ranks.values(), default=0) > pool.max_rank:
            return None
        sink = pool.packer(ranks, name=name, out=out)
        return sink if shard is None or shard[1] == 1 else ShardSink(sink, config, *shard)

    adapter, packer = load_peft_adapter_into(path, config, open_sink, name=name, allow_pickle=allow_pickle)
    return adapter, None if packer is None else packer.finish()


def check_adapter_files(path: str | os.PathLike, *, max_rank: int | None = None, allow_pickle: bool = True) -> None:
    """What can be checked of an adapter directory without the model (``multilora generate`` and ``serve`` run it
    on every ``--adapter`` before the model loads): a directory, a well-formed LoRA ``adapter_config.json``, a weight
    file (only a pickle one: refused with ``allow_pickle=False``, as ``load_peft_adapter`` refuses it), and, when
    the config has no ``rank_pattern``, ``r`` at most ``max_rank``; of a safetensors file also its header (a
    readable regular file, well-formed, every tensor of a floating-point dtype) and every ``lora_A``'s rank (its
    rows; a ``rank_pattern``'s ranks too) at most ``max_rank``. The targets, key names and shapes need the model's
    config, and the values a read of the whole file: ``load_peft_adapter`` checks them at the load.

    Raises:
        AdapterError: as ``load_peft_adapter`` for the same defects (the message names the file and the field or
            key), or a rank above ``max_rank``.
    """
    root, cfg_path, _, spec, _ = _read_config(path)
    wpath = require_weights_path(root, allow_pickle)
    if max_rank is not None and not spec.rank_pattern and spec.r > max_rank:
        raise AdapterError(f"{cfg_path}: r: adapter rank {spec.r} exceeds the engine's max_lora_rank {max_rank} "
                           f"(raise it to {spec.r} or more: Engine(max_lora_rank={spec.r}), --max-lora-rank "
                           f"{spec.r})", path=cfg_path, key="r")
    if wpath.name != SAFETENSORS_NAME:
        return
    _, metas, keys, _ = _read_weights(root, allow_pickle, header_only=True)  # (the header's bytes alone)
    configured = {spec.r, *(spec.rank_pattern or {}).values()}  # the ranks the config gives its modules
    for key in keys:
        _checked_values(metas[key], key, wpath)  # (a meta tensor: the dtype alone)
        shape = tuple(metas[key].shape)
        if (max_rank is not None and ".lora_A." in key and len(shape) == 2 and shape[0] > max_rank
                and shape[0] in configured):  # (rows the config does not give: the loader's shape error names it)
            why = "; the config's rank_pattern" if spec.rank_pattern else ""
            raise AdapterError(f"{wpath}: tensor {key!r}: rank {shape[0]} (its rows{why}) exceeds the engine's "
                               f"max_lora_rank {max_rank} (raise it to {shape[0]} or more: Engine(max_lora_rank="
                               f"{shape[0]}), --max-lora-rank {shape[0]})", path=wpath, key=key)


def _read_spec(path: str | os.PathLike,
               config: ModelConfig) -> tuple[Path, Path, dict, _Spec, dict[tuple[int, str], _Target], FileStamp]:
    """The directory checks, the config and the targets: ``(root, config path, raw config, spec, targets,
    the config's stamp as read)``."""
    root, cfg_path, raw, spec, stamp = _read_config(path)
    return root, cfg_path, raw, spec, _resolve_targets(spec, config, cfg_path), stamp


def _read_config(path: str | os.PathLike) -> tuple[Path, Path, dict, _Spec, FileStamp]:
    """The directory checked and its ``adapter_config.json`` read and validated (no model needed): ``(root, config
    path, raw config, spec, the config's stamp as read)``."""
    root = Path(path)
    check_directory(root)
    cfg_path = root / CONFIG_NAME
    data, stamp = read_whole(cfg_path, missing=f"missing: an adapter directory must hold {CONFIG_NAME}")
    raw = _config_json(data, cfg_path)
    return root, cfg_path, raw, _parse_config(raw, cfg_path), stamp
