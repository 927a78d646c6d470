"""The pure memory-accounting core: issue 5's worked examples, its hypothesis properties, parsing,
and the snapshot JSON round trip. Expected numbers are worked out by hand from the issue's rules."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from multilora.memory.accounting import (
    CGROUP_UNLIMITED,
    CgroupLevel,
    MemoryPlan,
    MemoryPlanError,
    MemoryPlanOptions,
    MemorySnapshot,
    cgroup_headroom,
    compute_memory_plan,
    level_headroom,
    parse_meminfo,
    reclaimable_file_bytes,
)

GiB = 1 << 30
FIXTURES = Path(__file__).parent / "fixtures" / "memory"
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: Every size a plan hands out; the properties "never increases any size" range over these.
SIZES = (
    "usable_bytes",
    "hard_budget_bytes",
    "budget_bytes",
    "device_quota_bytes",
    "adapter_pool_bytes",
    "kv_bytes",
    "host_tier_bytes",
)


def meminfo(total: int, free: int, available: int) -> str:
    """/proc/meminfo text in the kernel's layout (values in kB)."""
    rows = [
        ("MemTotal", total),
        ("MemFree", free),
        ("MemAvailable", available),
        ("Buffers", 0),
        ("Cached", available - free),
    ]
    return "".join(f"{k + ':':<16}{v // 1024:>8} kB\n" for k, v in rows) + "HugePages_Total:       0\n"


def stat(active: int = 0, inactive: int = 0, dirty: int = 0, writeback: int = 0, shmem: int = 0) -> str:
    return (
        f"anon 1048576\nfile {active + inactive + shmem}\nshmem {shmem}\nactive_file {active}\n"
        f"inactive_file {inactive}\nfile_dirty {dirty}\nfile_writeback {writeback}\nunevictable 0\n"
    )


def integrated(
    cuda_free: float, total: float, available: float | None, free: float | None = None, **kw
) -> MemorySnapshot:
    text = (
        None if available is None else meminfo(int(total * GiB), int((free or cuda_free) * GiB), int(available * GiB))
    )
    return MemorySnapshot(
        has_gpu=True,
        is_integrated=True,
        cuda_free_bytes=int(cuda_free * GiB),
        cuda_total_bytes=int(total * GiB),
        meminfo_text=text,
        **kw,
    )


def gib(n: int) -> float:
    return n / GiB


NO_POOL = MemoryPlanOptions(adapter_pool_share=0.0)


# ----------------------------------------------------------------------------------------------
# Worked examples (issue 5): GiB, fraction 0.9, adapter pool share 0, one rank.
# ----------------------------------------------------------------------------------------------


def test_example_1_integrated_uses_mem_available_not_cuda_free():
    snap = integrated(cuda_free=30, total=120, available=90, free=30)
    plan = compute_memory_plan(snap, NO_POOL)
    assert gib(plan.usable_bytes) == 90 and plan.usable_source == "mem_available"
    assert gib(plan.budget_bytes) == 81 and gib(plan.kv_bytes) == 81 and plan.adapter_pool_bytes == 0
    assert gib(plan.device_quota_bytes) == 81
    assert gib(plan.host_tier_bytes) == 4.5  # (90 - 81) / 2
    # The CUDA-free view would have given quota 27 and host tier (30 - 27) / 2 = 1.5: we are above it.
    assert plan.kv_bytes > 27 * GiB and plan.host_tier_bytes > 1.5 * GiB
    # Torch cap from the same estimate: (usable - host tier) / total = 85.5 / 120.
    assert plan.torch_memory_fraction == pytest.approx(85.5 / 120, abs=1e-6)


def test_example_2_integrated_meminfo_unreadable_falls_back_to_cuda_free():
    plan = compute_memory_plan(integrated(cuda_free=30, total=120, available=None), NO_POOL)
    assert gib(plan.usable_bytes) == 30 and plan.usable_source == "cuda_free"
    assert gib(plan.kv_bytes) == 27
    assert plan.host_tier_bytes == 0 and plan.host_tier_source == "unmeasured"
    assert plan.notes  # says why


def test_example_2_garbage_meminfo_is_unreadable_too():
    snap = dataclasses.replace(integrated(30, 120, None), meminfo_text="MemAvailable: lots\n\x00\x01")
    assert gib(compute_memory_plan(snap, NO_POOL).usable_bytes) == 30


@pytest.mark.parametrize("memlock_gib, host_tier_gib, source", [(None, 55, "mem_available"), (10, 8, "memlock")])
def test_example_3_discrete_host_tier_per_rank_and_memlock(memlock_gib, host_tier_gib, source):
    # 4 local ranks, device capacity 173 GiB, MemAvailable 440 GiB:
    # min(173, 440 / 4 x 0.5) = 55; with RLIMIT_MEMLOCK 10 GiB: 0.8 x 10 = 8.
    snap = MemorySnapshot(
        has_gpu=True,
        cuda_free_bytes=170 * GiB,
        cuda_total_bytes=173 * GiB,
        meminfo_text=meminfo(480 * GiB, 300 * GiB, 440 * GiB),
        rlimit_memlock_bytes=None if memlock_gib is None else memlock_gib * GiB,
    )
    plan = compute_memory_plan(snap, dataclasses.replace(NO_POOL, local_ranks=4))
    assert gib(plan.host_tier_bytes) == host_tier_gib and plan.host_tier_source == source
    assert gib(plan.usable_bytes) == 170  # discrete: ranks do not split the device


def test_example_3_device_capacity_bounds_the_discrete_host_tier():
    snap = MemorySnapshot(
        has_gpu=True,
        cuda_free_bytes=20 * GiB,
        cuda_total_bytes=24 * GiB,
        meminfo_text=meminfo(480 * GiB, 300 * GiB, 440 * GiB),
    )
    plan = compute_memory_plan(snap, NO_POOL)
    assert gib(plan.host_tier_bytes) == 24 and plan.host_tier_source == "device_total"


@pytest.mark.parametrize("explicit_gib, fits", [(5, True), (9, True), (20, False)])
def test_example_4_explicit_host_tier_on_shared_memory(explicit_gib, fits):
    snap = integrated(cuda_free=30, total=120, available=90, free=30)
    options = dataclasses.replace(NO_POOL, host_tier_bytes=explicit_gib * GiB)
    if fits:  # 81 + 5 <= 90
        plan = compute_memory_plan(snap, options)
        assert gib(plan.host_tier_bytes) == explicit_gib and plan.host_tier_source == "explicit"
    else:  # 81 + 20 = 101 > 90
        with pytest.raises(MemoryPlanError, match="over-commits") as e:
            compute_memory_plan(snap, options)
        assert gib(e.value.fits_bytes) == 9 and e.value.source == "mem_available"
        assert f"= {101 * GiB} B > {90 * GiB} B" in str(e.value)  # 81 + 20 = 101 > 90


def test_example_4_explicit_host_tier_on_discrete_is_honoured():
    snap = MemorySnapshot(
        has_gpu=True,
        cuda_free_bytes=70 * GiB,
        cuda_total_bytes=80 * GiB,
        meminfo_text=meminfo(64 * GiB, 10 * GiB, 20 * GiB),
    )
    plan = compute_memory_plan(snap, dataclasses.replace(NO_POOL, host_tier_bytes=30 * GiB))
    assert gib(plan.host_tier_bytes) == 30
    # past the 20 GiB available: honoured (a cap, filled as adapters arrive), with a note that filling it runs out
    (note,) = [n for n in plan.notes if "host memory available" in n]
    assert f"exceeds the host memory available ({20 * GiB} B, mem_available)" in note and "host_adapter_bytes" in note
    # within it, or split over fewer ranks than would exceed it: no such note
    assert not [n for n in compute_memory_plan(snap, dataclasses.replace(NO_POOL, host_tier_bytes=19 * GiB)).notes
                if "host memory available" in n]
    two = compute_memory_plan(snap, dataclasses.replace(NO_POOL, host_tier_bytes=12 * GiB, local_ranks=2))
    assert [n for n in two.notes if "x 2 rank(s) exceeds the host memory available" in n]


def test_explicit_host_tier_beyond_memlock_is_honoured_with_a_note():
    snap = MemorySnapshot(
        has_gpu=True,
        cuda_free_bytes=70 * GiB,
        cuda_total_bytes=80 * GiB,
        meminfo_text=meminfo(64 * GiB, 10 * GiB, 20 * GiB),
        rlimit_memlock_bytes=GiB,
    )
    plan = compute_memory_plan(snap, dataclasses.replace(NO_POOL, host_tier_bytes=2 * GiB))
    assert plan.host_tier_bytes == 2 * GiB and any("RLIMIT_MEMLOCK" in n for n in plan.notes)


def test_an_integrated_gpus_host_tier_past_memlock_is_noted():
    """An integrated GPU's host arena is registered with CUDA too, so a host tier (automatic: example 1's 4.5 GiB, or
    explicit) past RLIMIT_MEMLOCK gets the note a discrete GPU's explicit tier gets; the tier itself is unchanged
    (the automatic bound 0.8 x RLIMIT_MEMLOCK is a discrete GPU's), and a limit above it, or none, says nothing."""
    for memlock, noted in ((8 << 20, True), (8 * GiB, False), (None, False)):
        snap = integrated(cuda_free=30, total=120, available=90, rlimit_memlock_bytes=memlock)
        plan = compute_memory_plan(snap, NO_POOL)
        assert plan.host_tier_bytes == int(4.5 * GiB)
        notes = [n for n in plan.notes if "RLIMIT_MEMLOCK" in n]
        assert bool(notes) == noted, (memlock, plan.notes)
        if noted:
            assert notes[0].startswith(f"host tier {int(4.5 * GiB)} B exceeds RLIMIT_MEMLOCK ({8 << 20} B)")
        explicit = compute_memory_plan(snap, dataclasses.replace(NO_POOL, host_tier_bytes=5 * GiB))
        assert bool([n for n in explicit.notes if n.startswith("explicit host tier 5368709120 B exceeds "
                                                                 "RLIMIT_MEMLOCK")]) == noted


def test_an_integrated_plan_that_leaves_the_os_little_says_so():
    """On an integrated GPU the OS, the page cache and the process's CPU side get what the quota and the host tier
    leave of the shared memory; under ``SHARED_LEFT_NOTE_BYTES`` (fraction 1 on a GB10-like board, a Jetson-class
    one at the default fraction) the plan says how much is left and what to lower. Example 1 leaves 4.5 GiB: no
    note."""
    from multilora.memory.accounting import SHARED_LEFT_NOTE_BYTES

    def left_notes(plan):
        return [n for n in plan.notes if "of the shared memory to the OS" in n]

    assert not left_notes(compute_memory_plan(integrated(cuda_free=30, total=120, available=90), NO_POOL))
    full = compute_memory_plan(integrated(cuda_free=30, total=120, available=90),
                               dataclasses.replace(NO_POOL, fraction=1.0))
    (note,) = left_notes(full)
    assert full.host_tier_bytes == 0 and note.startswith("the plan leaves 0 B (0.00 GiB) of the shared memory")
    assert "lower the fraction (1.0)" in note
    orin = compute_memory_plan(integrated(cuda_free=5, total=7.4, available=6), NO_POOL)  # an 8 GB board
    left = 6 * GiB - orin.device_quota_bytes - orin.host_tier_bytes
    assert 0 < left < SHARED_LEFT_NOTE_BYTES and left_notes(orin)[0].startswith(f"the plan leaves {left} B")


def test_example_5_live_state_minimum_above_hard_budget_raises():
    snap = integrated(cuda_free=30, total=120, available=None)  # usable 30, fractioned budget 27
    options = dataclasses.replace(NO_POOL, min_adapter_pool_bytes=1 * GiB, min_kv_bytes=30 * GiB)
    with pytest.raises(MemoryPlanError) as e:
        compute_memory_plan(snap, options)
    assert e.value.needed_bytes == 31 * GiB and e.value.fits_bytes == 30 * GiB
    assert e.value.source == "cuda_free"
    assert "does not fit" in str(e.value) and "cuda_free" in str(e.value) and "30.00 GiB" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_example_5_live_state_minimum_between_budgets_lifts_the_budget():
    snap = integrated(cuda_free=30, total=120, available=None)
    options = dataclasses.replace(NO_POOL, min_adapter_pool_bytes=1 * GiB, min_kv_bytes=27 * GiB)
    plan = compute_memory_plan(snap, options)
    assert gib(plan.budget_bytes) == 28 and plan.budget_source == "live_state_minimum"
    assert gib(plan.adapter_pool_bytes) == 1 and gib(plan.kv_bytes) == 27


def test_example_5_reserve_lowers_the_hard_budget():
    snap = integrated(cuda_free=30, total=120, available=None)
    options = dataclasses.replace(NO_POOL, non_kv_reserve_bytes=5 * GiB, min_kv_bytes=26 * GiB)
    with pytest.raises(MemoryPlanError) as e:
        compute_memory_plan(snap, options)
    assert e.value.fits_bytes == 25 * GiB


# ----------------------------------------------------------------------------------------------
# Splits, caps, the no-GPU host, local ranks.
# ----------------------------------------------------------------------------------------------


def test_adapter_pool_share_and_caps():
    snap = MemorySnapshot(has_gpu=True, cuda_free_bytes=50 * GiB, cuda_total_bytes=80 * GiB)
    plan = compute_memory_plan(snap, MemoryPlanOptions())  # share 0.1 of 45
    assert gib(plan.adapter_pool_bytes) == 4.5 and gib(plan.kv_bytes) == 40.5
    capped = compute_memory_plan(snap, MemoryPlanOptions(max_adapter_pool_bytes=GiB, max_kv_bytes=10 * GiB))
    assert gib(capped.adapter_pool_bytes) == 1 and capped.adapter_pool_source == "user_cap"
    assert gib(capped.kv_bytes) == 10 and capped.kv_source == "user_cap"
    total = compute_memory_plan(snap, MemoryPlanOptions(max_total_bytes=20 * GiB))
    assert gib(total.budget_bytes) == 20 and total.budget_source == "user_cap"
    assert gib(total.adapter_pool_bytes) == 2 and gib(total.kv_bytes) == 18


def test_kv_need_gives_what_kv_cannot_use_to_the_pool():
    """``kv_need_bytes`` (an engine's max_batch_size sequences of max_seq_len, with adapter_pool_fill): KV gets at
    most that, the pool the rest of the budget; a user's KV cap below it leaves its remainder free; the pool's own
    cap still applies; a need above KV's share changes nothing; the live state's KV stays."""
    snap = MemorySnapshot(has_gpu=True, cuda_free_bytes=50 * GiB, cuda_total_bytes=80 * GiB)  # budget 45
    plan = compute_memory_plan(snap, MemoryPlanOptions(kv_need_bytes=10 * GiB))
    assert gib(plan.kv_bytes) == 10 and gib(plan.adapter_pool_bytes) == 35
    assert plan.kv_source == plan.adapter_pool_source == "kv_need"
    capped = compute_memory_plan(snap, MemoryPlanOptions(kv_need_bytes=10 * GiB, max_kv_bytes=5 * GiB))
    assert gib(capped.kv_bytes) == 5 and capped.kv_source == "user_cap" and gib(capped.adapter_pool_bytes) == 35
    pool_cap = compute_memory_plan(snap, MemoryPlanOptions(kv_need_bytes=10 * GiB, max_adapter_pool_bytes=20 * GiB))
    assert gib(pool_cap.adapter_pool_bytes) == 20 and pool_cap.adapter_pool_source == "user_cap"
    assert gib(pool_cap.kv_bytes) == 10
    big = compute_memory_plan(snap, MemoryPlanOptions(kv_need_bytes=41 * GiB))
    plain = compute_memory_plan(snap, MemoryPlanOptions())
    assert (big.adapter_pool_bytes, big.kv_bytes) == (plain.adapter_pool_bytes, plain.kv_bytes)
    floor = compute_memory_plan(snap, MemoryPlanOptions(kv_need_bytes=GiB, min_kv_bytes=2 * GiB))
    assert gib(floor.kv_bytes) == 2 and gib(floor.adapter_pool_bytes) == 43
    assert plan.device_quota_bytes == plain.device_quota_bytes  # the device takes what it was promised, no more


def test_pool_is_lifted_to_one_adapter_and_caps_below_the_live_state_raise():
    snap = MemorySnapshot(has_gpu=True, cuda_free_bytes=10 * GiB, cuda_total_bytes=80 * GiB)
    options = MemoryPlanOptions(adapter_pool_share=0.0, min_adapter_pool_bytes=2 * GiB)
    plan = compute_memory_plan(snap, options)
    assert gib(plan.adapter_pool_bytes) == 2 and plan.adapter_pool_source == "live_state_minimum"
    assert gib(plan.kv_bytes) == 7
    with pytest.raises(MemoryPlanError, match="adapter pool cap"):
        compute_memory_plan(snap, dataclasses.replace(options, max_adapter_pool_bytes=GiB))
    with pytest.raises(MemoryPlanError, match="total cap"):
        compute_memory_plan(snap, dataclasses.replace(options, max_total_bytes=GiB))


@pytest.mark.parametrize(
    "cap, words",
    [
        ({"max_adapter_pool_bytes": GiB}, [
            "max_adapter_pool_bytes", "--adapter-pool-bytes", "min_adapter_pool_bytes", "--min-adapter-bytes",
            "the largest adapter max_lora_rank allows", f"at least {2 * GiB} B",
            "layers x sum over the target modules of ceil(max_lora_rank x (d_in + d_out) / 64) pages x page bytes"]),
        ({"max_kv_bytes": GiB}, [
            "max_kv_bytes", "--kv-bytes", "min_kv_bytes", "--min-kv-bytes", f"at least {3 * GiB} B",
            "ceil(max_seq_len / kv_block_size) + 1"]),
        ({"max_total_bytes": GiB}, ["max_total_bytes", "--total-bytes", f"at least {5 * GiB} B"]),
    ],
    ids=["adapter pool", "KV", "total"],
)
def test_a_cap_below_the_live_state_names_the_option_the_flag_and_how_the_minimum_is_made(cap, words):
    # Issue 15 item 12: the message says which option (and `multilora memory` flag) to change, and how the
    # engine computes the minimum it is compared with.
    snap = MemorySnapshot(has_gpu=True, cuda_free_bytes=10 * GiB, cuda_total_bytes=80 * GiB)
    options = MemoryPlanOptions(min_adapter_pool_bytes=2 * GiB, min_kv_bytes=3 * GiB, **cap)
    with pytest.raises(MemoryPlanError) as err:
        compute_memory_plan(snap, options)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_no_gpu_plans_from_host_memory_and_cgroup():
    limit, usage = 16 * GiB, 10 * GiB
    level = CgroupLevel("/job", str(limit), str(usage), stat(active=GiB, inactive=3 * GiB, dirty=GiB))
    snap = MemorySnapshot(has_gpu=False, meminfo_text=meminfo(64 * GiB, 20 * GiB, 40 * GiB), cgroup_v2=(level,))
    plan = compute_memory_plan(snap, NO_POOL)
    assert plan.kind == "host" and plan.torch_memory_fraction is None
    assert gib(plan.usable_bytes) == 9 and plan.usable_source == "cgroup:/job"  # 16 - 10 + (1 + 3 - 1)
    assert gib(plan.device_total_bytes) == 64


def test_no_gpu_without_mem_available_uses_mem_free_and_without_meminfo_refuses():
    snap = MemorySnapshot(has_gpu=False, meminfo_text=(FIXTURES / "meminfo_no_memavailable.txt").read_text())
    plan = compute_memory_plan(snap, NO_POOL)
    assert plan.usable_source == "mem_free" and plan.usable_bytes == 5123456 * 1024
    with pytest.raises(MemoryPlanError, match="unmeasured"):
        compute_memory_plan(MemorySnapshot(has_gpu=False), dataclasses.replace(NO_POOL, min_kv_bytes=1))


def test_local_ranks_share_an_integrated_device():
    plan = compute_memory_plan(integrated(30, 120, 90), dataclasses.replace(NO_POOL, local_ranks=2))
    assert gib(plan.usable_bytes) == 45 and gib(plan.device_quota_bytes) == 40.5
    assert gib(plan.host_tier_bytes) == 2.25  # (90 / 2 - 40.5) / 2
    assert 2 * (plan.device_quota_bytes + plan.host_tier_bytes) <= 90 * GiB


def test_integrated_cgroup_headroom_is_applied_after_the_cuda_free_fallback():
    # Issue 15 item 11 (TensorRT-LLM's final rule): a finite cgroup bound comes last, so a larger CUDA-free
    # reading cannot override it: CUDA free 20, cgroup headroom 10 (16 - 6) gives 10, not 20.
    ctr = CgroupLevel("/ctr", str(16 * GiB), str(6 * GiB), None)
    plan = compute_memory_plan(integrated(cuda_free=20, total=120, available=90, cgroup_v2=(ctr,)), NO_POOL)
    assert gib(plan.usable_bytes) == 10 and plan.usable_source == "cgroup:/ctr" and gib(plan.kv_bytes) == 9
    # MemAvailable unreadable: CUDA free is the fallback, and the cgroup still bounds it.
    plan = compute_memory_plan(integrated(cuda_free=20, total=120, available=None, cgroup_v2=(ctr,)), NO_POOL)
    assert gib(plan.usable_bytes) == 10 and plan.usable_source == "cgroup:/ctr"
    # A looser cgroup leaves CUDA free the floor against a smaller MemAvailable.
    loose = CgroupLevel("/ctr", str(64 * GiB), str(4 * GiB), None)
    plan = compute_memory_plan(integrated(cuda_free=20, total=120, available=15, cgroup_v2=(loose,)), NO_POOL)
    assert gib(plan.usable_bytes) == 20 and plan.usable_source == "cuda_free"


def test_a_cgroup_under_the_cuda_free_floor_can_leave_ram_to_the_host_tier():
    """CUDA free 50 GiB above MemAvailable 40 (an AMD APU): the quota comes from CUDA free and takes all the RAM,
    host tier 0. A 30 GiB cgroup cuts the quota below MemAvailable, so RAM is left and the host tier grows (found
    by the cgroup-ancestor property): by design, the tier is pinned RAM; what the rank claims in all shrinks."""
    free = compute_memory_plan(integrated(cuda_free=50, total=64, available=40), NO_POOL)
    boxed = compute_memory_plan(integrated(cuda_free=50, total=64, available=40, cgroup_v2=(
        CgroupLevel("/ctr", str(30 * GiB), "0", None),)), NO_POOL)
    assert free.host_tier_bytes == 0 and boxed.host_tier_bytes > 0
    assert boxed.device_quota_bytes + boxed.host_tier_bytes <= 30 * GiB
    assert boxed.device_quota_bytes + boxed.host_tier_bytes < free.device_quota_bytes + free.host_tier_bytes


def test_amd_apu_driver_free_above_mem_available_takes_the_max():
    plan = compute_memory_plan(integrated(cuda_free=50, total=64, available=40), NO_POOL)
    assert gib(plan.usable_bytes) == 50 and plan.usable_source == "cuda_free"
    assert plan.host_tier_bytes == 0 and plan.host_tier_source == "device_quota"


def test_explain_names_sizes_sources_and_inputs():
    level = CgroupLevel("/a", "max", None, None)
    text = compute_memory_plan(integrated(30, 120, 90, cgroup_v2=(level,)), NO_POOL).explain()
    for needle in (
        "KV cache",
        "81.00 GiB",
        "86,973,087,744 B",
        "bound by mem_available",
        "host tier",
        "MemAvailable",
        "cgroup:/a",
        "unlimited",
        "fraction 0.9",
        "torch memory fraction",
    ):
        assert needle in text, needle


def test_options_are_validated_naming_the_argument():
    for kwargs, name in [
        ({"fraction": 0.0}, "fraction"),
        ({"fraction": 1.5}, "fraction"),
        ({"local_ranks": 0}, "local_ranks"),
        ({"max_kv_bytes": -1}, "max_kv_bytes"),
        ({"adapter_pool_share": 2.0}, "adapter_pool_share"),
        ({"max_kv_source": "batch"}, "max_kv_source"),
    ]:
        with pytest.raises(ValueError, match=name):
            MemoryPlanOptions(**kwargs)


# ----------------------------------------------------------------------------------------------
# Parsing and cgroup headroom.
# ----------------------------------------------------------------------------------------------


def test_parse_real_meminfo_fixtures():
    info = parse_meminfo((FIXTURES / "meminfo_integrated_after_60g_write.txt").read_text())
    assert info["MemAvailable"] == 121320243 * 1024 and info["MemFree"] == 43515904 * 1024
    assert "HugePages_Total" not in info  # not a kB line
    host = parse_meminfo((FIXTURES / "meminfo_x86_container.txt").read_text())
    assert {"MemTotal", "MemFree", "MemAvailable"} <= host.keys()
    assert parse_meminfo(None) == {} and parse_meminfo("garbage\n\x00") == {}


def test_gb10_measurement_from_the_reference():
    # Reference measurement on a GB10 after a 60 GiB write: CUDA free 41.5, MemAvailable 115.7 GiB.
    text = (FIXTURES / "meminfo_integrated_after_60g_write.txt").read_text()
    snap = MemorySnapshot(
        has_gpu=True,
        is_integrated=True,
        cuda_free_bytes=int(41.5 * GiB),
        cuda_total_bytes=int(119.7 * GiB),
        meminfo_text=text,
    )
    plan = compute_memory_plan(snap)
    assert plan.usable_bytes == 121320243 * 1024 and plan.usable_source == "mem_available"


@pytest.mark.parametrize(
    "limit, usage, stat_text, expected",
    [
        (None, None, None, None),  # no memory.max (root, or controller not enabled): no limit here
        ("max\n", "123\n", None, None),
        ("9223372036854771712\n", "5", None, None),  # cgroup v1 "unlimited"
        (str(CGROUP_UNLIMITED), "5", None, None),
        (str(10 * GiB), str(4 * GiB), None, 6 * GiB),  # no memory.stat: no reclaim credit
        (str(10 * GiB), str(4 * GiB), stat(active=GiB, inactive=GiB, dirty=GiB // 2), int(7.5 * GiB)),
        (str(10 * GiB), str(4 * GiB), stat(shmem=3 * GiB), 6 * GiB),  # shmem never counts
        (str(10 * GiB), None, None, 0),  # finite limit, usage unreadable: zero headroom
        (str(10 * GiB), "garbage", None, 0),
        ("garbage", str(GiB), None, 0),  # malformed limit: zero headroom (applied last, also on integrated GPUs)
        (str(4 * GiB), str(6 * GiB), None, 0),  # over the limit
        (str(4 * GiB), str(2 * GiB), stat(active=2 * GiB, inactive=9 * GiB), 4 * GiB),  # never above the limit
    ],
)
def test_level_headroom(limit, usage, stat_text, expected):
    got = level_headroom(CgroupLevel("/x", limit, usage, stat_text), "cgroup")
    assert (None if got is None else got.value) == expected


def test_reclaimable_reads_v2_and_v1_names():
    assert reclaimable_file_bytes(stat(active=5, inactive=7, dirty=2, writeback=1)) == 9
    v1 = "total_active_file 50\ntotal_inactive_file 70\ntotal_dirty 20\ntotal_writeback 10\nactive_file 1\n"
    assert reclaimable_file_bytes(v1) == 90
    assert reclaimable_file_bytes("active_file 5\ninactive_file x\n") == 0 and reclaimable_file_bytes(None) == 0


def test_nested_cgroups_take_the_minimum_headroom():
    levels = (
        CgroupLevel("/a/b", "max", str(GiB), stat()),
        CgroupLevel("/a", str(20 * GiB), str(15 * GiB), stat(inactive=2 * GiB)),
        CgroupLevel("/", None, str(50 * GiB), None),
    )
    plan = compute_memory_plan(integrated(10, 120, 90, cgroup_v2=levels), NO_POOL)
    assert gib(plan.usable_bytes) == 7 and plan.usable_source == "cgroup:/a"  # the cgroup bound comes last
    plan = compute_memory_plan(integrated(5, 120, 90, cgroup_v2=levels), NO_POOL)
    assert gib(plan.usable_bytes) == 7 and plan.usable_source == "cgroup:/a"


# ----------------------------------------------------------------------------------------------
# Snapshot JSON.
# ----------------------------------------------------------------------------------------------


def test_snapshot_json_round_trip_and_versioning():
    import json

    snap = integrated(
        30,
        120,
        90,
        cgroup_v2=(CgroupLevel("/a", "max", "1", stat()),),
        cgroup_v1=(CgroupLevel("/b", str(1 << 62), "5", None),),
        rlimit_memlock_bytes=8 << 20,
    )
    d = json.loads(json.dumps(snap.to_dict()))
    assert d["schema"] == "multilora-memory-snapshot" and d["schema_version"] == 1
    assert MemorySnapshot.from_dict(d) == snap
    with pytest.raises(ValueError, match="schema_version"):
        MemorySnapshot.from_dict({**d, "schema_version": 2})
    with pytest.raises(ValueError, match="schema"):
        MemorySnapshot.from_dict({**d, "schema": "something else"})
    with pytest.raises(ValueError, match="cuda_free_bytes"):
        MemorySnapshot.from_dict({**d, "cuda_free_bytes": "30GiB"})
    with pytest.raises(ValueError, match=r"cgroup_v2\[0\]\.limit: expected text or null, got 5"):
        MemorySnapshot.from_dict({**d, "cgroup_v2": [{"path": "/a", "limit": 5}]})


# ----------------------------------------------------------------------------------------------
# Hypothesis properties.
# ----------------------------------------------------------------------------------------------

byte_counts = st.integers(min_value=0, max_value=1 << 41)


@st.composite
def stats(draw) -> str | None:
    if draw(st.booleans()):
        return None
    a, i, d, w = (draw(st.integers(0, 1 << 36)) for _ in range(4))
    return stat(active=a, inactive=i, dirty=d, writeback=w)


@st.composite
def cgroup_levels(draw, numeric: bool = False) -> CgroupLevel:
    limits = st.integers(0, 1 << 41).map(str)
    if not numeric:
        limits = st.one_of(limits, st.sampled_from([None, "max", "garbage", str(1 << 61)]))
    usage = st.integers(0, 1 << 41).map(str)
    if not numeric:
        usage = st.one_of(usage, st.sampled_from([None, "x"]))
    return CgroupLevel(path=f"/l{draw(st.integers(0, 9))}", limit=draw(limits), usage=draw(usage), stat=draw(stats()))


@st.composite
def snapshots(draw, kind: str | None = None) -> MemorySnapshot:
    kind = kind or draw(st.sampled_from(["discrete", "integrated", "host"]))
    total = draw(st.integers(1 << 30, 1 << 41))
    free = draw(st.integers(0, total))
    text = None
    if draw(st.integers(0, 4)) > 0:
        host_total = draw(st.integers(1 << 30, 1 << 41))
        text = meminfo(host_total, draw(st.integers(0, host_total)), draw(st.integers(0, host_total)))
    gpu = kind != "host"
    return MemorySnapshot(
        has_gpu=gpu,
        is_integrated=kind == "integrated",
        cuda_free_bytes=free if gpu else None,
        cuda_total_bytes=total if gpu else None,
        torch_reserved_bytes=draw(st.integers(0, total - free)) if gpu else 0,
        meminfo_text=text,
        cgroup_v2=tuple(draw(st.lists(cgroup_levels(), max_size=3))),
        cgroup_v1=tuple(draw(st.lists(cgroup_levels(), max_size=2))),
        rlimit_memlock_bytes=draw(st.one_of(st.none(), byte_counts)),
    )


@st.composite
def options(draw, explicit_host: bool = False, caps: bool = True) -> MemoryPlanOptions:
    small = st.one_of(st.just(0), st.integers(0, 1 << 31))
    maybe_cap = st.one_of(st.none(), byte_counts) if caps else st.none()
    return MemoryPlanOptions(
        fraction=draw(st.floats(0.05, 1.0)),
        adapter_pool_share=draw(st.floats(0.0, 1.0)),
        non_kv_reserve_bytes=draw(small),
        min_adapter_pool_bytes=draw(small),
        min_kv_bytes=draw(small),
        max_adapter_pool_bytes=draw(maybe_cap),
        max_kv_bytes=draw(maybe_cap),
        max_total_bytes=draw(maybe_cap),
        host_tier_bytes=draw(st.one_of(st.none(), st.integers(0, 1 << 33))) if explicit_host else None,
        local_ranks=draw(st.integers(1, 8)),
        kv_need_bytes=draw(st.one_of(st.none(), byte_counts)),
    )


def plan_or_none(snap: MemorySnapshot, opts: MemoryPlanOptions) -> MemoryPlan | None:
    try:
        return compute_memory_plan(snap, opts)
    except MemoryPlanError:
        return None


def sizes(plan: MemoryPlan) -> dict[str, int]:
    return {k: getattr(plan, k) for k in SIZES}


@PROPERTY
@given(snapshots(), options(explicit_host=True))
def test_prop_sizes_are_ordered_non_negative_integers(snap, opts):
    plan = plan_or_none(snap, opts)
    assume(plan is not None)
    for name, value in sizes(plan).items():
        assert isinstance(value, int) and value >= 0, name
    assert plan.adapter_pool_bytes + plan.kv_bytes <= plan.budget_bytes <= plan.usable_bytes <= plan.device_total_bytes
    assert plan.adapter_pool_bytes >= opts.min_adapter_pool_bytes and plan.kv_bytes >= opts.min_kv_bytes
    assert plan.torch_memory_fraction is None or 0.0 <= plan.torch_memory_fraction <= 1.0


DEVICE_FIELDS = (
    "usable_bytes",
    "usable_source",
    "budget_bytes",
    "budget_source",
    "adapter_pool_bytes",
    "kv_bytes",
    "device_quota_bytes",
    "torch_memory_fraction",
)


@PROPERTY
@given(snapshots("discrete"), snapshots("discrete"), options(caps=False))
def test_prop_discrete_device_sizes_ignore_meminfo_and_cgroups(snap, other, opts):
    moved = dataclasses.replace(
        snap, meminfo_text=other.meminfo_text, cgroup_v2=other.cgroup_v2, cgroup_v1=other.cgroup_v1
    )
    a, b = plan_or_none(snap, opts), plan_or_none(moved, opts)
    assert (a is None) == (b is None)
    if a is not None:
        assert [getattr(a, f) for f in DEVICE_FIELDS] == [getattr(b, f) for f in DEVICE_FIELDS]


@PROPERTY
@given(snapshots("integrated"), st.integers(1, 8))
def test_prop_integrated_usable_at_least_cuda_free_within_the_cgroup(snap, ranks):
    plan = compute_memory_plan(snap, MemoryPlanOptions(local_ranks=ranks))
    room = cgroup_headroom(snap)
    bound = snap.cuda_free_bytes if room is None else min(snap.cuda_free_bytes, room.value)
    assert plan.usable_bytes >= bound // ranks
    if room is not None:  # a finite cgroup bound is applied last: CUDA free never lifts usable above it
        assert plan.usable_bytes <= room.value // ranks


@st.composite
def numeric_inputs(draw) -> dict:
    """Numbers a snapshot is built from by ``build``: one integrated (or host) device, a 2-level cgroup."""
    total = draw(st.integers(1 << 34, 1 << 40))
    n = st.integers(0, 1 << 38)
    return {
        "kind": draw(st.sampled_from(["integrated", "host"])),
        "total": total,
        "cuda_free": draw(st.integers(0, total // 2)),
        "mem_available": draw(n),
        "limit": draw(n),
        "current": draw(n),
        "active": draw(n),
        "inactive": draw(n),
        "dirty": draw(n),
        "writeback": draw(n),
        "parent_limit": draw(st.one_of(st.just("max"), n.map(str))),
        "ranks": draw(st.integers(1, 8)),
    }


def build(v: dict) -> tuple[MemorySnapshot, MemoryPlanOptions]:
    leaf = CgroupLevel(
        "/job/step", str(v["limit"]), str(v["current"]), stat(v["active"], v["inactive"], v["dirty"], v["writeback"])
    )
    parent = CgroupLevel("/job", v["parent_limit"], str(v["current"]), stat())
    gpu = v["kind"] == "integrated"
    snap = MemorySnapshot(
        has_gpu=gpu,
        is_integrated=gpu,
        cuda_free_bytes=v["cuda_free"] if gpu else None,
        cuda_total_bytes=v["total"] if gpu else None,
        meminfo_text=meminfo(v["total"], 0, v["mem_available"]),
        cgroup_v2=(leaf, parent),
    )
    return snap, MemoryPlanOptions(local_ranks=v["ranks"])


#: (input, +1 if usable is non-decreasing in it, -1 if non-increasing)
MONOTONE = [
    ("cuda_free", 1),
    ("mem_available", 1),
    ("limit", 1),
    ("active", 1),
    ("inactive", 1),
    ("current", -1),
    ("dirty", -1),
    ("writeback", -1),
    ("ranks", -1),
]


@PROPERTY
@given(numeric_inputs(), st.sampled_from(MONOTONE), st.integers(1, 1 << 36))
def test_prop_usable_is_monotone_in_each_input(v, monotone, delta):
    name, direction = monotone
    bumped = {**v, name: v[name] + (delta % 8 if name == "ranks" else delta)}
    if name == "cuda_free":
        bumped[name] = min(bumped[name], v["total"])
    before = compute_memory_plan(*build(v)).usable_bytes
    after = compute_memory_plan(*build(bumped)).usable_bytes
    assert (after - before) * direction >= 0


@PROPERTY
@given(snapshots(), cgroup_levels(), options(), st.booleans())
def test_prop_adding_a_cgroup_ancestor_never_increases_any_size(snap, ancestor, opts, v1):
    field = "cgroup_v1" if v1 else "cgroup_v2"
    more = dataclasses.replace(snap, **{field: (*getattr(snap, field), ancestor)})
    a, b = plan_or_none(snap, opts), plan_or_none(more, opts)
    assert not (a is None and b is not None)
    if b is not None:
        for name, value in sizes(b).items():
            if name == "host_tier_bytes" and value > a.host_tier_bytes:
                # the one exception, by design: on an integrated GPU whose CUDA free is above MemAvailable (the
                # floor, docs/memory.md section 1) the quota comes from CUDA free but the host tier from
                # MemAvailable (pinned memory is RAM), so a cgroup that cuts the quota below that floor can leave
                # more RAM to the tier; what the rank claims in all (quota + host tier) still never grows
                assert a.kind == "integrated" and snap.cuda_free_bytes > (a.host_available_bytes or 0), a
                assert b.device_quota_bytes + value <= a.device_quota_bytes + a.host_tier_bytes
                continue
            assert value <= getattr(a, name), name


@PROPERTY
@given(
    snapshots(),
    options(caps=False),
    st.sampled_from(["max_adapter_pool_bytes", "max_kv_bytes", "max_total_bytes"]),
    byte_counts,
)
def test_prop_a_cap_never_increases_any_size(snap, opts, cap, value):
    a, b = plan_or_none(snap, opts), plan_or_none(snap, dataclasses.replace(opts, **{cap: value}))
    assert not (a is None and b is not None)
    if b is not None:
        for name, size in sizes(b).items():
            assert size <= getattr(a, name), name


@PROPERTY
@given(snapshots(), options(), byte_counts)
def test_prop_kv_need_moves_kv_slack_to_the_pool_and_nothing_else(snap, opts, need):
    """``kv_need_bytes`` against none: the pool never shrinks and KV never grows; KV is unchanged or at most
    max(need, min_kv); the budget, quota, host tier and torch fraction do not move; without caps, pool + KV is the
    whole budget either way (the slack goes to the pool, nothing is lost)."""
    a = plan_or_none(snap, dataclasses.replace(opts, kv_need_bytes=None))
    b = plan_or_none(snap, dataclasses.replace(opts, kv_need_bytes=need))
    assert (a is None) == (b is None)
    assume(a is not None)
    assert b.adapter_pool_bytes >= a.adapter_pool_bytes and b.kv_bytes <= a.kv_bytes
    assert b.kv_bytes == a.kv_bytes or b.kv_bytes <= max(need, opts.min_kv_bytes)
    for name in ("budget_bytes", "device_quota_bytes", "host_tier_bytes", "torch_memory_fraction", "usable_bytes"):
        assert getattr(b, name) == getattr(a, name), name
    if opts.max_adapter_pool_bytes is None and opts.max_kv_bytes is None:
        assert a.adapter_pool_bytes + a.kv_bytes == a.budget_bytes == b.adapter_pool_bytes + b.kv_bytes


@PROPERTY
@given(st.one_of(snapshots("integrated"), snapshots("host")), options(explicit_host=True))
def test_prop_shared_device_quotas_and_host_tiers_fit_host_memory(snap, opts):
    plan = plan_or_none(snap, opts)
    assume(plan is not None)
    committed = opts.local_ranks * (plan.device_quota_bytes + plan.host_tier_bytes)
    assert committed <= plan.shared_pool_bytes
    if not snap.cgroup_v2 and not snap.cgroup_v1:  # the pool is then known without the core's help
        info = parse_meminfo(snap.meminfo_text)
        available = min(info.get("MemAvailable", 0), snap.cuda_total_bytes or info.get("MemTotal", 0))
        assert committed <= max(snap.cuda_free_bytes or 0, available)
        if opts.host_tier_bytes is None and plan.host_tier_bytes:
            assert committed <= available
