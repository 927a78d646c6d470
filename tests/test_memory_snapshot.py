"""Snapshot readers on fixture trees (real-format /proc files, cgroup v2 and v1 hierarchies), the
engine helpers, and the ``multilora memory`` CLI round trip (record, replay, --json)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from multilora.memory import snapshot as snapshot_mod
from multilora.memory.accounting import (
    CgroupLevel,
    MemoryPlanError,
    MemoryPlanOptions,
    MemorySnapshot,
    compute_memory_plan,
)
from multilora.memory.snapshot import (
    apply_torch_memory_fraction,
    find_cgroup_mounts,
    plan_for_engine,
    read_cgroups,
    read_meminfo,
    read_proc_cgroups,
    read_rlimit_memlock,
    take_snapshot,
)
from multilora.runtime import cli_memory
from multilora.runtime.cli_memory import add_memory_parser, parse_bytes

GiB = 1 << 30
FIXTURES = Path(__file__).parent / "fixtures" / "memory"

# /proc/self/mountinfo of a cgroup v2 host and of a hybrid v1 host (lines as the kernel writes them).
MOUNTINFO_V2 = (
    "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n"
    "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)
MOUNTINFO_V1 = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
LIMITS = (
    "Limit                     Soft Limit           Hard Limit           Units     \n"
    "Max cpu time              unlimited            unlimited            seconds   \n"
    "Max locked memory         {soft:<20} {hard:<20} bytes     \n"
)
STAT_V2 = (  # 2 GiB active + 3 GiB inactive file pages, 0.5 GiB of them dirty; 1 GiB shmem
    "anon 1073741824\nfile 6442450944\nshmem 1073741824\nactive_file 2147483648\ninactive_file 3221225472\n"
    "file_dirty 536870912\nfile_writeback 0\nunevictable 0\n"
)


def tree(root: Path, files: dict[str, str]) -> Path:
    """Write ``files`` ({absolute path: text}) under ``root``; return root."""
    for path, text in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


def fixture(name: str = "meminfo_x86_container.txt") -> str:
    return (FIXTURES / name).read_text()


def meminfo_file(name: str = "meminfo_x86_container.txt") -> dict[str, str]:
    return {"/proc/meminfo": fixture(name)}


# ----------------------------------------------------------------------------------------------
# /proc readers.
# ----------------------------------------------------------------------------------------------


def test_read_meminfo_real_format_and_missing(tmp_path):
    root = tree(tmp_path, meminfo_file("meminfo_integrated_after_60g_write.txt"))
    assert read_meminfo(root).startswith("MemTotal:")
    assert read_meminfo(tmp_path / "nowhere") is None


def test_read_meminfo_binary_garbage_is_none(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_bytes(b"\xff\xfe\x00garbage")
    assert read_meminfo(tmp_path) is None


def test_read_proc_cgroups_v2_and_hybrid(tmp_path):
    tree(tmp_path / "a", {"/proc/self/cgroup": "0::/user.slice/app.scope\n"})
    assert read_proc_cgroups(tmp_path / "a") == ("/user.slice/app.scope", None)
    tree(tmp_path / "b", {"/proc/self/cgroup": "9:name=systemd:/\n4:memory:/job/42\n1:cpu,cpuacct:/\n0::/\n"})
    assert read_proc_cgroups(tmp_path / "b") == ("/", "/job/42")
    assert read_proc_cgroups(tmp_path / "none") == (None, None)


def test_find_cgroup_mounts(tmp_path):
    tree(tmp_path / "v2", {"/proc/self/mountinfo": MOUNTINFO_V2})
    assert find_cgroup_mounts(tmp_path / "v2") == {"v2": ("/sys/fs/cgroup", "/")}
    tree(tmp_path / "v1", {"/proc/self/mountinfo": MOUNTINFO_V1})
    assert find_cgroup_mounts(tmp_path / "v1") == {
        "v2": ("/sys/fs/cgroup/unified", "/"),
        "v1": ("/sys/fs/cgroup/memory", "/"),
    }
    assert find_cgroup_mounts(tmp_path / "none")["v2"] == ("/sys/fs/cgroup", "/")  # usual place


@pytest.mark.parametrize(
    "soft, expected",
    [("8388608", 8388608), ("unlimited", None), ("garbage", None), ("\u00b2", None), ("9" * 5000, None)],
)
def test_read_rlimit_memlock(tmp_path, soft, expected):
    root = tree(tmp_path, {"/proc/self/limits": LIMITS.format(soft=soft, hard="unlimited")})
    assert read_rlimit_memlock(root) == expected


def test_read_rlimit_memlock_missing_file_under_a_fixture_root_is_unknown(tmp_path):
    assert read_rlimit_memlock(tmp_path) is None


# ----------------------------------------------------------------------------------------------
# cgroup trees.
# ----------------------------------------------------------------------------------------------


def v2_tree(root: Path, levels: dict[str, dict[str, str]], leaf: str) -> Path:
    files = {"/proc/self/cgroup": f"0::{leaf}\n", "/proc/self/mountinfo": MOUNTINFO_V2}
    for path, entries in levels.items():
        for name, text in entries.items():
            files[f"/sys/fs/cgroup{path.rstrip('/')}/{name}"] = text
    return tree(root, files)


def test_cgroup_v2_nested_tree_with_max_and_a_limited_ancestor(tmp_path):
    root = v2_tree(
        tmp_path,
        {
            "/": {"memory.stat": STAT_V2},  # the root has no memory.max
            "/job": {"memory.max": f"{16 * GiB}\n", "memory.current": f"{12 * GiB}\n", "memory.stat": STAT_V2},
            "/job/step": {"memory.max": "max\n", "memory.current": f"{2 * GiB}\n", "memory.stat": STAT_V2},
        },
        leaf="/job/step",
    )
    v2, v1 = read_cgroups(root)
    assert [lv.path for lv in v2] == ["/job/step", "/job", "/"] and v1 == ()
    assert v2[0].limit == "max\n" and v2[2].limit is None and v2[1].usage == f"{12 * GiB}\n"
    snap = MemorySnapshot(has_gpu=False, meminfo_text=fixture(), cgroup_v2=v2)
    plan = compute_memory_plan(snap)
    # /job: 16 - 12 + (2 + 3 - 0.5) = 8.5 GiB, below this host's MemAvailable.
    assert plan.usable_source == "cgroup:/job"
    assert plan.usable_bytes == int(8.5 * GiB)
    text = plan.explain()  # the files' byte counts as the plan's other sizes are shown ("max" as written)
    assert f"cgroup:/job  limit {16 * GiB:,d} B, usage {12 * GiB:,d} B, reclaimable" in text
    assert f"cgroup:/job/step  limit max, usage {2 * GiB:,d} B" in text


def test_cgroup_v2_missing_usage_and_garbage_give_no_headroom(tmp_path):
    root = v2_tree(
        tmp_path,
        {
            "/job": {"memory.max": f"{16 * GiB}\n"},  # memory.current missing
            "/job/step": {"memory.max": "lots\n", "memory.current": "12\n"},
        },
        leaf="/job/step",
    )
    v2, _ = read_cgroups(root)
    assert v2[0].usage == "12\n" and v2[1].usage is None and v2[1].stat is None
    snap = MemorySnapshot(
        has_gpu=True,
        is_integrated=True,
        cuda_free_bytes=30 * GiB,
        cuda_total_bytes=120 * GiB,
        meminfo_text=fixture("meminfo_integrated_after_60g_write.txt"),
        cgroup_v2=v2,
    )
    plan = compute_memory_plan(snap)
    # The cgroup bound is applied last, above CUDA free: no provable headroom gives nothing (issue 15 item 11).
    assert plan.usable_bytes == 0 and plan.usable_source == "cgroup:/job/step"
    assert any("cgroup:/job:" in n and "no headroom" in n for n in plan.notes)
    assert any("cgroup:/job/step:" in n and "no headroom" in n for n in plan.notes)


def test_cgroup_v2_container_sees_its_own_root(tmp_path):
    # cgroup namespace: /proc/self/cgroup says "0::/" and the container's limit sits at the mount's root.
    root = v2_tree(tmp_path, {"/": {"memory.max": f"{4 * GiB}\n", "memory.current": f"{GiB}\n"}}, leaf="/")
    v2, _ = read_cgroups(root)
    assert v2 == (CgroupLevel("/", f"{4 * GiB}\n", f"{GiB}\n", None),)


def test_cgroup_v2_mount_of_a_subtree(tmp_path):
    mountinfo = "35 24 0:30 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    root = tree(
        tmp_path,
        {
            "/proc/self/cgroup": "0::/docker/abc/app\n",
            "/proc/self/mountinfo": mountinfo,
            "/sys/fs/cgroup/memory.max": "1000\n",
            "/sys/fs/cgroup/memory.current": "400\n",
            "/sys/fs/cgroup/app/memory.max": "max\n",
        },
    )
    v2, _ = read_cgroups(root)
    assert [(lv.path, lv.limit) for lv in v2] == [("/docker/abc/app", "max\n"), ("/docker/abc", "1000\n")]


def test_cgroup_v1_hybrid_host_with_unlimited_and_limited_levels(tmp_path):
    unlimited = "9223372036854771712\n"  # what v1 writes for "no limit" with 4 KiB pages (>= 2^60)
    stat_v1 = (
        "cache 100\ntotal_active_file 1073741824\ntotal_inactive_file 1073741824\ntotal_dirty 0\ntotal_writeback 0\n"
    )
    root = tree(
        tmp_path,
        {
            "/proc/self/cgroup": "4:memory:/process_api/abc\n0::/\n",
            "/proc/self/mountinfo": MOUNTINFO_V1,
            "/sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes": unlimited,
            "/sys/fs/cgroup/memory/process_api/abc/memory.usage_in_bytes": "155602944\n",
            "/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes": f"{6 * GiB}\n",
            "/sys/fs/cgroup/memory/process_api/memory.usage_in_bytes": f"{5 * GiB}\n",
            "/sys/fs/cgroup/memory/process_api/memory.stat": stat_v1,
            "/sys/fs/cgroup/memory/memory.limit_in_bytes": unlimited,
            "/sys/fs/cgroup/memory/memory.usage_in_bytes": f"{5 * GiB}\n",
            **meminfo_file(),
        },
    )
    snap = take_snapshot("cpu", root=root)
    assert [lv.path for lv in snap.cgroup_v1] == ["/process_api/abc", "/process_api", "/"]
    assert [lv.path for lv in snap.cgroup_v2] == ["/"] and snap.cgroup_v2[0].limit is None
    plan = compute_memory_plan(snap)
    assert plan.usable_bytes == 3 * GiB and plan.usable_source == "cgroup_v1:/process_api"  # 6 - 5 + 2


def test_take_snapshot_on_an_empty_root_falls_back(tmp_path):
    snap = take_snapshot("cpu", root=tmp_path)
    assert snap == MemorySnapshot(has_gpu=False)
    with pytest.raises(MemoryPlanError, match="unmeasured"):
        compute_memory_plan(snap, MemoryPlanOptions(min_kv_bytes=1))


def test_take_snapshot_of_this_machine():
    snap = take_snapshot()
    assert snap.has_gpu == torch.cuda.is_available()
    plan = compute_memory_plan(snap)
    assert plan.usable_bytes > 0 and plan.explain()


# ----------------------------------------------------------------------------------------------
# CUDA readings and engine helpers (CUDA faked on a CPU machine).
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gb10(monkeypatch, tmp_path):
    """torch.cuda answering like a GB10 after a 60 GiB write, and /proc with the matching meminfo."""
    calls = []
    props = SimpleNamespace(name="NVIDIA GB10", is_integrated=True, total_memory=int(119.7 * GiB))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (int(41.5 * GiB), int(119.7 * GiB)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 2 * GiB)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    monkeypatch.setattr(
        snapshot_mod,
        "take_snapshot",
        _rooted(take_snapshot, tree(tmp_path, meminfo_file("meminfo_integrated_after_60g_write.txt"))),
    )
    return calls


def _rooted(fn, root):
    return lambda device=None, **kw: fn(device, root=root)


def test_read_cuda_detects_integrated(fake_gb10):
    snap = snapshot_mod.take_snapshot("cuda:0")
    assert snap.has_gpu and snap.is_integrated and snap.device_name == "NVIDIA GB10"
    assert snap.cuda_free_bytes == int(41.5 * GiB) and snap.torch_reserved_bytes == 2 * GiB


def test_plan_for_engine_and_torch_fraction(fake_gb10):
    kw = dict(device="cuda:0", kv_bytes_per_token=160 * 1024, max_seq_len=8192, max_adapter_bytes=256 << 20)
    plan = plan_for_engine(**kw, weights_bytes_loaded=True)
    assert plan.usable_source == "mem_available" and plan.usable_bytes == 121320243 * 1024
    assert plan.options.live_state_minimum_bytes == (256 << 20) + 160 * 1024 * 8192
    assert apply_torch_memory_fraction(plan, "cuda:0") is True
    ((fraction, device),) = fake_gb10
    assert fraction == plan.torch_memory_fraction and device == torch.device("cuda", 0)
    expected = (2 * GiB + plan.usable_bytes - plan.host_tier_bytes) / int(119.7 * GiB)
    assert fraction == pytest.approx(expected, abs=1e-6)
    # Before loading, the weights' bytes count in the non-KV reserve.
    ahead = plan_for_engine(**kw, weights_bytes_loaded=False, weights_bytes=16 * GiB)
    assert ahead.hard_budget_bytes == plan.hard_budget_bytes - 16 * GiB
    loaded = plan_for_engine(**kw, weights_bytes_loaded=True, weights_bytes=16 * GiB, non_kv_reserve_bytes=GiB)
    assert loaded.hard_budget_bytes == plan.hard_budget_bytes - GiB
    with pytest.raises(MemoryPlanError, match="does not fit"):
        plan_for_engine(**kw, weights_bytes_loaded=False, weights_bytes=200 * GiB)


def test_apply_torch_memory_fraction_is_a_no_op_on_cpu():
    plan = plan_for_engine(
        device="cpu",
        kv_bytes_per_token=1024,
        max_seq_len=16,
        max_adapter_bytes=1 << 20,
        weights_bytes_loaded=True,
        snapshot=MemorySnapshot(has_gpu=False, meminfo_text=fixture()),
    )
    assert plan.kind == "host" and plan.adapter_pool_bytes >= 1 << 20 and plan.kv_bytes >= 16 * 1024
    assert apply_torch_memory_fraction(plan, "cpu") is False


# ----------------------------------------------------------------------------------------------
# CLI.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4096", 4096),
        ("2GiB", 2 * GiB),
        ("512MiB", 512 << 20),
        ("1.5G", 3 * GiB // 2),
        ("2 gib", 2 * GiB),
        ("3GB", 3 * 10**9),
        ("1T", 1 << 40),
        ("7B", 7),
        ("2,010,458,972 B", 2_010_458_972),  # as `multilora memory` prints it
        ("1,024", 1024),
        ("1,536.5 MiB", 3 * 512 * (1 << 20) + (1 << 19)),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "2XB", "1e9", "1.5", "2.0B", "1,00", "1,0000", ",100", "1,,000"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="byte count|whole number of bytes"):
        parse_bytes(text)


def cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="multilora")
    add_memory_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["memory", *argv])


def test_cli_help_states_byte_units_and_defaults_and_dtype_choices(capsys):
    """memory --help says how a BYTES option is written and each cap's default; --dtype / --weight-dtype take the
    engine's choices (any string was taken, then refused as "must be a torch dtype or a name")."""
    with pytest.raises(SystemExit):
        cli("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "BYTES: a count (4096, or 2,010,458,972 with commas, as the plan prints it) or a number with a unit" in text
    for flag in ("--adapter-pool-bytes BYTES", "--kv-bytes BYTES", "--total-bytes BYTES"):
        assert flag in text
    assert "cap on adapter pool + KV (default: none)" in text
    assert cli("--model", "--dtype", "float16").dtype == "float16"
    for flag, bad in (("--dtype", "f16"), ("--weight-dtype", "int4")):
        with pytest.raises(SystemExit):
            cli("--model", flag, bad)
        assert f"argument {flag}: invalid choice: '{bad}'" in capsys.readouterr().err


def test_cli_records_and_replays_a_snapshot(tmp_path, capsys):
    snap_path = tmp_path / "snap.json"
    assert cli_memory.run_memory(cli("--save-snapshot", str(snap_path))) == 0
    live_text = capsys.readouterr().out
    assert "memory plan" in live_text and "bound by" in live_text and "inputs:" in live_text
    recorded = MemorySnapshot.from_dict(json.loads(snap_path.read_text()))
    args = cli("--snapshot", str(snap_path), "--json", "--kv-bytes", "512MiB", "--fraction", "0.8")
    assert args.func is cli_memory.run_memory and args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert MemorySnapshot.from_dict(out["snapshot"]) == recorded
    expected = compute_memory_plan(recorded, cli_memory._options(args)).to_dict()
    assert out["plan"] == json.loads(json.dumps(expected))
    assert out["plan"]["kv_bytes"] <= 512 << 20 and out["plan"]["options"]["fraction"] == 0.8


def test_cli_replays_the_integrated_example_elsewhere(tmp_path, capsys):
    snap = MemorySnapshot(
        has_gpu=True,
        is_integrated=True,
        cuda_free_bytes=30 * GiB,
        cuda_total_bytes=120 * GiB,
        meminfo_text=meminfo_text(120 * GiB, 30 * GiB, 90 * GiB),
    )
    path = tmp_path / "gb10.json"
    path.write_text(json.dumps(snap.to_dict()))
    assert cli_memory.main(["--snapshot", str(path), "--json", "--adapter-pool-share", "0"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["usable_bytes"] == 90 * GiB and plan["kv_bytes"] == 81 * GiB and plan["host_tier_bytes"] == 9 * GiB // 2
    assert plan["usable_source"] == "mem_available" and plan["kind"] == "integrated"
    # An explicit host tier that over-commits the shared pool is refused with a clear error.
    assert cli_memory.main(["--snapshot", str(path), "--adapter-pool-share", "0", "--host-adapter-bytes", "20GiB"]) == 2
    assert "over-commits" in capsys.readouterr().err
    # with --json the refusal is JSON on stdout too, with what was asked for, what fits and what bound it
    argv = ["--snapshot", str(path), "--adapter-pool-share", "0", "--host-adapter-bytes", "20GiB", "--json"]
    assert cli_memory.main(argv) == 2
    cap = capsys.readouterr()
    err = json.loads(cap.out)["error"]
    assert err["type"] == "MemoryPlanError" and "over-commits" in err["message"] and err["message"] in cap.err
    assert err["needed_bytes"] == 20 * GiB and 0 <= err["fits_bytes"] < 20 * GiB and err["source"], err
    assert cli_memory.main(["--snapshot", str(tmp_path / "missing.json"), "--json"]) == 2  # other errors: no sizes
    assert set(json.loads(capsys.readouterr().out)["error"]) == {"message", "type"}


def test_cli_takes_the_engine_flag_names_too(tmp_path, capsys):
    """``--kv-cache-bytes`` / ``--gpu-memory-fraction`` (the engine's names) are ``--kv-bytes`` / ``--fraction``."""
    snap = MemorySnapshot(has_gpu=True, is_integrated=False, cuda_free_bytes=60 * GiB, cuda_total_bytes=80 * GiB,
                          meminfo_text=meminfo_text(120 * GiB, 30 * GiB, 90 * GiB))
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(snap.to_dict()))
    plans = []
    for flags in (["--kv-bytes", "8GiB", "--fraction", "0.5"], ["--kv-cache-bytes", "8GiB", "--gpu-memory-fraction",
                                                                "0.5"]):
        assert cli_memory.main(["--snapshot", str(path), "--json", *flags]) == 0
        plans.append(json.loads(capsys.readouterr().out)["plan"])
    assert plans[0] == plans[1] and plans[0]["kv_bytes"] == 8 * GiB


def test_cli_reports_bad_snapshots(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "multilora-memory-snapshot", "schema_version": 99}))
    assert cli_memory.main(["--snapshot", str(bad)]) == 2
    assert "schema_version" in capsys.readouterr().err
    assert cli_memory.main(["--snapshot", str(tmp_path / "missing.json")]) == 2


def meminfo_text(total: int, free: int, available: int) -> str:
    return f"MemTotal: {total // 1024} kB\nMemFree: {free // 1024} kB\nMemAvailable: {available // 1024} kB\n"
