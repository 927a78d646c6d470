"""Memory accounting: how many bytes the adapter pool, the KV cache and the host tier may take.

This module is the PURE core: ``compute_memory_plan(snapshot, options)`` maps an explicit
``MemorySnapshot`` (everything measured on a machine, as raw numbers and raw file text) and
``MemoryPlanOptions`` (caps, fraction, reserve, live-state minimum, local ranks) to a ``MemoryPlan``.
It reads no files; ``multilora.memory.snapshot`` gathers snapshots on the running machine. A malformed
snapshot is refused with ``MemorySnapshotError`` (a ValueError naming the file, the field, what was
expected and what was got); raw file text inside a snapshot is never refused: garbage reads as None.
The formulae, with their sources, are in ``docs/memory.md``; in short (all per local rank)::

    discrete GPU:    usable = cuda_free
    integrated GPU:  usable = min(max(cuda_free, min(MemAvailable, device_total)), cgroup_headroom) / ranks
    no GPU (host):   usable = min(MemAvailable, MemTotal, cgroup_headroom) / ranks
    hard budget      = usable - non_kv_reserve
    budget           = max(fraction * hard budget, live_state_minimum)      (raises if minimum > hard)
                       then lowered by the user's total cap
    adapter pool     = adapter_pool_share * budget, KV = the rest         (each lowered by its cap)
                       with kv_need: KV = min(the rest, kv_need), the pool = budget - KV (then the caps)
    device quota     = uncapped budget + non_kv_reserve
    host tier, shared memory (integrated GPU or host): (host_available / ranks - quota) / 2
    host tier, discrete GPU:  min(device_total, host_available / ranks / 2, 0.8 * RLIMIT_MEMLOCK)

Worked example (integrated GB10-like device after writing a 60 GiB file; GiB, fraction 0.9, pool share 0):
CUDA free 30, total 120, MemAvailable 90, no cgroup limit -> usable = max(30, min(90, 120)) = 90,
budget = KV = 81, host tier = (90 - 81) / 2 = 4.5, torch fraction = (90 - 4.5) / 120 = 0.7125.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any

GiB = 1 << 30

#: cgroup v1 (and any cgroup) limits at or above this read as "unlimited" (v1 writes a page-size
#: dependent number close to 2^63 for "no limit").
CGROUP_UNLIMITED = 1 << 60
#: Share of what is left of host memory (per rank, after the device quotas) that the automatic host
#: tier takes; the other half stays for the OS, the tokenizer, Python and page cache. (Issue 5.)
HOST_TIER_SHARE = Fraction(1, 2)
#: Share of RLIMIT_MEMLOCK the automatic host tier of a discrete GPU may pin; the rest stays for other
#: pinned buffers of the process (staging copies, communication libraries). (Issue 5, example 3.)
MEMLOCK_SHARE = Fraction(4, 5)
#: Default share of the budget that goes to the adapter pool. See docs/memory.md ("Adapter pool share").
DEFAULT_ADAPTER_POOL_SHARE = 0.1
DEFAULT_FRACTION = 0.9
#: Below this much of an integrated GPU's shared memory left to the OS, the page cache and the process's CPU side
#: (its tokenizer, the adapter readers' scratch: 4 x 64 MiB and 64 MiB per registering thread, docs/memory.md), the
#: plan says so. At the default fraction about 5 % of the shared memory is left, so the note comes below ~20 GiB
#: available (Jetson-class boards), and near ``fraction`` 1 anywhere (a judgement, not a measured threshold).
SHARED_LEFT_NOTE_BYTES = 1 << 30

SNAPSHOT_SCHEMA = "multilora-memory-snapshot"
SNAPSHOT_SCHEMA_VERSION = 1
#: Largest byte count a snapshot may hold: the kernel and CUDA report unsigned 64-bit values, so a
#: larger one cannot have been measured (in raw text it is garbage, in a snapshot field an error).
MAX_MEASURED_BYTES = (1 << 64) - 1

# Binding sources (a size's ``*_source``). cgroup sources carry the cgroup path: "cgroup:/a/b".
CUDA_FREE = "cuda_free"
MEM_AVAILABLE = "mem_available"
MEM_FREE = "mem_free"
DEVICE_TOTAL = "device_total"
USER_CAP = "user_cap"
MEMLOCK = "memlock"
LIVE_STATE_MINIMUM = "live_state_minimum"
NON_KV_RESERVE = "non_kv_reserve"
DEVICE_QUOTA = "device_quota"
EXPLICIT = "explicit"
UNMEASURED = "unmeasured"
KV_NEED = "kv_need"  # the pool took what the KV cache can never use (``MemoryPlanOptions.kv_need_bytes``)
MAX_BATCH_SIZE = "max_batch_size"  # KV held to an engine's max_batch_size sequences (``max_kv_source``)


class MemoryPlanError(ValueError):
    """The requested live state (or an explicit host tier) does not fit this machine.

    ``needed_bytes`` is what was asked for, ``fits_bytes`` the most that fits, ``source`` what bound it.
    """

    def __init__(self, message: str, *, needed_bytes: int, fits_bytes: int, source: str) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.fits_bytes = fits_bytes
        self.source = source


class MemorySnapshotError(ValueError):
    """A memory snapshot that cannot be read: not JSON, another shape, or a field of the wrong type or range.

    The message reads ``memory snapshot FILE: FIELD: expected WHAT, got WHAT`` (no FILE when the snapshot
    did not come from a file, no FIELD when the whole document is wrong); the four parts are kept as
    ``file``, ``field`` (a path such as ``cgroup_v2[0].path``), ``expected`` and ``got``.
    """

    def __init__(self, field: str | None, expected: str, got: str, *, file: str | None = None) -> None:
        self.field, self.expected, self.got, self.file = field, expected, got, file
        where = "memory snapshot" + (f" {file}" if file else "")
        super().__init__(": ".join([where, *([field] if field else []), f"expected {expected}, got {got}"]))

    def located(self, *, file: str | None = None, within: str | None = None) -> MemorySnapshotError:
        """The same error for a field inside ``within`` (a field path) of a snapshot read from ``file``."""
        inner = self.field if within is None else (within if self.field is None else f"{within}.{self.field}")
        return MemorySnapshotError(inner, self.expected, self.got, file=file or self.file)


_MISSING = object()


def require_snapshot(value: object, where: str) -> "MemorySnapshot":
    """``value`` if it is a ``MemorySnapshot`` (whose fields were checked when it was made).

    Raises:
        MemorySnapshotError: it is something else (a dict, a path, ...); ``where`` names the argument.
    """
    if not isinstance(value, MemorySnapshot):
        raise MemorySnapshotError(
            where, "a MemorySnapshot (MemorySnapshot.from_dict(json.load(f)) reads a recorded one; "
                   "multilora memory --snapshot FILE replays a file)", describe(value))
    return value


def describe(value: object) -> str:
    """A short JSON-flavoured account of ``value`` for an error message, never the whole of a big one."""
    if value is _MISSING:
        return "nothing (the key is missing)"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        if value.bit_length() > 14_000:  # str() refuses more than 4,300 digits
            return "an integer of more than 4,000 digits"
        return repr(value) if abs(value) < 10**30 else f"an integer of {len(str(abs(value)))} digits"
    if isinstance(value, str):
        return f"the string {value[:60]!r}" + ("..." if len(value) > 60 else "")
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item(s)"
    if isinstance(value, dict):
        keys = ", ".join(repr(k)[:40] for k in list(value)[:6]) + (", ..." if len(value) > 6 else "")
        return f"an object with keys {keys}" if value else "an empty object"
    return repr(value) if isinstance(value, float) else f"a {type(value).__name__}"


def _check_measured(name: str, value: object, *, nullable: bool = True) -> None:
    """A snapshot's byte count: an int in [0, 2^64) (None too where ``nullable``)."""
    if value is None and nullable:
        return
    if type(value) is not int or not 0 <= value <= MAX_MEASURED_BYTES:
        null = " or null" if nullable else ""
        raise MemorySnapshotError(name, f"a non-negative integer byte count below 2^64{null}", describe(value))


def _check_text(name: str, value: object) -> None:
    """A snapshot's raw file text: a str of valid Unicode, or None."""
    if value is not None and not isinstance(value, str):
        raise MemorySnapshotError(name, "text or null", describe(value))
    try:
        (value or "").encode("utf-8")
    except UnicodeEncodeError:
        raise MemorySnapshotError(name, "text or null (valid Unicode)", "a string with a lone surrogate") from None


def _check_keys(d: dict, known: tuple[str, ...], where: str | None) -> None:
    """Unknown keys are refused (a misspelt one would otherwise be read as absent), naming the closest."""
    for key in d:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1) if isinstance(key, str) else []
            expected = f"a key of the schema (did you mean {close[0]!r}?)" if close else f"one of {', '.join(known)}"
            raise MemorySnapshotError(where, expected, f"the unknown key {key!r}")


# --------------------------------------------------------------------------------------------------
# Snapshot: the measured inputs, raw.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupLevel:
    """One cgroup of the process's chain, as raw file text (None = file missing or unreadable).

    cgroup v2: ``limit`` = memory.max, ``usage`` = memory.current, ``stat`` = memory.stat.
    cgroup v1: ``limit`` = memory.limit_in_bytes, ``usage`` = memory.usage_in_bytes, ``stat`` = memory.stat.
    ``path`` is the cgroup path as /proc/self/cgroup names it ("/" = the visible root).
    """

    path: str
    limit: str | None = None
    usage: str | None = None
    stat: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise MemorySnapshotError("path", "a string (the cgroup path)", describe(self.path))
        for name in ("path", "limit", "usage", "stat"):
            _check_text(name, getattr(self, name))


@dataclass(frozen=True)
class MemorySnapshot:
    """Everything memory accounting needs from one machine, for one device (see docs/memory.md).

    ``cgroup_v2`` and ``cgroup_v1`` list the process's cgroup and its ancestors, leaf first, root last.
    ``rlimit_memlock_bytes`` is the soft RLIMIT_MEMLOCK; None = unlimited or unknown.
    ``torch_reserved_bytes`` is what this process's caching allocator held when the snapshot was taken
    (it counts toward the PyTorch per-process cap but is no longer in ``cuda_free_bytes``).
    """

    has_gpu: bool
    is_integrated: bool = False
    cuda_free_bytes: int | None = None
    cuda_total_bytes: int | None = None
    torch_reserved_bytes: int = 0
    device_name: str | None = None
    meminfo_text: str | None = None
    cgroup_v2: tuple[CgroupLevel, ...] = ()
    cgroup_v1: tuple[CgroupLevel, ...] = ()
    rlimit_memlock_bytes: int | None = None

    def __post_init__(self) -> None:
        """Checks every field (MemorySnapshotError naming it); lists of levels become tuples."""
        for name in ("has_gpu", "is_integrated"):
            if not isinstance(getattr(self, name), bool):
                raise MemorySnapshotError(name, "true or false", describe(getattr(self, name)))
        for name in ("cuda_free_bytes", "cuda_total_bytes", "rlimit_memlock_bytes"):
            _check_measured(name, getattr(self, name))
        _check_measured("torch_reserved_bytes", self.torch_reserved_bytes, nullable=False)
        for name in ("cuda_free_bytes", "cuda_total_bytes"):
            if self.has_gpu and getattr(self, name) is None:
                raise MemorySnapshotError(name, "a byte count (has_gpu is true)", "null")
            if not self.has_gpu and getattr(self, name) is not None:  # a contradiction: which one to believe?
                raise MemorySnapshotError(name, "null (has_gpu is false)", describe(getattr(self, name)))
        if self.is_integrated and not self.has_gpu:
            raise MemorySnapshotError("is_integrated", "false (has_gpu is false: no GPU to share host memory)", "true")
        for name in ("device_name", "meminfo_text"):
            _check_text(name, getattr(self, name))
        for name in ("cgroup_v2", "cgroup_v1"):
            levels = getattr(self, name)
            if not isinstance(levels, (list, tuple)):
                raise MemorySnapshotError(name, "a list of cgroup levels, leaf first", describe(levels))
            for i, level in enumerate(levels):
                if not isinstance(level, CgroupLevel):
                    raise MemorySnapshotError(f"{name}[{i}]", "a CgroupLevel", describe(level))
            object.__setattr__(self, name, tuple(levels))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; the schema is documented in docs/memory.md."""
        d = asdict(self)
        d["cgroup_v2"] = [asdict(c) for c in self.cgroup_v2]
        d["cgroup_v1"] = [asdict(c) for c in self.cgroup_v1]
        return {"schema": SNAPSHOT_SCHEMA, "schema_version": SNAPSHOT_SCHEMA_VERSION, **d}

    @classmethod
    def from_dict(cls, d: Any, *, file: str | None = None) -> MemorySnapshot:
        """Inverse of ``to_dict`` (``file``: where ``d`` was read, for the messages).

        Required: ``schema``, ``schema_version`` (an integer this reader knows) and ``has_gpu``; the other
        keys take their defaults when absent (``cgroup_v2`` / ``cgroup_v1`` null or absent = none). Raises
        MemorySnapshotError for anything else: another schema or a newer version, an unknown key (a
        misspelt one would be read as absent), a value of the wrong type or beyond 2^64 bytes.
        """
        try:
            return cls(**_snapshot_kwargs(d))
        except MemorySnapshotError as e:
            raise e.located(file=file) from None

    @classmethod
    def from_json(cls, text: str | bytes, *, file: str | None = None) -> MemorySnapshot:
        """The snapshot in JSON ``text`` (strict JSON: no NaN, no key twice in one object); as ``from_dict``."""
        try:
            d = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        except MemorySnapshotError as e:
            raise e.located(file=file) from None
        except RecursionError:
            raise MemorySnapshotError(None, "a JSON object", "JSON nested too deeply to read", file=file) from None
        except ValueError as e:  # JSONDecodeError, or a number of more than 4,300 digits
            got = f"text that is not valid JSON ({str(e).split(';')[0]})"
            raise MemorySnapshotError(None, "a JSON object", got, file=file) from None
        return cls.from_dict(d, file=file)


_SNAPSHOT_KEYS = ("schema", "schema_version", *MemorySnapshot.__dataclass_fields__)
_LEVEL_KEYS = tuple(CgroupLevel.__dataclass_fields__)


def _snapshot_kwargs(d: Any) -> dict[str, Any]:
    """``MemorySnapshot`` keywords of a snapshot document; the values are checked by the dataclasses."""
    if not isinstance(d, dict):
        raise MemorySnapshotError(None, "a JSON object at the top level", describe(d))
    if d.get("schema", _MISSING) != SNAPSHOT_SCHEMA:
        hint = ' (this is `multilora memory --json` output: its "snapshot" member is the snapshot)' if "plan" in d else ""
        raise MemorySnapshotError("schema", repr(SNAPSHOT_SCHEMA), describe(d.get("schema", _MISSING)) + hint)
    version = d.get("schema_version", _MISSING)
    if type(version) is not int or not 1 <= version <= SNAPSHOT_SCHEMA_VERSION:
        known = "1" if SNAPSHOT_SCHEMA_VERSION == 1 else f"an integer from 1 to {SNAPSHOT_SCHEMA_VERSION}"
        raise MemorySnapshotError("schema_version", f"{known} (the versions this reader knows)", describe(version))
    _check_keys(d, _SNAPSHOT_KEYS, None)
    if "has_gpu" not in d:
        raise MemorySnapshotError("has_gpu", "true or false", describe(_MISSING))
    kwargs = {k: v for k, v in d.items() if k not in ("schema", "schema_version")}
    for name in ("cgroup_v2", "cgroup_v1"):
        kwargs[name] = _levels_from_json(name, d.get(name))
    return kwargs


def _levels_from_json(name: str, value: Any) -> tuple[CgroupLevel, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise MemorySnapshotError(name, "a list of cgroup levels (objects), leaf first", describe(value))
    levels = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise MemorySnapshotError(where, f"an object with keys {', '.join(_LEVEL_KEYS)}", describe(item))
        _check_keys(item, _LEVEL_KEYS, where)
        try:
            levels.append(CgroupLevel(**{"path": _MISSING, **item}))
        except MemorySnapshotError as e:
            raise e.located(within=where) from None
    return tuple(levels)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for key, value in pairs:
        if key in d:
            raise MemorySnapshotError(None, "each key once per object", f"a duplicate key {key!r}")
        d[key] = value
    return d


def _no_constant(name: str) -> None:
    raise MemorySnapshotError(None, "standard JSON numbers", f"{name}, which JSON does not have")


# --------------------------------------------------------------------------------------------------
# Options and plan.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlanOptions:
    """What the caller asks for. All byte counts are per local rank.

    - ``fraction`` (0, 1]: share of the hard budget given to pool + KV (TensorRT-LLM's free-memory fraction).
    - ``adapter_pool_share`` [0, 1]: share of the budget for the adapter pool; KV takes the rest.
    - ``non_kv_reserve_bytes``: activations, workspaces, and (before loading) the weights: what a
      profiling forward of the largest batch measured.
    - ``min_adapter_pool_bytes`` (one max-size adapter) + ``min_kv_bytes`` (KV for one max-length
      sequence) = the live-state minimum.
    - ``max_adapter_pool_bytes``, ``max_kv_bytes``, ``max_total_bytes``: caps (a user's, or for ``max_kv_bytes`` the
      caller's own bound: ``max_kv_source``); they only lower sizes.
    - ``kv_need_bytes``: the most KV bytes the caller can ever use (an engine: ``max_batch_size`` sequences of
      ``max_seq_len``), or None. Where KV's share of the budget is larger, KV gets this much and the adapter pool the
      rest of the budget (then ``max_adapter_pool_bytes`` applies): memory the KV cache could never fill holds
      adapters instead (source ``kv_need``). Unlike ``max_kv_bytes``, a cap whose remainder stays unallocated.
    - ``max_kv_source``: the source a binding ``max_kv_bytes`` gives the KV size: ``user_cap`` (default), or
      ``max_batch_size`` when the caller's cap is the most KV it can use rather than a user's choice (an engine
      without ``kv_cache_bytes``, or with a larger one: ``max_batch_size`` sequences of ``max_seq_len``).
    - ``host_tier_bytes``: explicit host-tier size (None = automatic); honoured, or MemoryPlanError
      where it would over-commit a shared memory pool (beside a discrete GPU, with a note where
      ``local_ranks x host_tier_bytes`` exceeds the host memory available: a cap filled as adapters arrive).
    - ``local_ranks``: processes on this host that share its memory (one per GPU on a discrete host;
      on an integrated GPU or without GPU they all share the one pool).
    """

    fraction: float = DEFAULT_FRACTION
    adapter_pool_share: float = DEFAULT_ADAPTER_POOL_SHARE
    non_kv_reserve_bytes: int = 0
    min_adapter_pool_bytes: int = 0
    min_kv_bytes: int = 0
    max_adapter_pool_bytes: int | None = None
    max_kv_bytes: int | None = None
    max_total_bytes: int | None = None
    host_tier_bytes: int | None = None
    local_ranks: int = 1
    kv_need_bytes: int | None = None
    max_kv_source: str = USER_CAP

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction: expected 0 < fraction <= 1, got {self.fraction}")
        if not 0.0 <= self.adapter_pool_share <= 1.0:
            raise ValueError(f"adapter_pool_share: expected a value in [0, 1], got {self.adapter_pool_share}")
        if self.max_kv_source not in (USER_CAP, MAX_BATCH_SIZE):
            raise ValueError(f"max_kv_source: expected {USER_CAP!r} or {MAX_BATCH_SIZE!r}, got {self.max_kv_source!r}")
        if not isinstance(self.local_ranks, int) or self.local_ranks < 1:
            raise ValueError(f"local_ranks: expected an integer >= 1, got {self.local_ranks!r}")
        for name in ("non_kv_reserve_bytes", "min_adapter_pool_bytes", "min_kv_bytes"):
            _check_bytes(name, getattr(self, name))
        for name in ("max_adapter_pool_bytes", "max_kv_bytes", "max_total_bytes", "host_tier_bytes", "kv_need_bytes"):
            if getattr(self, name) is not None:
                _check_bytes(name, getattr(self, name))

    @property
    def live_state_minimum_bytes(self) -> int:
        """One max-size adapter plus KV for one max-length sequence."""
        return self.min_adapter_pool_bytes + self.min_kv_bytes


def _check_bytes(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: expected a non-negative integer byte count, got {value!r}")


@dataclass(frozen=True)
class MemoryPlan:
    """The accounting result, per local rank. Every ``*_source`` names what bound that size.

    Invariants: adapter_pool_bytes + kv_bytes <= budget_bytes <= hard_budget_bytes <= usable_bytes
    <= device_total_bytes; on a shared-memory device local_ranks * (device_quota_bytes +
    host_tier_bytes) <= shared_pool_bytes.
    """

    kind: str  # "discrete" | "integrated" | "host"
    device_total_bytes: int
    usable_bytes: int
    usable_source: str
    hard_budget_bytes: int
    budget_bytes: int
    budget_source: str
    device_quota_bytes: int
    adapter_pool_bytes: int
    adapter_pool_source: str
    kv_bytes: int
    kv_source: str
    host_tier_bytes: int
    host_tier_source: str
    host_available_bytes: int | None
    shared_pool_bytes: int | None
    torch_memory_fraction: float | None
    snapshot: MemorySnapshot = field(repr=False)
    options: MemoryPlanOptions = field(repr=False)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the sizes and sources (inputs under "options"; the snapshot is separate)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("snapshot", "options")}
        d["notes"] = list(self.notes)
        d["options"] = asdict(self.options)
        return d

    def explain(self) -> str:
        """Human summary: each size in GiB and bytes, its binding source, then the inputs."""
        return "\n".join(_explain_lines(self))


# --------------------------------------------------------------------------------------------------
# Parsing raw text (garbage -> None / empty, never an exception).
# --------------------------------------------------------------------------------------------------

_MEMINFO_LINE = re.compile(r"^(\S+):\s+([0-9]{1,20})\s+kB\s*$")
_INT = re.compile(r"^[0-9]{1,20}$")  # ASCII digits, at most 2^64 - 1 (checked after int())


def _u64(digits: str) -> int | None:
    n = int(digits)  # at most 20 digits: never near Python's int-string limit
    return n if n <= MAX_MEASURED_BYTES else None


def parse_meminfo(text: str | None) -> dict[str, int]:
    """/proc/meminfo text -> {field: bytes} for its ``kB`` lines; {} for None or garbage.

    A value that does not fit in 64 bits is garbage (its line is skipped); a field listed twice keeps
    its smaller value (the fields read here, MemAvailable, MemFree and MemTotal, only bound sizes).
    """
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        m = _MEMINFO_LINE.match(line.strip())
        kb = _u64(m.group(2)) if m else None
        if kb is not None:
            out[m.group(1)] = min(out.get(m.group(1), kb * 1024), kb * 1024)
    return out


def parse_int(text: str | None) -> int | None:
    """A file holding one non-negative integer below 2^64 -> that integer; None if missing or malformed."""
    s = (text or "").strip()
    return _u64(s) if _INT.match(s) else None


def _stat_values(text: str | None) -> dict[str, list[int]]:
    """memory.stat text (``key value`` lines) -> {key: every value it is given}; malformed lines skipped."""
    out: dict[str, list[int]] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        value = parse_int(parts[1]) if len(parts) == 2 else None
        if value is not None:
            out.setdefault(parts[0], []).append(value)
    return out


def parse_stat(text: str | None) -> dict[str, int]:
    """memory.stat text (``key value`` lines) -> dict; malformed lines are skipped, a key given twice
    keeps its smaller value."""
    return {key: min(values) for key, values in _stat_values(text).items()}


def reclaimable_file_bytes(stat_text: str | None) -> int:
    """active_file + inactive_file - file_dirty - file_writeback from memory.stat (v2 or v1 names).

    Dirty, writeback, unevictable and shmem pages never count. Any field missing -> 0 (no credit). A
    key given twice counts at its least favourable value (the smaller active / inactive, the larger
    dirty / writeback), so a duplicate never raises the figure.
    """
    stat = _stat_values(stat_text)
    for keys in (
        ("active_file", "inactive_file", "file_dirty", "file_writeback"),  # cgroup v2
        ("total_active_file", "total_inactive_file", "total_dirty", "total_writeback"),  # v1, hierarchical
        ("active_file", "inactive_file", "dirty", "writeback"),  # v1, this cgroup only
    ):
        if all(k in stat for k in keys):
            active, inactive = (min(stat[k]) for k in keys[:2])
            dirty, writeback = (max(stat[k]) for k in keys[2:])
            return max(0, active + inactive - dirty - writeback)
    return 0


# --------------------------------------------------------------------------------------------------
# Bounds: a value with the source that set it; None value = no bound.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    value: int
    source: str


def tightest(*bounds: Bound | None) -> Bound | None:
    """The smallest of the given bounds (None entries are "no bound"); ties go to the first listed."""
    present = [b for b in bounds if b is not None]
    return min(present, key=lambda b: b.value) if present else None


def level_headroom(level: CgroupLevel, prefix: str) -> Bound | None:
    """Headroom of one cgroup: limit - usage + reclaimable file pages, clamped to [0, limit].

    No limit file, ``max``, or a limit >= 2^60 -> None (unlimited). A malformed limit, or a finite
    limit whose usage cannot be read -> 0 (no headroom, not the whole limit).
    """
    source = f"{prefix}:{level.path}"
    if level.limit is None or level.limit.strip() == "max":
        return None
    limit = parse_int(level.limit)
    if limit is not None and limit >= CGROUP_UNLIMITED:
        return None
    usage = parse_int(level.usage)
    if limit is None or usage is None:
        return Bound(0, source)
    reclaimable = min(reclaimable_file_bytes(level.stat), usage)
    return Bound(max(0, min(limit, limit - usage + reclaimable)), source)


def _cgroup_levels(snapshot: MemorySnapshot) -> list[tuple[str, CgroupLevel]]:
    """(source prefix, level) of every cgroup of the snapshot, v2 then v1, leaf first."""
    return [("cgroup", lv) for lv in snapshot.cgroup_v2] + [("cgroup_v1", lv) for lv in snapshot.cgroup_v1]


def cgroup_notes(snapshot: MemorySnapshot) -> tuple[str, ...]:
    """Why a cgroup gives zero headroom without being full: a malformed limit, or unreadable usage."""
    notes = []
    for prefix, lv in _cgroup_levels(snapshot):
        room = level_headroom(lv, prefix)
        if room is not None and (parse_int(lv.limit) is None or parse_int(lv.usage) is None):
            what = "memory limit is not a number" if parse_int(lv.limit) is None else "usage cannot be read"
            notes.append(f"{prefix}:{lv.path}: its {what}: no headroom is assumed there")
    return tuple(notes)


def cgroup_headroom(snapshot: MemorySnapshot) -> Bound | None:
    """The minimum headroom over the process's cgroups and their ancestors (v2 and v1); None = no limit."""
    return tightest(*(level_headroom(lv, prefix) for prefix, lv in _cgroup_levels(snapshot)))


# --------------------------------------------------------------------------------------------------
# The device view: device-wide usable memory and host memory available to a host tier.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _DeviceView:
    kind: str
    total: int
    usable: Bound  # per local rank
    host_available: Bound | None  # host-wide; None = not measured
    shared_pool: int | None  # device-wide estimate on shared-memory devices
    notes: tuple[str, ...]


def _mem_available(snapshot: MemorySnapshot, total: Bound | None) -> Bound | None:
    """min(MemAvailable, total); None when MemAvailable cannot be read."""
    mem_available = parse_meminfo(snapshot.meminfo_text).get("MemAvailable")
    return None if mem_available is None else tightest(Bound(mem_available, MEM_AVAILABLE), total)


def _host_available(snapshot: MemorySnapshot, total: Bound | None) -> Bound | None:
    """min(MemAvailable, total, cgroup headroom); None when MemAvailable cannot be read."""
    mem = _mem_available(snapshot, total)
    return None if mem is None else tightest(mem, cgroup_headroom(snapshot))


def _discrete_view(s: MemorySnapshot, ranks: int) -> _DeviceView:
    """One GPU per rank; its own free memory is the only source (ranks share only the host tier)."""
    total = s.cuda_total_bytes
    usable = Bound(min(s.cuda_free_bytes, total), CUDA_FREE)
    host = _host_available(s, None)
    notes = () if host else ("/proc/meminfo has no MemAvailable: no automatic host tier",)
    return _DeviceView("discrete", total, usable, host, None, notes)


def _integrated_view(s: MemorySnapshot, ranks: int) -> _DeviceView:
    """min(max(CUDA free, min(MemAvailable, device total)), cgroup headroom), per rank.

    CUDA free is the floor against MemAvailable and the fallback when MemAvailable cannot be read; a
    finite cgroup headroom is applied last, so a larger CUDA-free reading cannot override it (the final
    rule of TensorRT-LLM's integrated-GPU change: inside a container the cgroup limit is what the kernel
    enforces). See docs/memory.md, "Usable memory".
    """
    total = s.cuda_total_bytes
    cuda_free = Bound(min(s.cuda_free_bytes, total), CUDA_FREE)
    mem = _mem_available(s, Bound(total, DEVICE_TOTAL))
    notes = () if mem else ("/proc/meminfo has no MemAvailable: CUDA free is the fallback, no automatic host tier",)
    estimate = cuda_free if mem is None or mem.value <= cuda_free.value else mem
    cgroup = cgroup_headroom(s)
    pool = tightest(estimate, cgroup)
    host = None if mem is None else tightest(mem, cgroup)
    usable = Bound(pool.value // ranks, pool.source)
    return _DeviceView("integrated", total, usable, host, pool.value, notes)


def _host_view(s: MemorySnapshot, ranks: int) -> _DeviceView:
    info = parse_meminfo(s.meminfo_text)
    mem_total = info.get("MemTotal")
    total = Bound(mem_total, DEVICE_TOTAL) if mem_total is not None else None
    notes: tuple[str, ...] = ()
    host = _host_available(s, total)
    if host is None and "MemFree" in info:  # kernels before 3.14 have no MemAvailable
        host = tightest(Bound(info["MemFree"], MEM_FREE), total, cgroup_headroom(s))
        notes = ("/proc/meminfo has no MemAvailable: planning from MemFree",)
    if host is None:
        host = Bound(0, UNMEASURED)
        notes = ("/proc/meminfo unreadable: host memory could not be measured",)
    device_total = mem_total if mem_total is not None else host.value
    usable = Bound(host.value // ranks, host.source)
    return _DeviceView("host", device_total, usable, host, host.value, notes)


def device_view(snapshot: MemorySnapshot, local_ranks: int = 1) -> _DeviceView:
    """Per-rank usable memory of the snapshot's device, and the host memory a host tier may use."""
    if not snapshot.has_gpu:
        return _host_view(snapshot, local_ranks)
    if snapshot.is_integrated:
        return _integrated_view(snapshot, local_ranks)
    return _discrete_view(snapshot, local_ranks)


# --------------------------------------------------------------------------------------------------
# The plan.
# --------------------------------------------------------------------------------------------------


def _scale(value: int, share: float | Fraction) -> int:
    """floor(value * share), exact for decimal shares (0.9 is 9/10, not 0.900000000000000022...)."""
    return math.floor(value * (share if isinstance(share, Fraction) else Fraction(str(share))))


def _cap(size: Bound, cap: int | None, source: str = USER_CAP) -> Bound:
    return size if cap is None or cap >= size.value else Bound(cap, source)


def _gib_number(n: int) -> str:
    """``n`` bytes in GiB with two decimals, exact for any integer (a float would overflow near 1e308)."""
    hundredths = round(Fraction(abs(n) * 100, GiB))  # round half to even, as float formatting does
    return f"{'-' if n < 0 else ''}{hundredths // 100}.{hundredths % 100:02d}"


def _gib(n: int) -> str:
    return f"{_gib_number(n)} GiB"


def _budget(view: _DeviceView, o: MemoryPlanOptions) -> tuple[int, Bound, Bound]:
    """(hard budget, uncapped budget, budget after the total cap). Raises if the live state cannot fit."""
    hard = view.usable.value - o.non_kv_reserve_bytes
    need = o.live_state_minimum_bytes
    if hard < 0:  # (the reserve alone does not fit: say so, rather than "0 B does not fit in at most 0 B")
        raise MemoryPlanError(
            f"the non-KV reserve {_gib(o.non_kv_reserve_bytes)} ({o.non_kv_reserve_bytes} B, non_kv_reserve_bytes) does "
            f"not fit: it leaves nothing of the usable memory {_gib(view.usable.value)} ({view.usable.value} B, bound "
            f"by {view.usable.source}) for the adapter pool and the KV cache: it is "
            f"{o.non_kv_reserve_bytes - view.usable.value} B too large",
            needed_bytes=need,
            fits_bytes=0,
            source=view.usable.source,
        )
    if need > hard:
        fits = max(0, hard)
        raise MemoryPlanError(
            f"live-state minimum {_gib(need)} ({need} B: one max-size adapter {o.min_adapter_pool_bytes} B + KV "
            f"for one max-length sequence {o.min_kv_bytes} B) does not fit: at most {_gib(fits)} ({fits} B) fits "
            f"= usable {view.usable.value} B (bound by {view.usable.source}) "
            f"- non-KV reserve {o.non_kv_reserve_bytes} B",
            needed_bytes=need,
            fits_bytes=fits,
            source=view.usable.source,
        )
    fractioned = _scale(hard, o.fraction)
    uncapped = Bound(fractioned, view.usable.source) if fractioned >= need else Bound(need, LIVE_STATE_MINIMUM)
    capped = _cap(uncapped, o.max_total_bytes)
    if capped.value < need:
        raise MemoryPlanError(
            f"live-state minimum {_gib(need)} ({need} B) does not fit under the user's total cap "
            f"{capped.value} B (max_total_bytes; multilora memory --total-bytes): raise it to at least {need} B "
            f"or lower the minimum (min_adapter_pool_bytes + min_kv_bytes)",
            needed_bytes=need,
            fits_bytes=capped.value,
            source=USER_CAP,
        )
    return hard, uncapped, capped


#: The two parts of the live state: (name, cap option and flag, minimum option and flag, what the minimum
#: is and how the engine computes it; runtime/sizing.py, docs/memory.md "The KV cache in blocks").
_LIVE_PARTS = (
    ("adapter pool", "max_adapter_pool_bytes; multilora memory --adapter-pool-bytes",
     "min_adapter_pool_bytes; --min-adapter-bytes",
     "one max-size adapter; the engine's is the largest adapter max_lora_rank allows, max_lora_rank on every "
     "target module of every layer: layers x sum over the target modules of ceil(max_lora_rank x (d_in + d_out) "
     "/ 64) pages x page bytes (64 elements x dtype bytes)"),
    ("KV", "max_kv_bytes; multilora memory --kv-bytes", "min_kv_bytes; --min-kv-bytes",
     "KV for one max-length sequence; the engine's is (ceil(max_seq_len / kv_block_size) + 1) x block bytes, "
     "the null block included"),
)


def _split(budget: Bound, o: MemoryPlanOptions) -> tuple[Bound, Bound]:
    """Adapter pool = share of the budget, held to [one adapter, budget - one sequence's KV]; KV = rest. With
    ``kv_need_bytes``, KV is at most that and the pool also takes what KV leaves of the rest (up to its own cap)."""
    share = _scale(budget.value, o.adapter_pool_share)
    lo, hi = o.min_adapter_pool_bytes, budget.value - o.min_kv_bytes
    pool = Bound(min(max(share, lo), hi), budget.source if lo <= share <= hi else LIVE_STATE_MINIMUM)
    kv = Bound(budget.value - pool.value, budget.source)
    if o.kv_need_bytes is not None and kv.value > max(o.kv_need_bytes, o.min_kv_bytes):
        need = max(o.kv_need_bytes, o.min_kv_bytes)  # (the live state's KV stays, whatever the caller needs)
        pool = Bound(pool.value + kv.value - need, KV_NEED)
        kv = Bound(need, KV_NEED)
    pool, kv = _cap(pool, o.max_adapter_pool_bytes), _cap(kv, o.max_kv_bytes, o.max_kv_source)
    for (name, cap, minimum, what), size, need in zip(_LIVE_PARTS, (pool, kv), (lo, o.min_kv_bytes)):
        if size.value < need:
            raise MemoryPlanError(
                f"the user's {name} cap {size.value} B ({cap}) is below the live-state minimum for it, {need} B "
                f"({minimum}: {what}): raise the cap to at least {need} B or lower the minimum",
                needed_bytes=need,
                fits_bytes=size.value,
                source=USER_CAP,
            )
    return pool, kv


def _shared_host_tier(view: _DeviceView, quota: int, o: MemoryPlanOptions) -> Bound:
    """Automatic host tier on a shared-memory device: half of what the device quotas of every local
    rank leave of the measured host memory, per rank. Unmeasured host memory gives 0."""
    host = view.host_available
    if host is None:
        return Bound(0, UNMEASURED)
    per_rank = host.value // o.local_ranks
    if per_rank <= quota:
        return Bound(0, DEVICE_QUOTA)
    return Bound(_scale(per_rank - quota, HOST_TIER_SHARE), host.source)


def _discrete_host_tier(view: _DeviceView, snapshot: MemorySnapshot, o: MemoryPlanOptions) -> Bound:
    """Automatic host tier beside a discrete GPU: min(device total, half the host memory available per
    rank, 0.8 x RLIMIT_MEMLOCK). Unmeasured host memory gives 0."""
    host = view.host_available
    if host is None:
        return Bound(0, UNMEASURED)
    half = Bound(_scale(host.value // o.local_ranks, HOST_TIER_SHARE), host.source)
    memlock = snapshot.rlimit_memlock_bytes
    locked = None if memlock is None else Bound(_scale(memlock, MEMLOCK_SHARE), MEMLOCK)
    return tightest(Bound(view.total, DEVICE_TOTAL), half, locked)  # type: ignore[return-value]


def _explicit_host_tier(view: _DeviceView, quota: int, o: MemoryPlanOptions) -> Bound:
    """Honour an explicit host tier, or raise where it over-commits a shared memory pool."""
    want, ranks = o.host_tier_bytes, o.local_ranks
    assert want is not None
    if view.shared_pool is not None and ranks * (quota + want) > view.shared_pool:
        fits = max(0, view.shared_pool // ranks - quota)
        raise MemoryPlanError(
            f"explicit host tier (host_adapter_bytes) {_gib(want)} ({want} B) over-commits the shared memory pool: "
            f"{ranks} rank(s) x (device quota {quota} B + host tier {want} B) = {ranks * (quota + want)} B "
            f"> {view.shared_pool} B ({view.usable.source}); at most {fits} B fits per rank",
            needed_bytes=want,
            fits_bytes=fits,
            source=view.usable.source,
        )
    return Bound(want, EXPLICIT)


def _host_available_notes(view: _DeviceView, o: MemoryPlanOptions) -> tuple[str, ...]:
    """A warning for an explicit host tier beside a discrete GPU past the host memory available (MemAvailable within
    the cgroups' headroom) over the local ranks: honoured, as the cap it is (the arena maps chunks only as adapters
    arrive), but filling it would exhaust the host's or the container's memory."""
    want, host = o.host_tier_bytes, view.host_available
    if want is None or view.shared_pool is not None or host is None or o.local_ranks * want <= host.value:
        return ()
    return (f"explicit host tier (host_adapter_bytes) {want} B x {o.local_ranks} rank(s) exceeds the host memory "
            f"available ({host.value} B, {host.source}): honoured as a cap, since the host arena maps its pinned "
            f"chunks only as adapters arrive, but filled past {host.value // o.local_ranks} B per rank it would run "
            "the host (or the container) out of memory",)


def _memlock_notes(view: _DeviceView, snapshot: MemorySnapshot, tier: Bound) -> tuple[str, ...]:
    """A warning for a host tier past RLIMIT_MEMLOCK on a GPU (the host arena registers its chunks with CUDA, on an
    integrated GPU too; whether the driver charges that to the limit varies): an explicit tier, or an integrated
    GPU's automatic one (a discrete GPU's automatic tier is bounded by 0.8 x the limit instead, and says so)."""
    memlock = snapshot.rlimit_memlock_bytes
    if view.kind == "host" or memlock is None or tier.value <= memlock:
        return ()
    what = "explicit host tier" if tier.source == EXPLICIT else "host tier"
    return (f"{what} {tier.value} B exceeds RLIMIT_MEMLOCK ({memlock} B): pinning it (cudaHostRegister) may fail "
            "where the driver charges it to the limit; raise it (ulimit -l) if the engine warns that a host-arena "
            "chunk could not be pinned",)


def _torch_fraction(view: _DeviceView, snapshot: MemorySnapshot, host_tier: int) -> float | None:
    """Cap of the PyTorch caching allocator, from the same estimate: what this process already holds
    plus its usable memory (minus the host tier where host and device share one pool), / device total."""
    if view.kind == "host" or view.total <= 0:
        return None
    own = snapshot.torch_reserved_bytes + view.usable.value
    if view.kind == "integrated":
        own -= host_tier
    return min(1.0, math.floor(max(0, own) / view.total * 1e6) / 1e6)


def compute_memory_plan(snapshot: MemorySnapshot, options: MemoryPlanOptions | None = None) -> MemoryPlan:
    """The memory plan of ``snapshot`` under ``options`` (see the module docstring and docs/memory.md).

    Raises MemoryPlanError when the live-state minimum does not fit (saying what fits and what bound
    it), or when an explicit host tier would over-commit a shared memory pool.
    """
    o = options or MemoryPlanOptions()
    view = device_view(snapshot, o.local_ranks)
    hard, uncapped, budget = _budget(view, o)
    pool, kv = _split(budget, o)
    quota = uncapped.value + o.non_kv_reserve_bytes
    notes = view.notes + cgroup_notes(snapshot)
    if o.host_tier_bytes is not None:
        host = _explicit_host_tier(view, quota, o)
        notes += _host_available_notes(view, o) + _memlock_notes(view, snapshot, host)
    elif view.kind == "discrete":
        host = _discrete_host_tier(view, snapshot, o)
        if host.source == MEMLOCK:
            notes += (f"the automatic host tier is bound by 0.8 x RLIMIT_MEMLOCK ({snapshot.rlimit_memlock_bytes} B): "
                      f"{host.value} B holds {'no' if host.value < 84_000_000 else 'few'} adapters of Llama-3-8B's "
                      "size (a rank-16 one on every module is 84 MB); raise the limit "
                      "(ulimit -l) or give the host tier explicitly (host_adapter_bytes, --host-adapter-bytes: "
                      "honoured beyond it)",)
    else:
        host = _shared_host_tier(view, quota, o)
        notes += _memlock_notes(view, snapshot, host)
    if view.kind == "integrated" and view.host_available is not None:  # (a CPU engine allocates to its bounds)
        left = view.shared_pool - o.local_ranks * (quota + host.value)
        if left < SHARED_LEFT_NOTE_BYTES:
            notes += (f"the plan leaves {max(0, left)} B ({_gib(max(0, left))}) of the shared memory to the OS, the "
                      f"page cache and this process's CPU side (its tokenizer, the adapter readers' scratch of 4 x 64 "
                      f"MiB and more): lower the fraction ({o.fraction}) or the host tier if the machine swaps or "
                      "the OOM killer strikes",)
    return MemoryPlan(
        kind=view.kind,
        device_total_bytes=view.total,
        usable_bytes=view.usable.value,
        usable_source=view.usable.source,
        hard_budget_bytes=hard,
        budget_bytes=budget.value,
        budget_source=budget.source,
        device_quota_bytes=quota,
        adapter_pool_bytes=pool.value,
        adapter_pool_source=pool.source,
        kv_bytes=kv.value,
        kv_source=kv.source,
        host_tier_bytes=host.value,
        host_tier_source=host.source,
        host_available_bytes=view.host_available.value if view.host_available else None,
        shared_pool_bytes=view.shared_pool,
        torch_memory_fraction=_torch_fraction(view, snapshot, host.value),
        snapshot=snapshot,
        options=o,
        notes=notes,
    )


# --------------------------------------------------------------------------------------------------
# explain()
# --------------------------------------------------------------------------------------------------

_KIND_TEXT = {
    "discrete": "discrete GPU",
    "integrated": "integrated GPU (memory shared with the CPU)",
    "host": "no GPU: the host is the device",
}


def _size_line(name: str, n: int, source: str = "") -> str:
    bound = f"  bound by {source}" if source else ""
    return f"  {name:<22}{_gib_number(n):>10} GiB {n:>18,d} B{bound}"


def _shown(text: str | None, absent: str) -> str:
    """Raw file text as the summary shows it: a byte count as ``9,663,676,416 B``, other text itself when short and
    printable ("max"), else a cut repr."""
    t = absent if text is None else text.strip()
    if t.isascii() and t.isdigit() and len(t) <= 40:
        return f"{int(t):,d} B"
    return t if len(t) <= 40 and t.isprintable() else repr(t[:40]) + ("..." if len(t) > 40 else "")


def _input_lines(s: MemorySnapshot) -> list[str]:
    lines = []
    if s.has_gpu:
        lines.append(_size_line("CUDA free", s.cuda_free_bytes or 0))
        lines.append(_size_line("CUDA total", s.cuda_total_bytes or 0))
        lines.append(_size_line("torch reserved", s.torch_reserved_bytes))
    info = parse_meminfo(s.meminfo_text)
    if not info:
        lines.append("  /proc/meminfo          unreadable")
    for key in ("MemTotal", "MemFree", "MemAvailable", "Cached", "Shmem", "Dirty", "Writeback"):
        if key in info:
            lines.append(_size_line(key, info[key]))
    for prefix, lv in _cgroup_levels(s):
        room = level_headroom(lv, prefix)
        room_text = "unlimited" if room is None else f"headroom {room.value:,d} B"
        lines.append(
            f"  {prefix}:{lv.path}  limit {_shown(lv.limit, '(none)')}, usage {_shown(lv.usage, '?')}, "
            f"reclaimable {reclaimable_file_bytes(lv.stat):,d} B -> {room_text}"
        )
    memlock = "unlimited" if s.rlimit_memlock_bytes is None else f"{s.rlimit_memlock_bytes:,d} B"
    lines.append(f"  RLIMIT_MEMLOCK         {memlock}")
    return lines


def _option_lines(o: MemoryPlanOptions) -> list[str]:
    caps = {k: getattr(o, k) for k in ("max_adapter_pool_bytes", "max_kv_bytes", "max_total_bytes", "host_tier_bytes")}
    why = {"max_kv_bytes": f" ({o.max_kv_source})"} if o.max_kv_source != USER_CAP else {}
    cap_text = ", ".join(f"{k}={v:,d}{why.get(k, '')}" for k, v in caps.items() if v is not None) or "none"
    return [
        f"  fraction {o.fraction}, adapter pool share {o.adapter_pool_share}, local ranks {o.local_ranks}",
        f"  non-KV reserve {o.non_kv_reserve_bytes:,d} B, live-state minimum {o.live_state_minimum_bytes:,d} B "
        f"(adapter {o.min_adapter_pool_bytes:,d} B + KV {o.min_kv_bytes:,d} B)",
        f"  caps / explicit sizes: {cap_text}",
    ] + ([f"  KV need {o.kv_need_bytes:,d} B (what the KV share leaves above it goes to the adapter pool)"]
         if o.kv_need_bytes is not None else [])


def _explain_lines(p: MemoryPlan) -> list[str]:
    name = f" {p.snapshot.device_name!r}" if p.snapshot.device_name else ""
    lines = [f"memory plan: {_KIND_TEXT[p.kind]}{name}, per local rank ({p.options.local_ranks})"]
    lines.append(_size_line("adapter pool", p.adapter_pool_bytes, p.adapter_pool_source))
    lines.append(_size_line("KV cache", p.kv_bytes, p.kv_source))
    lines.append(_size_line("host tier", p.host_tier_bytes, p.host_tier_source))
    lines.append(_size_line("budget (>= pool + KV)", p.budget_bytes, p.budget_source))
    lines.append(_size_line("hard budget", p.hard_budget_bytes))
    lines.append(_size_line("device quota", p.device_quota_bytes))
    lines.append(_size_line("usable", p.usable_bytes, p.usable_source))
    lines.append(_size_line("device total", p.device_total_bytes))
    if p.host_available_bytes is not None:
        lines.append(_size_line("host available", p.host_available_bytes))
    frac = "not applicable (no GPU)" if p.torch_memory_fraction is None else f"{p.torch_memory_fraction:.6f}"
    lines.append(f"  torch memory fraction  {frac}")
    lines += ["inputs:", *_input_lines(p.snapshot), "options:", *_option_lines(p.options)]
    lines += [f"note: {n}" for n in p.notes]
    return lines
