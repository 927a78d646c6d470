"""``multilora memory``: print the memory plan of this machine, or of a recorded snapshot.

    multilora memory                                  # plan for this machine (cuda:0, else the CPU)
    multilora memory --save-snapshot snap.json        # ... and record the snapshot it used
    multilora memory --snapshot snap.json --json      # replay a recorded snapshot, machine-readable
    multilora memory --kv-bytes 8GiB --fraction 0.8 --local-ranks 4
    multilora memory --model                          # what an engine of the default model would take here
    multilora memory --model llama-3-8b/ --max-batch-size 64 --max-seq-len 4096 --max-lora-rank 16

Byte options take an integer or a number with a unit: B, KiB, MiB, GiB, TiB (powers of 1024),
KB, MB, GB, TB (powers of 1000); K, M, G, T alone are read as KiB, MiB, GiB, TiB; at most 2^64 - 1.

Exit status 2, with one line that names the file or the option, for a snapshot that cannot be read
(``MemorySnapshotError``), a plan that does not fit (``MemoryPlanError``) or a bad option; with ``--json`` also
``{"error": {"message", "type"}}`` on stdout (a plan that does not fit adds ``needed_bytes``, ``fits_bytes``,
``source``). A plan whose adapter
pool is 0 B (asked for with ``--adapter-pool-share 0`` or ``--adapter-pool-bytes 0``, or left by the caps) exits 0
with a note under the plan (stderr stays empty on exit 0; ``--json`` shows the 0 B): an engine needs room for one
adapter, which ``--min-adapter-bytes`` makes the plan check; a 0 B KV cache likewise (``--min-kv-bytes``). A last
note says how an engine's own bounds (its weights, ``max_batch_size`` x ``max_seq_len`` of KV) change the sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from multilora.memory.accounting import (
    DEFAULT_ADAPTER_POOL_SHARE,
    DEFAULT_FRACTION,
    USER_CAP,
    MemoryPlanError,
    MemoryPlanOptions,
    MemorySnapshot,
    MemorySnapshotError,
    compute_memory_plan,
)
from multilora.runtime.config import bytes_arg as _bytes_arg, parse_bytes  # noqa: F401 (parse_bytes: re-exported)


#: how every BYTES option is written (the parser's epilog; ``multilora.runtime.config.parse_bytes``)
BYTES_HELP = ("BYTES: a count (4096, or 2,010,458,972 with commas, as the plan prints it) or a number with a unit: "
              "B, KiB, MiB, GiB, TiB (powers of 1024; K, M, G, T alone too) or KB, MB, GB, TB (powers of 1000), e.g. "
              "512MiB, 1.5GiB, 8GB; at most 2^64 - 1")


def add_memory_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``memory`` subcommand to ``subparsers``; its handler is ``args.func = run_memory``."""
    p = subparsers.add_parser("memory", help="print the memory plan (pool, KV, host tier) for this machine",
                              description=__doc__.splitlines()[0], epilog=BYTES_HELP)
    _add_arguments(p)
    p.set_defaults(func=run_memory)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", default=None, help="device to plan for: cuda:N or cpu (default: cuda:0 if present, else cpu)"
    )
    p.add_argument("--snapshot", type=Path, help="replay a recorded snapshot JSON instead of measuring this machine")
    p.add_argument("--save-snapshot", type=Path, help="write the snapshot used to this JSON file")
    p.add_argument("--json", action="store_true", help="print the plan (and its snapshot) as JSON")
    p.add_argument(
        "--fraction", "--gpu-memory-fraction", type=float, default=DEFAULT_FRACTION,
        help="share of the hard budget for pool + KV (default 0.9; the engine's --gpu-memory-fraction)"
    )
    p.add_argument(
        "--adapter-pool-share",
        type=float,
        default=DEFAULT_ADAPTER_POOL_SHARE,
        help="share of the budget for the adapter pool (default 0.1)",
    )
    p.add_argument("--local-ranks", type=int, default=1, help="processes on this host sharing its memory (default 1)")
    p.add_argument("--adapter-pool-bytes", type=_bytes_arg, metavar="BYTES",
                   help="cap on the adapter pool (default: none, the share above decides)")
    p.add_argument("--kv-bytes", "--kv-cache-bytes", type=_bytes_arg, metavar="BYTES",
                   help="cap on the KV cache (the engine's --kv-cache-bytes; default: none)")
    p.add_argument("--total-bytes", type=_bytes_arg, metavar="BYTES", help="cap on adapter pool + KV (default: none)")
    p.add_argument("--host-adapter-bytes", type=_bytes_arg, metavar="BYTES",
                   help="explicit host-tier size (default: automatic)")
    p.add_argument("--non-kv-reserve-bytes", type=_bytes_arg, default=0, metavar="BYTES",
                   help="activations and workspaces (default 0)")
    p.add_argument("--min-adapter-bytes", type=_bytes_arg, default=0, metavar="BYTES",
                   help="one max-size adapter: the live-state minimum the plan checks (default 0: not checked)")
    p.add_argument("--min-kv-bytes", type=_bytes_arg, default=0, metavar="BYTES",
                   help="KV of one max-length sequence: the live-state minimum the plan checks (default 0: not checked)")
    e = p.add_argument_group(
        "an engine's plan (--model)",
        "the sizes an Engine of that model would take here: the plan above with the engine's own inputs (its weights "
        "in the reserve, since it plans after loading them; KV capped at max_batch_size sequences of max_seq_len; the "
        "pool at least one adapter of max_lora_rank). Only the model's config is read, not its weights.")
    e.add_argument("--model", nargs="?", const="", default=None, metavar="PATH",
                   help="a GGUF file or Hugging Face model directory (no PATH: the embedded default model)")
    for flag, kind, what in _ENGINE_FLAGS:
        choices = _engine_field(flag[2:].replace("-", "_")).metadata.get("choices")  # (as the engine's own flags)
        e.add_argument(flag, type=None if choices else kind, choices=choices, default=None, help=what)
    e.add_argument("--adapter-finish", choices=("host", "device"), default=None,
                   help="where adapters read again from disk get the pool's layout (default: device on a GPU, host on "
                        "the CPU); device adds the pool's finish scratch to the reserve")
    e.add_argument("--adapter-pool-fill", action="store_true", default=None,
                   help="the pool also takes the budget the KV cache can never use (Engine(adapter_pool_fill=True))")
    e.add_argument("--unified-pool", action="store_true", default=None,
                   help="the pool and the KV cache in one buffer with a movable boundary (Engine(unified_pool=True)): "
                        "also prints how far each side can grow")
    e.add_argument("--fp8-lm-head", action=argparse.BooleanOptionalAction, default=None,
                   help="with --weight-dtype fp8: the LM head in fp8 too (default: when the model's head is untied; "
                        "Engine(fp8_lm_head=...))")


#: the engine options ``--model`` takes beside the plan's own (``EngineConfig`` fields of the same names)
def _engine_field(name: str):
    import dataclasses

    from multilora.runtime.config import EngineConfig

    return next(f for f in dataclasses.fields(EngineConfig) if f.name == name)


def _engine_default(name: str):
    return _engine_field(name).default


_ENGINE_FLAGS = (
    ("--max-batch-size", int, f"requests per step (default the engine's, {_engine_default('max_batch_size')}); KV "
                              "holds this many max_seq_len sequences"),
    ("--max-seq-len", int, "longest sequence in tokens (default: the model's, at most 2,048 on CUDA, 1,024 on the CPU)"),
    ("--max-lora-rank", int, f"largest adapter rank (default {_engine_default('max_lora_rank')}): the pool holds one "
                             "such adapter on every module"),
    ("--kv-block-size", int, f"tokens per KV block (default {_engine_default('kv_block_size')})"),
    ("--adapter-slots", int, "cap on adapters resident at once (default: as many rank-8 q/k/v/o ones as fit)"),
    ("--max-prefill-tokens", int, f"largest prefill (default {_engine_default('max_prefill_tokens')}): sizes the "
                                  "activation reserve"),
    ("--dtype", str, "float32, float16 or bfloat16 (default: bfloat16 on CUDA, float32 on the CPU)"),
    ("--weight-dtype", str, "fp8: the base projections (and an untied LM head) at 1 byte per weight"),
)
#: the EngineConfig fields of --model's flags (the engine flags and --adapter-pool-fill): argparse dests
_ENGINE_FIELDS = tuple(f[2:].replace("-", "_") for f, _, _ in _ENGINE_FLAGS) + ("adapter_finish", "adapter_pool_fill",
                                                                                   "unified_pool", "fp8_lm_head")
#: the plan's options an engine computes itself: not with --model
_NOT_WITH_MODEL = (
    ("total_bytes", "--total-bytes", "an engine has no cap on pool + KV together: cap each (--adapter-pool-bytes, "
                                     "--kv-bytes)"),
    ("non_kv_reserve_bytes", "--non-kv-reserve-bytes", "an engine's reserve is its weights and activations, computed "
                                                       "from the model"),
    ("min_adapter_bytes", "--min-adapter-bytes", "an engine's minimum is one adapter of --max-lora-rank"),
    ("min_kv_bytes", "--min-kv-bytes", "an engine's minimum is KV for one sequence of --max-seq-len"))


def _options(args: argparse.Namespace) -> MemoryPlanOptions:
    return MemoryPlanOptions(
        fraction=args.fraction,
        adapter_pool_share=args.adapter_pool_share,
        non_kv_reserve_bytes=args.non_kv_reserve_bytes,
        min_adapter_pool_bytes=args.min_adapter_bytes,
        min_kv_bytes=args.min_kv_bytes,
        max_adapter_pool_bytes=args.adapter_pool_bytes,
        max_kv_bytes=args.kv_bytes,
        max_total_bytes=args.total_bytes,
        host_tier_bytes=args.host_adapter_bytes,
        local_ranks=args.local_ranks,
    )


def read_snapshot_file(path: Path) -> MemorySnapshot:
    """The snapshot recorded in ``path``; MemorySnapshotError naming the file when it cannot be read,
    is not UTF-8 JSON or is not a snapshot (``MemorySnapshot.from_json``)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise MemorySnapshotError(None, "a snapshot file", f"a file that cannot be read ({e.strerror or e})",
                                  file=str(path)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MemorySnapshotError(None, "UTF-8 JSON text", f"bytes that are not UTF-8 (at byte {e.start})",
                                  file=str(path)) from None
    return MemorySnapshot.from_json(text, file=str(path))


def _snapshot(args: argparse.Namespace) -> MemorySnapshot:
    if args.snapshot is not None:
        if args.device is not None:  # (was ignored: the plan is of the snapshot's device, whatever --device says)
            raise ValueError(f"--device: not with --snapshot (the snapshot {str(args.snapshot)!r} is of the device it "
                             f"was taken on; `multilora memory --device {args.device} --save-snapshot FILE` records "
                             f"another)")
        return read_snapshot_file(args.snapshot)
    from multilora.memory.snapshot import take_snapshot  # imports torch.cuda only when measuring
    from multilora.runtime.config import CLI_USE_CPU, as_flag_error, resolve_device

    if args.device is not None:  # cuda on a machine without it, or a bad name: the flag's error, not a traceback
        try:
            resolve_device(args.device, use_cpu=CLI_USE_CPU)
        except ValueError as e:
            raise as_flag_error(e) from None
    return take_snapshot(args.device)


def _engine_config(args: argparse.Namespace):
    """The ``EngineConfig`` of ``--model``'s plan: the engine flags given and the plan's own options by their
    engine names. Raises ValueError naming the flag (a value the engine refuses, or an option it computes itself)."""
    from multilora.runtime.config import EngineConfig, as_flag_error

    for name, flag, why in _NOT_WITH_MODEL:
        if getattr(args, name):
            raise ValueError(f"{flag}: not with --model ({why})")
    fields = {"gpu_memory_fraction": args.fraction, "adapter_pool_share": args.adapter_pool_share,
              "adapter_pool_bytes": args.adapter_pool_bytes, "kv_cache_bytes": args.kv_bytes,
              "host_adapter_bytes": args.host_adapter_bytes, "local_ranks": args.local_ranks}
    fields.update({name: getattr(args, name) for name in _ENGINE_FIELDS})
    try:
        return EngineConfig(**{k: v for k, v in fields.items() if v is not None})
    except ValueError as e:  # "--gpu-memory-fraction: ...", "--kv-cache-bytes: ...": aliases of this command's flags
        raise as_flag_error(e) from None


def engine_sizes(args: argparse.Namespace, snapshot: MemorySnapshot) -> dict:
    """What an ``Engine`` of ``--model`` would allocate on the machine of ``snapshot`` (taken before the model is
    loaded: its weights' bytes join the reserve), as ``runtime.sizing`` sizes it: a dict of the inputs and sizes (the
    keys of ``--json``'s ``"engine"``) with the plan under ``"plan"``. On CUDA an engine measures its reserve with a
    forward pass of the largest prefill; this uses the estimate the engine starts from (``activation_bytes``).

    Raises:
        ValueError: a bad flag (named), a model that cannot be read (``ModelLoadError``), a plan that does not fit
            (``MemoryPlanError``).
    """
    from multilora.runtime.sizing import (MAX_DEFAULT_SLOTS, default_dtype, default_max_seq_len, memory_request,
                                          size_engine, unified_sizes, weight_bytes)
    from multilora.runtime.weights import model_config, resolve_model_path

    from multilora.runtime.config import as_flag_error, finish_on_device

    cfg = _engine_config(args)
    if cfg.weight_dtype == "fp8" and args.snapshot is None:  # the engine's check, on the device measured
        from multilora.kernels.fp8 import fp8_supported
        from multilora.runtime.config import CLI_USE_CPU, resolve_device

        ok, why = fp8_supported(resolve_device(args.device, use_cpu=CLI_USE_CPU))
        if not ok:
            raise ValueError(f"--weight-dtype: fp8 is not available here: {why}")
    path = resolve_model_path(args.model or None, require_weights=False)
    model = model_config(path, require_weights=False)
    device_type = "cuda" if snapshot.has_gpu else "cpu"
    dtype = default_dtype(cfg, device_type)
    try:
        max_seq_len = default_max_seq_len(model, cfg, device_type)
    except ValueError as e:  # past the model's context: in this command's flag
        raise as_flag_error(e) from None
    try:
        request = memory_request(model, cfg, dtype=dtype, max_seq_len=max_seq_len, device_type=device_type)
    except ValueError as e:  # "Engine: kv_cache_bytes=1 holds 0 KV block(s)": in this command's flag
        raise as_flag_error(e) from None
    weights = weight_bytes(model, dtype, cfg.weight_dtype, cfg.fp8_lm_head)
    try:
        sizes = size_engine(request, cfg, snapshot, reserve_bytes=request.activation_bytes + weights)
    except MemoryPlanError as e:  # a reserve or live state that does not fit: the reserve is the model's, say of what
        why = str(as_flag_error(e)).replace(", non_kv_reserve_bytes)", ")")  # (the flag is refused with --model)
        if "reserve" in why or "live-state minimum" in why:
            r = request
            prefill = r.activation_bytes - r.sampling_bytes - r.scratch_bytes - r.slot_table_bytes
            why += (f" (the reserve of an engine of this model: its weights {weights:,} B + {r.activation_bytes:,} B "
                    f"for its largest step: activations of a --max-prefill-tokens prefill {prefill:,} B, the sampling "
                    f"workspace of --max-batch-size {cfg.max_batch_size} rows of {model.vocab_size:,} logits "
                    f"{r.sampling_bytes:,} B, the pool's slot table "
                    f"({'--adapter-slots' if cfg.adapter_slots else 'at most'} {cfg.adapter_slots or MAX_DEFAULT_SLOTS:,}"
                    f" slots) {r.slot_table_bytes:,} B"
                    + (f", the device finish's scratch {r.scratch_bytes:,} B" if r.scratch_bytes else "") + ")")
        if "live-state minimum" in why:
            why += (f"; the live state is one adapter of --max-lora-rank {cfg.max_lora_rank} on every module "
                    f"({request.pages_per_adapter * request.page_bytes:,} B) + the KV of one --max-seq-len "
                    f"{max_seq_len} sequence ({(request.live_blocks + 1) * request.block_bytes:,} B)")
        raise MemoryPlanError(why, needed_bytes=e.needed_bytes, fits_bytes=e.fits_bytes, source=e.source) from None
    except ValueError as e:
        raise as_flag_error(e) from None
    r, plan = request, sizes.plan
    pool_pages, kv_blocks, slots = sizes.num_pages, sizes.num_blocks, sizes.slots
    pool_max_pages, kv_max_blocks, unified_bytes = pool_pages, kv_blocks, None
    if cfg.unified_pool:  # the engine's one buffer: the same bytes in whole KV-block units (memory/unified.py)
        try:
            layout, slots = unified_sizes(sizes, cfg)
        except ValueError as e:
            raise ValueError(f"--unified-pool: {e}") from None
        unified_bytes, pool_pages, pool_max_pages = layout.nbytes, layout.pool_pages, layout.max_pool_pages
        kv_blocks = layout.num_units - layout.floor + 1  # units [floor, num_units) + the null block
        kv_max_blocks = layout.max_kv_usable_blocks + 1
    kv_seqs = (kv_blocks - 1) // r.seq_blocks  # whole max_seq_len sequences (the null block aside)
    return {"model": str(path), "architecture": model.architecture, "layers": model.num_layers,
            "adapter_pool_fill": cfg.adapter_pool_fill, "unified_pool": cfg.unified_pool, "unified_bytes": unified_bytes,
            "fp8_lm_head": cfg.fp8_lm_head, "kv_sequences": kv_seqs, "kv_seq_blocks": r.seq_blocks,
            "budget_unused_bytes": None if plan is None else plan.budget_bytes - plan.adapter_pool_bytes - plan.kv_bytes,
            "kv_source": None if plan is None else plan.kv_source,
            "dtype": str(dtype).replace("torch.", ""), "weight_dtype": cfg.weight_dtype,
            "max_batch_size": cfg.max_batch_size, "max_seq_len": max_seq_len, "max_lora_rank": cfg.max_lora_rank,
            "kv_block_size": cfg.kv_block_size, "weight_bytes": weights,
            "fp8_checked": None if cfg.weight_dtype != "fp8" else args.snapshot is None, "activation_bytes": r.activation_bytes,
            "adapter_finish": "device" if finish_on_device(cfg, device_type) else "host",
            "finish_scratch_bytes": r.scratch_bytes, "slot_table_bytes": r.slot_table_bytes,
            "pool_bytes": pool_pages * r.page_bytes, "pool_pages": pool_pages, "page_bytes": r.page_bytes,
            "pool_max_bytes": pool_max_pages * r.page_bytes, "max_rank_adapters": pool_pages // r.pages_per_adapter,
            "max_rank_adapters_max": pool_max_pages // r.pages_per_adapter, "adapter_slots": slots,
            "kv_blocks": kv_blocks, "kv_max_blocks": kv_max_blocks, "kv_block_bytes": r.block_bytes,
            "kv_tokens": (kv_blocks - 1) * cfg.kv_block_size, "host_tier_bytes": sizes.host_bytes,
            "plan": sizes.plan}


def _explain_engine(e: dict) -> str:
    gib = lambda n: f"{n / (1 << 30):.2f} GiB ({n:,} B)"  # noqa: E731
    host = "none" if e["host_tier_bytes"] is None else gib(e["host_tier_bytes"])
    capped = e["kv_sequences"] >= e["max_batch_size"]
    used_tokens = e["max_batch_size"] * e["kv_seq_blocks"] * e["kv_block_size"]  # the most KV the engine can use
    return "\n".join([
        f"engine of {e['model']} ({e['architecture']}, {e['layers']} layers; {e['dtype']}"
        + (f", {e['weight_dtype']} weights" if e["weight_dtype"] else "")
        + f", max_lora_rank {e['max_lora_rank']}, max_batch_size {e['max_batch_size']}, max_seq_len {e['max_seq_len']}, "
          f"kv_block_size {e['kv_block_size']}" + (", adapter_pool_fill" if e["adapter_pool_fill"] else "")
        + (", unified_pool" if e["unified_pool"] else "")
        + (f", LM head in {e['dtype']}" if e["weight_dtype"] and e["fp8_lm_head"] is False else "") + "):",
        f"  weights       {gib(e['weight_bytes'])}, in the reserve: the engine plans after loading them",
        f"  activations   {gib(e['activation_bytes'])}, in the reserve (with the sampling workspace, the adapter "
        f"pool's slot table ({gib(e['slot_table_bytes'])})"
        + (f" and the {gib(e['finish_scratch_bytes'])} scratch that finishes adapters read from disk on the device "
           "(adapter_finish=device; --adapter-finish host leaves it out)" if e["finish_scratch_bytes"] else "")
        + "; an estimate: on CUDA the engine measures the rest with a forward pass of its largest prefill)",
        f"  adapter pool  {gib(e['pool_bytes'])} = {e['pool_pages']:,} pages of {e['page_bytes']} B: "
        f"{e['max_rank_adapters']:,} adapters of rank {e['max_lora_rank']} on every module, {e['adapter_slots']:,} slots",
        f"  KV cache      {gib(e['kv_blocks'] * e['kv_block_bytes'])} = {e['kv_blocks']:,} blocks of "
        f"{e['kv_block_bytes']:,} B (the null block included): {e['kv_tokens']:,} tokens, {e['kv_sequences']:,} whole "
        f"sequences of max_seq_len ({e['kv_seq_blocks']} blocks each)"
        + (" = max_batch_size: the engine's cap" if capped else ""),
        f"  host tier     {host}",
    ] + ([] if not e["unified_pool"] else [
        f"  unified       {gib(e['unified_bytes'])}: the pool and the KV cache above are one buffer of "
        f"{e['unified_bytes'] // e['kv_block_bytes']:,} units of one KV block; "
        + ("the pool cannot grow (the KV side is at its minimum)" if e["pool_max_bytes"] == e["pool_bytes"] else
           f"the pool grows into idle KV up to {gib(e['pool_max_bytes'])} ({e['max_rank_adapters_max']:,} adapters of "
           f"rank {e['max_lora_rank']} on every module)")
        + f", the KV cache into free pool pages up to {e['kv_max_blocks']:,} blocks "
          f"({(e['kv_max_blocks'] - 1) * e['kv_block_size']:,} tokens"
        + (f"; it uses at most max_batch_size x max_seq_len = {used_tokens:,})"
           if e["kv_max_blocks"] - 1 > e["max_batch_size"] * e["kv_seq_blocks"] else ")")]))


def engine_notes(e: dict) -> list[str]:
    """What an engine of ``--model`` would make of its sizes (printed under them)."""
    notes = []
    if e["kv_sequences"] < e["max_batch_size"]:
        notes.append(f"the KV cache holds {e['kv_sequences']} whole sequences of max_seq_len, fewer than max_batch_size "
                     f"{e['max_batch_size']}: requests past that wait for blocks or are preempted")
    if e["fp8_checked"] is False:
        notes.append("fp8 weights are sized, not checked: a snapshot does not record the GPU's compute capability "
                     "(fp8 needs 8.9 or newer); measured on the machine itself, the command checks it as an engine does")
    unused = e["budget_unused_bytes"] or 0
    if unused > (1 << 30) and not e["adapter_pool_fill"]:
        why = ("KV is capped by --kv-cache-bytes" if e["kv_source"] == USER_CAP else
               "KV can use at most max_batch_size sequences of max_seq_len")
        notes.append(f"{unused / (1 << 30):.2f} GiB of the budget goes to neither the pool nor the KV cache ({why}): "
                     "--adapter-pool-fill gives it to the adapter pool")
    return notes


#: ``MemoryPlanOptions`` fields -> this command's flags (an option's error names the flag)
_OPTION_FLAGS = {"fraction": "--fraction", "adapter_pool_share": "--adapter-pool-share",
                 "non_kv_reserve_bytes": "--non-kv-reserve-bytes", "min_adapter_pool_bytes": "--min-adapter-bytes",
                 "min_kv_bytes": "--min-kv-bytes", "max_adapter_pool_bytes": "--adapter-pool-bytes",
                 "max_kv_bytes": "--kv-bytes", "max_total_bytes": "--total-bytes",
                 "host_tier_bytes": "--host-adapter-bytes", "local_ranks": "--local-ranks"}


def _flag_words(e: Exception, args: argparse.Namespace) -> str:
    """``e``'s message with a leading option field (``local_ranks: ...``) or ``model: ...`` in this command's flags."""
    msg = str(e)
    field = msg.split(":", 1)[0]
    if field in _OPTION_FLAGS:
        return _OPTION_FLAGS[field] + msg[len(field):]
    if field == "model" and args.model:
        return f"--model {args.model}" + msg[len(field):]
    return msg


def run_memory(args: argparse.Namespace) -> int:
    """Handler of ``multilora memory``: 0 on success, 2 on bad input or a plan that does not fit."""
    try:
        options = _options(args)
        if args.model is None:
            given = [name for name in _ENGINE_FIELDS if getattr(args, name) is not None]
            if given:
                raise ValueError(f"--{given[0].replace('_', '-')}: only with --model (the sizes of an engine of that "
                                 f"model)")
        snapshot = _snapshot(args)
    except (ValueError, OSError) as e:
        return _failed(e, args)
    if args.save_snapshot is not None:
        try:
            args.save_snapshot.write_text(json.dumps(snapshot.to_dict(), indent=2) + "\n")
        except OSError as e:
            print(f"multilora memory: error: cannot write the snapshot to {args.save_snapshot}: {e.strerror or e}",
                  file=sys.stderr)
            return 2
        print(f"multilora memory: snapshot saved to {args.save_snapshot} (plan from it again with --snapshot "
              f"{args.save_snapshot})", file=sys.stderr)
    engine = None
    try:
        if args.model is not None:
            engine = engine_sizes(args, snapshot)
            plan = engine.pop("plan")
        else:
            plan = compute_memory_plan(snapshot, options)
    except ValueError as e:  # (MemoryPlanError, ModelLoadError, a flag the engine refuses)
        return _failed(e, args)
    notes = plan_notes(plan, plan.options, engine=engine is not None) + (
        engine_notes(engine) if engine is not None else [])
    if args.json:  # ("notes": what the text prints as "note:" lines under the plan; the plan's own are in "plan")
        print(json.dumps({"plan": plan.to_dict(), "snapshot": snapshot.to_dict(),
                          **({"engine": engine} if engine is not None else {}), "notes": notes}, indent=2))
    else:
        print(plan.explain())
        if engine is not None:
            print(_explain_engine(engine))
        for note in notes:
            print(f"note: {note}")
    return 0


def _failed(e: Exception, args: argparse.Namespace) -> int:
    """Exit status 2 for ``e``: its message on stderr (in this command's flags); with ``--json`` also, on stdout,
    ``{"error": {"message", "type"}}`` and, for a plan that does not fit (``MemoryPlanError``), its
    ``needed_bytes``, ``fits_bytes`` and ``source``, so a tool reading the JSON learns what was short."""
    msg = _flag_words(e, args)
    print(f"multilora memory: error: {msg}", file=sys.stderr)
    if getattr(args, "json", False):
        err = {"message": msg, "type": type(e).__name__}
        if isinstance(e, MemoryPlanError):
            err.update(needed_bytes=e.needed_bytes, fits_bytes=e.fits_bytes, source=e.source)
        print(json.dumps({"error": err}, indent=2))
    return 2


def plan_notes(plan, options: MemoryPlanOptions, engine: bool = False) -> list[str]:
    """What an engine would make of ``plan`` that the plan itself does not say (printed under it, exit 0: a plan is
    not an error, and may be what was asked for): a 0 B pool or KV cache, which an engine refuses, and how an
    engine's own bounds change the sizes."""
    notes = []
    if plan.adapter_pool_bytes == 0 and not options.min_adapter_pool_bytes:
        notes.append("the adapter pool is 0 B; an engine refuses to start without room for one adapter of its "
                     "max_lora_rank (pass --min-adapter-bytes with that size to plan against it)")
    if plan.kv_bytes == 0 and not options.min_kv_bytes:
        notes.append("the KV cache is 0 B; an engine refuses to start without KV for one max_seq_len sequence "
                     "(pass --min-kv-bytes with that size to plan against it)")
    if not engine:
        notes.append("the machine's plan, before an engine's own bounds (its weights, max_batch_size x max_seq_len "
                     "of KV): --model [PATH] plans as an engine of that model")
    return notes


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m multilora.runtime.cli_memory``), same options as ``multilora memory``."""
    p = argparse.ArgumentParser(prog="multilora memory", description=__doc__.splitlines()[0], epilog=BYTES_HELP,
                                allow_abbrev=False)
    _add_arguments(p)
    return run_memory(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
