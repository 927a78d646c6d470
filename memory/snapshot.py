"""Thin readers that gather a ``MemorySnapshot`` on the running machine, and the engine's entry points.

Every file reader takes ``root`` (default "/"), the directory that stands for the filesystem root, so
tests point it at fixture trees. A missing or unreadable file becomes None; its text is kept raw
(garbage included) and the pure core in ``multilora.memory.accounting`` decides what it means.

Engine use (``max_adapter_bytes`` = bytes of one max-size adapter in the pool; ``kv_bytes_per_token``
= K and V bytes of one token over all layers)::

    model = load_weights(...)                        # weights resident on `device`
    plan = plan_for_engine(device=device, kv_bytes_per_token=kv_tok, max_seq_len=max_len,
                           max_adapter_bytes=max_adapter, weights_bytes_loaded=True)
    apply_torch_memory_fraction(plan, device)        # before any profiling run
    reserve = profile_largest_batch(model)           # peak allocated - allocated before, in bytes
    torch.cuda.empty_cache()                         # so cached activations read as free again
    plan = plan_for_engine(..., weights_bytes_loaded=True, non_kv_reserve_bytes=reserve)
    apply_torch_memory_fraction(plan, device)
    log.info(plan.explain()); size the pool / KV / host tier from plan.adapter_pool_bytes, ...

Before loading (to refuse early a model that cannot fit), call ``plan_for_engine(...,
weights_bytes_loaded=False, weights_bytes=N)``: the N bytes the weights will take are then counted
in the non-KV reserve, since the snapshot has not seen them yet.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch

from multilora.memory.accounting import (
    DEFAULT_ADAPTER_POOL_SHARE,
    DEFAULT_FRACTION,
    CgroupLevel,
    MemoryPlan,
    MemoryPlanOptions,
    MemorySnapshot,
    compute_memory_plan,
    parse_int,
)


def _read(path: Path) -> str | None:
    """Text of a file; None if it is missing, unreadable or not text."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _under(root: str | os.PathLike, absolute: str) -> Path:
    return Path(root) / absolute.lstrip("/")


def read_meminfo(root: str | os.PathLike = "/") -> str | None:
    """Raw /proc/meminfo."""
    return _read(_under(root, "/proc/meminfo"))


def read_proc_cgroups(root: str | os.PathLike = "/") -> tuple[str | None, str | None]:
    """(cgroup v2 path, cgroup v1 memory-controller path) from /proc/self/cgroup; None where absent.

    v2 is the line ``0::/path``; v1 the line ``N:...memory...:/path``.
    """
    v2 = v1 = None
    for line in (_read(_under(root, "/proc/self/cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def find_cgroup_mounts(root: str | os.PathLike = "/") -> dict[str, tuple[str, str]]:
    """{"v2" | "v1": (mount point, mounted cgroup root)} from /proc/self/mountinfo.

    Falls back to the usual places (/sys/fs/cgroup, /sys/fs/cgroup/memory) when mountinfo is unreadable.
    """
    text = _read(_under(root, "/proc/self/mountinfo"))
    if text is None:
        return {"v2": ("/sys/fs/cgroup", "/"), "v1": ("/sys/fs/cgroup/memory", "/")}
    mounts: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            mounts.setdefault("v2", (fields[4], fields[3]))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            mounts.setdefault("v1", (fields[4], fields[3]))
    return mounts


def _chain(cgroup_path: str, mount_root: str) -> list[tuple[str, str]]:
    """[(cgroup path, path relative to the mount)] from the leaf up to the mount's root."""
    rel = cgroup_path
    if mount_root != "/" and (rel == mount_root or rel.startswith(mount_root.rstrip("/") + "/")):
        rel = rel[len(mount_root.rstrip("/")) :] or "/"
    parts = [p for p in rel.split("/") if p]
    out = []
    for n in range(len(parts), -1, -1):
        rel_n = "/" + "/".join(parts[:n])
        full = rel_n if mount_root == "/" else mount_root.rstrip("/") + (rel_n if n else "")
        out.append((full, rel_n))
    return out


def read_cgroup_levels(
    cgroup_path: str, mount: tuple[str, str], names: tuple[str, str, str], root: str | os.PathLike = "/"
) -> tuple[CgroupLevel, ...]:
    """Read (limit, usage, stat) files ``names`` for the cgroup and each ancestor, leaf first."""
    mount_point, mount_root = mount
    levels = []
    for full, rel in _chain(cgroup_path, mount_root):
        d = _under(root, mount_point) / rel.lstrip("/")
        limit, usage, stat = (_read(d / n) for n in names)
        levels.append(CgroupLevel(path=full, limit=limit, usage=usage, stat=stat))
    return tuple(levels)


V2_FILES = ("memory.max", "memory.current", "memory.stat")
V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat")


def read_cgroups(root: str | os.PathLike = "/") -> tuple[tuple[CgroupLevel, ...], tuple[CgroupLevel, ...]]:
    """(cgroup v2 levels, cgroup v1 memory levels) of this process, leaf first; () where absent."""
    v2_path, v1_path = read_proc_cgroups(root)
    mounts = find_cgroup_mounts(root)
    v2 = read_cgroup_levels(v2_path, mounts["v2"], V2_FILES, root) if v2_path and "v2" in mounts else ()
    v1 = read_cgroup_levels(v1_path, mounts["v1"], V1_FILES, root) if v1_path and "v1" in mounts else ()
    return v2, v1


def read_rlimit_memlock(root: str | os.PathLike = "/") -> int | None:
    """Soft RLIMIT_MEMLOCK in bytes from /proc/self/limits; None = unlimited or unknown.

    With root "/" and no readable /proc/self/limits, asks ``resource.getrlimit`` instead.
    """
    text = _read(_under(root, "/proc/self/limits"))
    if text is None:
        if Path(root) != Path("/"):
            return None
        soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
        return None if soft == resource.RLIM_INFINITY else soft
    for line in text.splitlines():
        if line.startswith("Max locked memory"):
            fields = line[len("Max locked memory") :].split()
            return parse_int(fields[0]) if fields else None  # "unlimited" or garbage -> None
    return None


def read_cuda(device: torch.device) -> dict:
    """CUDA free/total bytes, is_integrated, name and this process's reserved bytes for ``device``."""
    free, total = torch.cuda.mem_get_info(device)
    props = torch.cuda.get_device_properties(device)
    return {
        "cuda_free_bytes": int(free),
        "cuda_total_bytes": int(total),
        "is_integrated": bool(getattr(props, "is_integrated", False)),
        "device_name": props.name,
        "torch_reserved_bytes": int(torch.cuda.memory_reserved(device)),
    }


def _as_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


def take_snapshot(device: torch.device | str | int | None = None, *, root: str | os.PathLike = "/") -> MemorySnapshot:
    """Measure this machine for ``device`` (None: cuda:0 when CUDA exists, else the CPU)."""
    dev = _as_device(device)
    cuda = read_cuda(dev) if dev.type == "cuda" else {}
    v2, v1 = read_cgroups(root)
    return MemorySnapshot(
        has_gpu=dev.type == "cuda",
        meminfo_text=read_meminfo(root),
        cgroup_v2=v2,
        cgroup_v1=v1,
        rlimit_memlock_bytes=read_rlimit_memlock(root),
        **cuda,
    )


def plan_for_engine(
    *,
    device: torch.device | str | int | None,
    kv_bytes_per_token: int,
    max_seq_len: int,
    max_adapter_bytes: int,
    weights_bytes_loaded: bool,
    weights_bytes: int = 0,
    non_kv_reserve_bytes: int = 0,
    max_adapter_pool_bytes: int | None = None,
    max_kv_bytes: int | None = None,
    max_total_bytes: int | None = None,
    host_tier_bytes: int | None = None,
    fraction: float = DEFAULT_FRACTION,
    adapter_pool_share: float = DEFAULT_ADAPTER_POOL_SHARE,
    local_ranks: int = 1,
    snapshot: MemorySnapshot | None = None,
) -> MemoryPlan:
    """Snapshot this machine (or use ``snapshot``) and compute the engine's memory plan.

    Live-state minimum = ``max_adapter_bytes`` (adapter pool) + ``kv_bytes_per_token * max_seq_len``
    (KV). ``weights_bytes_loaded``: True when the model weights are already resident, so the snapshot
    has seen them; False to plan ahead of loading, in which case ``weights_bytes`` is added to the
    non-KV reserve. Raises MemoryPlanError when the live state does not fit (see the module docstring
    for the call sequence).
    """
    if weights_bytes < 0 or kv_bytes_per_token < 0 or max_seq_len < 0 or max_adapter_bytes < 0:
        raise ValueError("plan_for_engine: byte counts and max_seq_len must be non-negative")
    options = MemoryPlanOptions(
        fraction=fraction,
        adapter_pool_share=adapter_pool_share,
        non_kv_reserve_bytes=non_kv_reserve_bytes + (0 if weights_bytes_loaded else weights_bytes),
        min_adapter_pool_bytes=max_adapter_bytes,
        min_kv_bytes=kv_bytes_per_token * max_seq_len,
        max_adapter_pool_bytes=max_adapter_pool_bytes,
        max_kv_bytes=max_kv_bytes,
        max_total_bytes=max_total_bytes,
        host_tier_bytes=host_tier_bytes,
        local_ranks=local_ranks,
    )
    return compute_memory_plan(snapshot or take_snapshot(device), options)


def apply_torch_memory_fraction(plan: MemoryPlan, device: torch.device | str | int | None) -> bool:
    """Cap this process's CUDA caching allocator at ``plan.torch_memory_fraction`` of the device.

    Call it before any profiling run. Returns True when a cap was set; a no-op (False) on the CPU or
    when the plan has no fraction.
    """
    dev = _as_device(device)
    if plan.torch_memory_fraction is None or dev.type != "cuda" or not torch.cuda.is_available():
        return False
    torch.cuda.set_per_process_memory_fraction(plan.torch_memory_fraction, dev)
    return True
