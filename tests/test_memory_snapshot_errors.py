"""Malformed memory snapshots (issue 15 item 10): every one is refused with a ``MemorySnapshotError`` (a
``ValueError``) that names the file, the field, what was expected and what was got, through
``MemorySnapshot.from_dict`` / ``from_json``, through ``multilora memory --snapshot`` (exit 2, no traceback)
and through ``Engine(memory_snapshot=...)``; raw /proc and cgroup text stays "garbage -> None"."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest

from multilora.memory.accounting import (
    CgroupLevel,
    MemoryPlanError,
    MemoryPlanOptions,
    MemorySnapshot,
    MemorySnapshotError,
    compute_memory_plan,
    level_headroom,
    parse_int,
    parse_meminfo,
    parse_stat,
    reclaimable_file_bytes,
)
from multilora.runtime import cli_memory

GiB = 1 << 30

GOOD = {
    "schema": "multilora-memory-snapshot",
    "schema_version": 1,
    "has_gpu": True,
    "is_integrated": True,
    "cuda_free_bytes": 30 * GiB,
    "cuda_total_bytes": 120 * GiB,
    "torch_reserved_bytes": 0,
    "device_name": "NVIDIA GB10",
    "meminfo_text": f"MemTotal: {120 * GiB // 1024} kB\nMemFree: {30 * GiB // 1024} kB\n"
    f"MemAvailable: {90 * GiB // 1024} kB\n",
    "cgroup_v2": [{"path": "/job", "limit": "max\n", "usage": "1\n", "stat": None}],
    "cgroup_v1": [],
    "rlimit_memlock_bytes": None,
}

_DROP = object()


def snapshot_dict(**changes) -> dict:
    d = copy.deepcopy(GOOD)
    for key, value in changes.items():
        if value is _DROP:
            del d[key]
        else:
            d[key] = value
    return d


# (case id, the JSON document, words the message must hold besides the file name)
MALFORMED = [
    ("has_gpu missing", snapshot_dict(has_gpu=_DROP), ["has_gpu", "true or false", "missing"]),
    ("has_gpu a string", snapshot_dict(has_gpu="yes"), ["has_gpu", "true or false", "'yes'"]),
    ("level without path", snapshot_dict(cgroup_v2=[{"limit": "max"}]), ["cgroup_v2[0].path", "missing"]),
    ("path not a string", snapshot_dict(cgroup_v2=[{"path": 7}]), ["cgroup_v2[0].path", "a string", "7"]),
    ("cgroup_v2 a dict", snapshot_dict(cgroup_v2={"path": "/a"}), ["cgroup_v2", "a list", "an object"]),
    ("cgroup_v2 an int", snapshot_dict(cgroup_v2=5), ["cgroup_v2", "a list", "5"]),
    ("cgroup_v2 strings", snapshot_dict(cgroup_v2=["/a", "/"]), ["cgroup_v2[0]", "an object", "'/a'"]),
    ("level a list", snapshot_dict(cgroup_v2=[["/a", "max"]]), ["cgroup_v2[0]", "an object", "a list"]),
    ("cgroup_v1 null level", snapshot_dict(cgroup_v1=[None]), ["cgroup_v1[0]", "an object", "null"]),
    ("level text an int", snapshot_dict(cgroup_v2=[{"path": "/a", "limit": 5}]), ["cgroup_v2[0].limit", "5"]),
    ("top-level list", [], ["a JSON object", "a list"]),
    ("top-level null", None, ["a JSON object", "null"]),
    ("top-level string", "snapshot", ["a JSON object", "'snapshot'"]),
    ("torch_reserved_bytes null", snapshot_dict(torch_reserved_bytes=None), ["torch_reserved_bytes", "null"]),
    ("cuda_free_bytes huge", snapshot_dict(cuda_free_bytes=10**400), ["cuda_free_bytes", "2^64", "401 digits"]),
    ("cuda_total_bytes 2^64", snapshot_dict(cuda_total_bytes=1 << 64), ["cuda_total_bytes", "2^64"]),
    ("rlimit a float", snapshot_dict(rlimit_memlock_bytes=1.5), ["rlimit_memlock_bytes", "1.5"]),
    ("has_gpu needs cuda", snapshot_dict(cuda_free_bytes=None), ["cuda_free_bytes", "has_gpu", "null"]),
    ("schema_version true", snapshot_dict(schema_version=True), ["schema_version", "true"]),
    ("schema_version 1.0", snapshot_dict(schema_version=1.0), ["schema_version", "1.0"]),
    ("schema_version newer", snapshot_dict(schema_version=2), ["schema_version", "2"]),
    ("schema missing", snapshot_dict(schema=_DROP), ["schema", "missing"]),
    ("unknown key", snapshot_dict(meminfo_txt="MemAvailable: 1 kB"),
     ["unknown key", "'meminfo_txt'", "'meminfo_text'"]),
    ("unknown level key", snapshot_dict(cgroup_v2=[{"path": "/a", "limt": "5"}]),
     ["cgroup_v2[0]", "'limt'", "'limit'"]),
    ("meminfo_text a list", snapshot_dict(meminfo_text=["MemTotal: 1 kB"]), ["meminfo_text", "text or null"]),
    ("lone surrogate", snapshot_dict(device_name="\ud800"), ["device_name", "surrogate"]),
]


@pytest.mark.parametrize("case, document, words", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_from_dict_refuses_naming_field_expected_and_got(case, document, words):
    with pytest.raises(MemorySnapshotError) as err:
        MemorySnapshot.from_dict(document, file="snap.json")
    msg = str(err.value)
    assert isinstance(err.value, ValueError) and msg.startswith("memory snapshot snap.json: ")
    assert "expected" in msg and ", got " in msg
    for word in words:
        assert word in msg, (word, msg)
    assert len(msg) < 600  # a summary, never the whole value


@pytest.mark.parametrize("case, document, words", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_cli_exits_2_naming_the_file(case, document, words, tmp_path, capsys):
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(document))
    assert cli_memory.main(["--snapshot", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"memory snapshot {path}: " in err and "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize(
    "text, words",
    [
        ("hello", ["not valid JSON", "line 1 column 1"]),
        (json.dumps(GOOD)[:60], ["not valid JSON"]),  # truncated
        ("", ["not valid JSON"]),
        ("[" * 100_000 + "]" * 100_000, ["nested too deeply"]),
        ('{"a": ' * 100_000 + "1" + "}" * 100_000, ["nested too deeply"]),
        ('{"schema": "multilora-memory-snapshot", "schema": "x"}', ["duplicate key", "'schema'"]),
        (json.dumps(GOOD).replace('"torch_reserved_bytes": 0', '"torch_reserved_bytes": NaN'), ["NaN"]),
        ('{"cuda_free_bytes": ' + "9" * 5000 + "}", ["not valid JSON", "digits"]),
    ],
    ids=["not json", "truncated", "empty", "deep list", "deep object", "duplicate key", "NaN", "5000 digits"],
)
def test_unreadable_json_names_the_file(text, words, tmp_path, capsys):
    with pytest.raises(MemorySnapshotError) as err:
        MemorySnapshot.from_json(text, file="snap.json")
    for word in words:
        assert word in str(err.value)
    path = tmp_path / "snap.json"
    path.write_text(text)
    assert cli_memory.main(["--snapshot", str(path)]) == 2
    err_text = capsys.readouterr().err
    assert f"memory snapshot {path}: " in err_text and "Traceback" not in err_text


def test_unreadable_files_name_the_file(tmp_path, capsys):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00{")
    cases = [(binary, ["UTF-8"]), (tmp_path / "missing.json", ["cannot be read"]), (tmp_path, ["cannot be read"])]
    for path, words in cases:
        assert cli_memory.main(["--snapshot", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"memory snapshot {path}: " in err and "Traceback" not in err
        for word in words:
            assert word in err


def test_cli_save_snapshot_into_a_missing_directory_exits_2(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(GOOD))
    target = tmp_path / "no" / "such" / "dir.json"
    assert cli_memory.main(["--snapshot", str(good), "--save-snapshot", str(target)]) == 2
    err = capsys.readouterr().err
    assert str(target) in err and "Traceback" not in err


def test_the_command_line_itself_prints_no_traceback(tmp_path):
    path = tmp_path / "snap.json"
    path.write_text("[" * 100_000)
    run = subprocess.run([sys.executable, "-m", "multilora.runtime.cli", "memory", "--snapshot", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr and str(path) in run.stderr


def test_round_trip_still_holds_and_optional_keys_take_their_defaults():
    snap = MemorySnapshot.from_dict(GOOD)
    assert MemorySnapshot.from_dict(json.loads(json.dumps(snap.to_dict()))) == snap
    bare = MemorySnapshot.from_dict({"schema": "multilora-memory-snapshot", "schema_version": 1, "has_gpu": False})
    assert bare == MemorySnapshot(has_gpu=False)
    assert MemorySnapshot.from_json(json.dumps(GOOD)) == snap


def test_direct_construction_is_checked_too():
    with pytest.raises(MemorySnapshotError, match=r"cgroup_v2\[0\]: expected a CgroupLevel"):
        MemorySnapshot(has_gpu=False, cgroup_v2=({"path": "/a"},))
    with pytest.raises(MemorySnapshotError, match="cgroup_v2: expected a list"):
        MemorySnapshot(has_gpu=False, cgroup_v2=5)
    with pytest.raises(MemorySnapshotError, match="path: expected a string"):
        CgroupLevel(path=None)
    with pytest.raises(MemorySnapshotError, match="torch_reserved_bytes"):
        MemorySnapshot(has_gpu=False, torch_reserved_bytes=None)


def test_engine_refuses_a_snapshot_that_is_not_one():
    from multilora import Engine
    from multilora.config import ModelConfig
    from multilora.runtime.config import EngineConfig
    from multilora.runtime.weights import MODEL_SHAPES

    with pytest.raises(MemorySnapshotError, match="Engine.*memory_snapshot.*MemorySnapshot.from_dict"):
        EngineConfig(device="cpu", max_seq_len=64, memory_snapshot=dict(GOOD), progress=False)  # before any load
    with pytest.raises(MemorySnapshotError, match="Engine.*memory_snapshot.*MemorySnapshot.from_dict"):
        Engine(ModelConfig(**MODEL_SHAPES["tiny"]), device="cpu", memory_snapshot=dict(GOOD))
    with pytest.raises(MemorySnapshotError, match="has_gpu"):
        Engine(ModelConfig(**MODEL_SHAPES["tiny"]), device="cpu",
               memory_snapshot=MemorySnapshot.from_dict(snapshot_dict(has_gpu=_DROP)))


# ----------------------------------------------------------------------------------------------
# Raw text: garbage -> None, however large; a duplicated key counts at its least favourable value.
# ----------------------------------------------------------------------------------------------

HUGE = "9" * 5000  # above Python's int-string limit (4,300 digits)


def test_numbers_beyond_64_bits_in_raw_text_are_garbage():
    assert parse_int(HUGE) is None and parse_int(str(1 << 64)) is None
    assert parse_int(str((1 << 64) - 1)) == (1 << 64) - 1
    assert parse_int("\u0663") is None  # an Arabic-Indic digit is not what the kernel writes
    assert parse_meminfo(f"MemAvailable: {HUGE} kB\nMemTotal: 4 kB\n") == {"MemTotal": 4096}
    assert parse_stat(f"active_file {HUGE}\ninactive_file 3\n") == {"inactive_file": 3}
    assert level_headroom(CgroupLevel("/a", HUGE, "1"), "cgroup").value == 0  # malformed limit: no headroom
    assert level_headroom(CgroupLevel("/a", "100", HUGE), "cgroup").value == 0  # usage unreadable
    snap = MemorySnapshot(has_gpu=False, meminfo_text=f"MemTotal: 64 kB\nMemAvailable: {HUGE} kB\nMemFree: 8 kB\n",
                          cgroup_v2=(CgroupLevel("/a", "max", HUGE, f"active_file {HUGE}\n"),))
    plan = compute_memory_plan(snap)
    assert plan.usable_source == "mem_free" and plan.usable_bytes == 8 * 1024 and plan.explain()


def test_duplicated_keys_count_at_their_least_favourable_value():
    stat = "active_file 5000\ninactive_file 7000\nfile_dirty 0\nfile_writeback 0\ninactive_file 0\nfile_dirty 1000\n"
    assert reclaimable_file_bytes(stat) == 5000 - 1000  # smaller inactive_file, larger file_dirty
    level = CgroupLevel("/a", str(10 * GiB), str(9 * GiB), f"active_file 0\ninactive_file {4 * GiB}\n"
                        f"file_dirty 0\nfile_writeback 0\ninactive_file 0\n")
    assert level_headroom(level, "cgroup").value == GiB  # not 5 GiB ("last one wins" would give 1 GiB by luck)
    level = CgroupLevel("/a", str(10 * GiB), str(9 * GiB), f"active_file 0\ninactive_file 0\n"
                        f"file_dirty 0\nfile_writeback 0\ninactive_file {4 * GiB}\n")
    assert level_headroom(level, "cgroup").value == GiB  # "last one wins" gave 5 GiB
    meminfo = "MemAvailable: 100 kB\nMemAvailable: 40 kB\nMemAvailable: 70 kB\n"
    assert parse_meminfo(meminfo) == {"MemAvailable": 40 * 1024}


# ----------------------------------------------------------------------------------------------
# The text summary and error messages for the largest values a snapshot or the options may hold.
# ----------------------------------------------------------------------------------------------


def test_largest_values_do_not_overflow_the_summary():
    top = (1 << 64) - 1
    snap = MemorySnapshot(has_gpu=True, is_integrated=True, cuda_free_bytes=top, cuda_total_bytes=top,
                          torch_reserved_bytes=top, rlimit_memlock_bytes=top,
                          meminfo_text=f"MemTotal: {top} kB\nMemAvailable: {top} kB\n")
    text = compute_memory_plan(snap, MemoryPlanOptions(max_kv_bytes=10**400)).explain()
    assert "17179869184.00 GiB" in text and f"{top:,d} B" in text
    with pytest.raises(MemoryPlanError, match="does not fit") as err:
        compute_memory_plan(MemorySnapshot(has_gpu=False, meminfo_text="MemAvailable: 4 kB\n"),
                            MemoryPlanOptions(min_kv_bytes=10**400))
    assert str(10**400) in str(err.value)


@pytest.mark.parametrize("text", ["9" * 400 + ".5GiB", "1" * 320 + "TB", "16777216TiB", "9" * 5000])
def test_parse_bytes_refuses_counts_beyond_64_bits_clearly(text):
    with pytest.raises(ValueError, match=r"below 2\^64"):  # the decimal once overflowed a float
        cli_memory.parse_bytes(text)
    assert cli_memory.parse_bytes("16777215.5TiB") == (1 << 64) - (1 << 39)  # exact, no float rounding


def test_huge_byte_flags_exit_2_with_a_message(tmp_path, capsys):
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(GOOD))
    for flag in ("--kv-bytes", "--min-kv-bytes"):
        with pytest.raises(SystemExit) as exit_:
            cli_memory.main(["--snapshot", str(path), flag, "9" * 400 + ".5GiB"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and flag in err and "2^64" in err and "Traceback" not in err


def test_a_snapshot_error_is_never_taken_for_a_plan_error():
    assert not issubclass(MemorySnapshotError, MemoryPlanError) and not issubclass(MemoryPlanError, MemorySnapshotError)
    assert issubclass(MemorySnapshotError, ValueError)


def test_a_snapshot_without_a_gpu_may_not_carry_gpu_fields():
    """``has_gpu: false`` with ``is_integrated: true`` or CUDA byte counts contradicts itself (the plan printed "no
    GPU: the host is the device 'NVIDIA GB10'"): refused naming the field."""
    base = {"schema": "multilora-memory-snapshot", "schema_version": 1, "has_gpu": False}
    for key, value, want in (("is_integrated", True, "is_integrated: expected false (has_gpu is false"),
                             ("cuda_free_bytes", 1 << 30, "cuda_free_bytes: expected null (has_gpu is false)"),
                             ("cuda_total_bytes", 1 << 30, "cuda_total_bytes: expected null (has_gpu is false)")):
        with pytest.raises(MemorySnapshotError, match=re.escape(want)):
            MemorySnapshot.from_dict({**base, key: value})
    assert MemorySnapshot.from_dict({**base, "device_name": "x86_64"}).device_name == "x86_64"  # a name is fine
