"""``multilora memory``: print the memory plan of this machine, or of a recorded snapshot.

    multilora memory                                  # plan for this machine (cuda:0, else the CPU)
    multilora memory --save-snapshot snap.json        # ... and record the snapshot it used
    multilora memory --snapshot snap.json --json      # replay a recorded snapshot, machine-readable
    multilora memory --kv-bytes 8GiB --fraction 0.8 --local-ranks 4

Byte options take an integer or a number with a unit: B, KiB, MiB, GiB, TiB (powers of 1024),
KB, MB, GB, TB (powers of 1000); K, M, G, T alone are read as KiB, MiB, GiB, TiB; at most 2^64 - 1.

Exit status 2, with one line that names the file or the option, for a snapshot that cannot be read
(``MemorySnapshotError``), a plan that does not fit (``MemoryPlanError``) or a bad option. A plan whose adapter
pool is 0 B (asked for with ``--adapter-pool-share 0`` or ``--adapter-pool-bytes 0``, or left by the caps) exits 0
with a note under the plan (stderr stays empty on exit 0; ``--json`` shows the 0 B): an engine needs room for one
adapter, which ``--min-adapter-bytes`` makes the plan check; a 0 B KV cache likewise (``--min-kv-bytes``). A last
note says how an engine's own bounds (its weights, ``max_batch_size`` x ``max_seq_len`` of KV) change the sizes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from fractions import Fraction
from pathlib import Path

from multilora.memory.accounting import (
    DEFAULT_ADAPTER_POOL_SHARE,
    DEFAULT_FRACTION,
    MAX_MEASURED_BYTES,
    MemoryPlanError,
    MemoryPlanOptions,
    MemorySnapshot,
    MemorySnapshotError,
    compute_memory_plan,
)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512MiB', '1.5G', '4096' (exact: a decimal is not read as a float).

    Raises ValueError on anything else, or on a count above 2^64 - 1 (16 EiB).
    """
    m = _BYTES.match(text)
    unit = m.group(2).lower() if m else None
    shown = repr(text[:40]) + ("..." if len(text) > 40 else "")
    if m is None or unit not in _UNITS:
        raise ValueError(f"expected a byte count like 4096, 512MiB or 2GiB, got {shown}")
    value = int(Fraction(m.group(1)) * _UNITS[unit]) if len(m.group(1)) <= 40 else None
    if value is None or value > MAX_MEASURED_BYTES:
        raise ValueError(f"expected a byte count below 2^64 (16 EiB), got {shown}")
    return value


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_memory_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``memory`` subcommand to ``subparsers``; its handler is ``args.func = run_memory``."""
    p = subparsers.add_parser("memory", help="print the memory plan (pool, KV, host tier) for this machine")
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
    p.add_argument("--adapter-pool-bytes", type=_bytes_arg, help="cap on the adapter pool")
    p.add_argument("--kv-bytes", "--kv-cache-bytes", type=_bytes_arg,
                   help="cap on the KV cache (the engine's --kv-cache-bytes)")
    p.add_argument("--total-bytes", type=_bytes_arg, help="cap on adapter pool + KV")
    p.add_argument("--host-adapter-bytes", type=_bytes_arg, help="explicit host-tier size (default: automatic)")
    p.add_argument("--non-kv-reserve-bytes", type=_bytes_arg, default=0, help="activations and workspaces (default 0)")
    p.add_argument("--min-adapter-bytes", type=_bytes_arg, default=0, help="one max-size adapter (live-state minimum)")
    p.add_argument(
        "--min-kv-bytes", type=_bytes_arg, default=0, help="KV of one max-length sequence (live-state minimum)"
    )


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
        return read_snapshot_file(args.snapshot)
    from multilora.memory.snapshot import take_snapshot  # imports torch.cuda only when measuring
    from multilora.runtime.config import CLI_USE_CPU, as_flag_error, resolve_device

    if args.device is not None:  # cuda on a machine without it, or a bad name: the flag's error, not a traceback
        try:
            resolve_device(args.device, use_cpu=CLI_USE_CPU)
        except ValueError as e:
            raise as_flag_error(e) from None
    return take_snapshot(args.device)


def run_memory(args: argparse.Namespace) -> int:
    """Handler of ``multilora memory``: 0 on success, 2 on bad input or a plan that does not fit."""
    try:
        options = _options(args)
        snapshot = _snapshot(args)
    except (ValueError, OSError) as e:
        print(f"multilora memory: {e}", file=sys.stderr)
        return 2
    if args.save_snapshot is not None:
        try:
            args.save_snapshot.write_text(json.dumps(snapshot.to_dict(), indent=2) + "\n")
        except OSError as e:
            print(f"multilora memory: cannot write the snapshot to {args.save_snapshot}: {e.strerror or e}",
                  file=sys.stderr)
            return 2
    try:
        plan = compute_memory_plan(snapshot, options)
    except MemoryPlanError as e:
        print(f"multilora memory: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "snapshot": snapshot.to_dict()}, indent=2))
    else:
        print(plan.explain())
        for note in plan_notes(plan, options):
            print(f"note: {note}")
    return 0


def plan_notes(plan, options: MemoryPlanOptions) -> list[str]:
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
    notes.append("this is the machine's plan before an engine's own bounds: an engine plans after loading its "
                 "weights (not counted here unless in --non-kv-reserve-bytes), caps its KV cache at max_batch_size "
                 "sequences of max_seq_len, and holds its pool to at least one adapter of max_lora_rank; the sizes an "
                 "engine took are in Engine.stats() (pool_bytes_total, kv_blocks_total, host_tier_budget) and "
                 "`multilora generate --stats`")
    return notes


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m multilora.runtime.cli_memory``), same options as ``multilora memory``."""
    p = argparse.ArgumentParser(prog="multilora memory", description=__doc__.splitlines()[0])
    _add_arguments(p)
    return run_memory(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
