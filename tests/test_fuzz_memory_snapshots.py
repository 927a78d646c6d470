"""Fuzz: random malformed memory snapshots (issue 15, "Also build"; item 10 keeps found).

Random JSON shapes, a wrong type or value in each field, garbage raw /proc and cgroup text, huge numbers,
deep nesting, duplicated and unknown keys, truncated and corrupted files go through
``MemorySnapshot.from_json`` / ``from_dict`` + ``compute_memory_plan`` (+ ``explain`` and the JSON output),
through the engine's sizing (``runtime/sizing.size_engine``) and through ``multilora memory --snapshot FILE``.
Every outcome must be a plan, or ``MemorySnapshotError`` naming what was expected and what was got (and the
file, when there is one), or ``MemoryPlanError`` for a plan that does not fit; never another exception,
never a traceback, never exit status other than 0 or 2.

Profiles (hypothesis settings, chosen by the environment variable ``MULTILORA_FUZZ``):

    python -m pytest tests/test_fuzz_memory_snapshots.py                  # "ci" (default): well under a minute
    MULTILORA_FUZZ=long python -m pytest tests/test_fuzz_memory_snapshots.py   # "long": 50x the examples

The profiles are applied per test (``@FUZZ``), not loaded globally, so other test modules keep their own
settings. A failing example is printed by hypothesis with ``@reproduce_failure`` to replay it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multilora.config import ModelConfig
from multilora.memory.accounting import (
    CgroupLevel,
    MemoryPlan,
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
from multilora.runtime.config import EngineConfig
from multilora.runtime.sizing import memory_request, size_engine
from multilora.runtime.weights import MODEL_SHAPES

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               derandomize=False, print_blob=True)
settings.register_profile("multilora-fuzz-ci", max_examples=120, **_COMMON)
settings.register_profile("multilora-fuzz-long", max_examples=6000, **_COMMON)
FUZZ = settings.get_profile(f"multilora-fuzz-{os.environ.get('MULTILORA_FUZZ', 'ci')}")
#: The CLI path writes a file and parses arguments per example: a fifth of the examples.
FUZZ_CLI = settings(FUZZ, max_examples=max(10, FUZZ.max_examples // 5))

GiB = 1 << 30
TINY = ModelConfig(**MODEL_SHAPES["tiny"])
SCRATCH = Path(tempfile.mkdtemp(prefix="multilora-fuzz-"))  # hypothesis cannot share a function-scoped tmp_path

# ----------------------------------------------------------------------------------------------
# Strategies.
# ----------------------------------------------------------------------------------------------

FIELDS = ("has_gpu", "is_integrated", "cuda_free_bytes", "cuda_total_bytes", "torch_reserved_bytes", "device_name",
          "meminfo_text", "cgroup_v2", "cgroup_v1", "rlimit_memlock_bytes")
LEVEL_FIELDS = ("path", "limit", "usage", "stat")
KEYS = ("schema", "schema_version", *FIELDS)

huge_ints = st.one_of(st.integers(-(1 << 70), 1 << 70), st.sampled_from([(1 << 64) - 1, 1 << 64, 10**308, 10**400,
                                                                          -(10**400), 2**1023, 10**4000]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, 1.5, 0.0, -0.0]))
texts = st.text(max_size=40)
scalars = st.one_of(st.none(), st.booleans(), huge_ints, floats, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.sampled_from(KEYS + LEVEL_FIELDS), texts), inner, max_size=4)),
    max_leaves=12,
)

DIGITS = st.one_of(st.integers(0, 1 << 66).map(str), st.sampled_from(["9" * 5000, "1" * 4301, "-5", "1.5", "0x10",
                                                                       "\u0663", "\u00b2", "1e9", "", "max"]))
MEMINFO_KEYS = st.sampled_from(["MemTotal", "MemFree", "MemAvailable", "Cached", "Shmem", "Dirty", "Writeback",
                                "HugePages_Total", "Mem Available", ""])
STAT_KEYS = st.sampled_from(["anon", "file", "shmem", "active_file", "inactive_file", "file_dirty", "file_writeback",
                             "total_active_file", "total_inactive_file", "total_dirty", "total_writeback", "dirty",
                             "writeback", "unevictable"])


@st.composite
def meminfo_texts(draw) -> str | None:
    """/proc/meminfo-like text: plausible lines, duplicated keys, huge or odd numbers, garbage lines."""
    if draw(st.integers(0, 9)) == 0:
        return None
    line = st.one_of(
        st.builds(lambda k, n, u: f"{k}:{' ' * 8}{n} {u}", MEMINFO_KEYS, DIGITS, st.sampled_from(["kB", "KB", "", "MB"])),
        texts,
    )
    return "\n".join(draw(st.lists(line, max_size=8)))


@st.composite
def stat_texts(draw) -> str | None:
    if draw(st.integers(0, 5)) == 0:
        return None
    line = st.one_of(st.builds(lambda k, n: f"{k} {n}", STAT_KEYS, DIGITS), texts)
    return "\n".join(draw(st.lists(line, max_size=10)))


cgroup_numbers = st.one_of(DIGITS, st.just("max"), st.just("max\n"), st.none(), texts)


@st.composite
def level_dicts(draw) -> dict:
    return {"path": draw(st.one_of(st.just("/"), st.text(min_size=1, max_size=20))),
            "limit": draw(cgroup_numbers), "usage": draw(cgroup_numbers), "stat": draw(stat_texts())}


@st.composite
def snapshot_dicts(draw) -> dict:
    """A well-formed snapshot document (its raw texts may be garbage: that is still well-formed)."""
    gpu = draw(st.booleans())
    total = draw(st.integers(0, 1 << 44))
    return {
        "schema": "multilora-memory-snapshot",
        "schema_version": 1,
        "has_gpu": gpu,
        "is_integrated": draw(st.booleans()) if gpu else False,  # (true without a GPU: refused, a contradiction)
        "cuda_free_bytes": draw(st.integers(0, 1 << 44)) if gpu else None,
        "cuda_total_bytes": total if gpu else None,
        "torch_reserved_bytes": draw(st.integers(0, 1 << 40)),
        "device_name": draw(st.one_of(st.none(), texts)),
        "meminfo_text": draw(meminfo_texts()),
        "cgroup_v2": draw(st.lists(level_dicts(), max_size=3)),
        "cgroup_v1": draw(st.lists(level_dicts(), max_size=2)),
        "rlimit_memlock_bytes": draw(st.one_of(st.none(), st.integers(0, (1 << 64) - 1))),
    }


@st.composite
def malformed_documents(draw):
    """A snapshot document with one to three things wrong with it, or a random JSON value."""
    if draw(st.integers(0, 5)) == 0:
        return draw(json_values)
    d = draw(snapshot_dicts())
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["replace", "drop", "unknown key", "level", "level key"]))
        if how == "replace":
            d[draw(st.sampled_from(KEYS))] = draw(json_values)
        elif how == "drop":
            d.pop(draw(st.sampled_from(KEYS)), None)
        elif how == "unknown key":
            d[draw(st.sampled_from(["meminfo_txt", "has-gpu", "cgroups_v2", "Schema", "cuda_free"]))] = draw(scalars)
        elif isinstance(d.get("cgroup_v2"), list) and d["cgroup_v2"]:
            level = d["cgroup_v2"][0]
            if how == "level":
                d["cgroup_v2"][0] = draw(json_values)
            elif isinstance(level, dict):
                level[draw(st.sampled_from([*LEVEL_FIELDS, "limt", "memory.max"]))] = draw(json_values)
    return d


@st.composite
def malformed_texts(draw) -> str:
    """JSON text: a (malformed) document, then maybe truncated, corrupted, nested deeply or keyed twice."""
    text = json.dumps(draw(malformed_documents()))
    how = draw(st.sampled_from(["as is", "as is", "truncate", "corrupt", "deep", "duplicate", "constant"]))
    if how == "truncate":
        return text[: draw(st.integers(0, max(0, len(text) - 1)))]
    if how == "corrupt":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.text(min_size=1, max_size=5)) + text[at:]
    if how == "deep":
        depth = draw(st.sampled_from([10, 900, 5000, 200_000]))
        return '{"schema": "multilora-memory-snapshot", "schema_version": 1, "has_gpu": false, "device_name": ' + \
            "[" * depth + "]" * depth + "}"
    if how == "duplicate":
        return text[:-1] + ', "has_gpu": true}' if text.endswith("}") else text
    if how == "constant":
        return text.replace("0", draw(st.sampled_from(["NaN", "Infinity", "-Infinity"])), 1)
    return text


@st.composite
def plan_options(draw) -> MemoryPlanOptions:
    cap = st.one_of(st.none(), st.integers(0, 1 << 45), st.just(10**400))
    return MemoryPlanOptions(
        fraction=draw(st.floats(0.01, 1.0)),
        adapter_pool_share=draw(st.floats(0.0, 1.0)),
        non_kv_reserve_bytes=draw(st.integers(0, 1 << 36)),
        min_adapter_pool_bytes=draw(st.integers(0, 1 << 34)),
        min_kv_bytes=draw(st.integers(0, 1 << 34)),
        max_adapter_pool_bytes=draw(cap),
        max_kv_bytes=draw(cap),
        max_total_bytes=draw(cap),
        host_tier_bytes=draw(st.one_of(st.none(), st.integers(0, 1 << 40))),
        local_ranks=draw(st.integers(1, 8)),
    )


# ----------------------------------------------------------------------------------------------
# What every outcome must look like.
# ----------------------------------------------------------------------------------------------


def assert_clear_snapshot_error(e: MemorySnapshotError, file: str | None = None) -> None:
    msg = str(e)
    assert isinstance(e, ValueError) and not isinstance(e, MemoryPlanError)
    assert msg.startswith(f"memory snapshot {file}: " if file else "memory snapshot"), msg
    assert e.expected and e.got and f"expected {e.expected}, got {e.got}" in msg
    assert len(msg) < 1000 and "\n" not in msg, msg


def assert_a_plan_or_a_clear_refusal(snap: MemorySnapshot, options: MemoryPlanOptions | None) -> MemoryPlan | None:
    try:
        plan = compute_memory_plan(snap, options)
    except MemoryPlanError as e:
        assert str(e) and e.source and e.needed_bytes >= e.fits_bytes >= 0, str(e)
        return None
    assert plan.adapter_pool_bytes + plan.kv_bytes <= plan.budget_bytes <= plan.usable_bytes
    assert plan.explain() and json.dumps(plan.to_dict())  # the text summary and the JSON output never overflow
    return plan


def read(make, *args, file: str | None = None, **kwargs) -> MemorySnapshot | None:
    """``make(*args, file=file, **kwargs)`` (a snapshot reader; ``file`` only when given), or None after
    checking that the error it raised is clear."""
    try:
        snap = make(*args, **({"file": file} if file else {}), **kwargs)
    except MemorySnapshotError as e:
        assert_clear_snapshot_error(e, file)
        return None
    assert MemorySnapshot.from_dict(json.loads(json.dumps(snap.to_dict()))) == snap  # what is read round-trips
    return snap


# ----------------------------------------------------------------------------------------------
# The properties.
# ----------------------------------------------------------------------------------------------


@FUZZ
@given(malformed_texts(), st.one_of(st.none(), plan_options()))
def test_fuzz_snapshot_text_gives_a_plan_or_a_clear_error(text, options):
    snap = read(MemorySnapshot.from_json, text, file="fuzz.json")
    if snap is not None:
        assert_a_plan_or_a_clear_refusal(snap, options)


@FUZZ
@given(malformed_documents())
def test_fuzz_snapshot_documents_through_from_dict(document):
    snap = read(MemorySnapshot.from_dict, document)
    if snap is not None:
        assert_a_plan_or_a_clear_refusal(snap, None)


@FUZZ
@given(snapshot_dicts(), plan_options())
def test_fuzz_well_formed_snapshots_with_garbage_text_always_plan_or_refuse(document, options):
    # Raw text is never refused ("garbage -> None"): a well-formed document is always read.
    snap = MemorySnapshot.from_dict(document)
    plan = assert_a_plan_or_a_clear_refusal(snap, options)
    if plan is not None and snap.is_integrated and snap.has_gpu:
        assert plan.usable_bytes <= max(snap.cuda_free_bytes, plan.shared_pool_bytes) // options.local_ranks


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6))
def test_fuzz_direct_construction(kwargs):
    snap = read(MemorySnapshot, **{"has_gpu": False, **kwargs})
    if snap is not None:
        assert_a_plan_or_a_clear_refusal(snap, None)


@FUZZ
@given(st.one_of(meminfo_texts(), stat_texts(), cgroup_numbers, texts), cgroup_numbers, cgroup_numbers)
def test_fuzz_raw_text_parsers_give_none_or_64_bit_numbers(text, limit, usage):
    for value in (*parse_meminfo(text).values(), *parse_stat(text).values(), reclaimable_file_bytes(text)):
        assert isinstance(value, int) and 0 <= value < (1 << 64) * 1024
    parsed = parse_int(text)
    assert parsed is None or 0 <= parsed < 1 << 64
    room = level_headroom(CgroupLevel("/x", limit, usage, text), "cgroup")
    assert room is None or 0 <= room.value < 1 << 64


@FUZZ
@given(st.one_of(malformed_documents(), snapshot_dicts()))
def test_fuzz_engine_sizing_from_a_snapshot(document):
    # Engine(memory_snapshot=MemorySnapshot.from_dict(...)) without a model: the sizing is a pure function.
    snap = read(MemorySnapshot.from_dict, document)
    if snap is None:
        return
    ec = EngineConfig(max_lora_rank=16, max_batch_size=2, kv_block_size=16)
    request = memory_request(TINY, ec, dtype=torch.float32, max_seq_len=64)
    try:
        sizes = size_engine(request, ec, snap, reserve_bytes=request.activation_bytes)
    except MemoryPlanError as e:
        assert str(e)
        return
    assert sizes.num_pages >= request.pages_per_adapter and sizes.num_blocks >= 2


@FUZZ_CLI
@given(malformed_texts(), st.sampled_from([[], ["--json"], ["--local-ranks", "3", "--kv-bytes", "1GiB"]]))
def test_fuzz_cli_exits_0_or_2_with_one_line_and_no_traceback(text, flags):
    path = SCRATCH / "snap.json"
    path.write_text(text, errors="surrogatepass")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_memory.main(["--snapshot", str(path), *flags])  # an exception here fails the test: no traceback
    assert rc in (0, 2)
    if rc == 2:
        line = err.getvalue()
        assert line.startswith("multilora memory: ") and line.count("\n") == 1, line
        if "memory snapshot" in line:
            assert f"memory snapshot {path}: " in line
    else:
        assert out.getvalue() and not err.getvalue()
