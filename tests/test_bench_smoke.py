"""The benchmark scripts run end to end on a tiny random model (CPU), so they do not rot between GPU runs.
Numbers from these runs mean nothing; the real ones come from the H200 (bench/results/)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multilora.config import TARGET_MODULES

ROOT = Path(__file__).resolve().parents[1]


def test_adapter_throughput_bench_runs(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_adapter_throughput.py"), "--shape", "tiny", "--counts", "1,8",
           "--batch", "4", "--gen", "2", "--prompt-len", "4", "--pool-adapters", "2", "--host-adapters", "2",
           "--distinct-files", "3", "--adapter-dir", str(tmp_path / "adapters"), "--out", str(tmp_path / "out"),
           "--sample-threads", "--switch-interval", "0.002", "--read-batch-bytes", "33554432", "--check-chunk", "4096", "--urgent-read-wait", "off",
           "--adapter-pool-fill", "--pipe-piece-bytes", "1000",  # (32 MiB batches: the pipelined finish can run)
           "--parallel-finish", "on"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    rows = json.loads((tmp_path / "out" / "adapter_throughput_tiny.json").read_text())
    assert all(r["read_batch_bytes"] == 32 << 20 and r["check_chunk"] == 4096 and r["urgent_read_wait"] is False
               and r["adapter_pool_fill"] is True and r["pipe_piece_bytes"] == 1000 and r["parallel_finish"] is True
               for r in rows)  # the A/B switches
    # reads from the page cache: each went through the pipelined finish's choice and was finished serially
    assert all(r["reads_pipelined"] == 0 for r in rows) and any(r["reads_cached_serial"] > 0 for r in rows)
    assert {(r["adapters"], r["popularity"], r["phase"]) for r in rows} == {(n, p, ph) for n in (1, 8) for p in ("zipf", "uniform") for ph in ("cold", "warm")}
    assert all(r["tokens_per_s"] > 0 and r["shape"] == "tiny" for r in rows)
    # every (count, popularity) starts from an empty cache: its cold batch reads each adapter it names from disk
    cold = [r for r in rows if r["phase"] == "cold"]
    assert all(r["distinct_read_from_disk"] == r["distinct_in_batch"] and not r["keep_between_rows"] for r in cold)
    assert all(0 <= r["queue_wait_s_max"] <= r["queue_wait_s_total"] + 1e-9 for r in rows)  # (this row's requests)
    # the engine's own warm-up ran first (on this CPU it has nothing to warm: 0 s), and every row says whether
    # kernels compiled inside it
    assert all(r["warmup_seconds"] == 0 and "kernel_compiles" in r and isinstance(r["kernel_compile_names"], list)
               for r in rows)
    # where the time went: steps add up; the sampler saw the engine's (main) thread in Python files, and one
    # thread's shares of the samples add up to at most 1
    assert all(r["steps"] == r["prefill_steps"] + r["decode_steps"] + r["mixed_steps"] > 0 for r in rows)
    # (a tiny batch lasts a few ms: on a busy machine the 1 ms sampler may catch a row's engine thread 0 times, as
    # CI once saw, so every row's samples are checked where there are some, and some row must have them)
    mains = [r["thread_samples"].get("MainThread") for r in rows]
    assert any(mains), [r["thread_samples"] for r in rows]
    for main in filter(None, mains):
        assert all(".py:" in place for place, _ in main), main
        assert 0 < sum(share for _, share in main) <= 1.0 + 1e-3  # (shares rounded to 4 decimals)


@pytest.mark.parametrize("args,message", [
    (["--popularity", "zipf,foo"], "--popularity: expected comma-separated zipf / uniform, got 'zipf,foo'"),
    (["--counts", "0"], "--counts: expected comma-separated positive integers, got '0'"),
    (["--distinct-files", "-2"], "--distinct-files: expected an integer >= 0, got -2"),
    (["--batch", "0"], "--batch: expected an integer >= 1, got 0"),
    (["--out", "/proc/nope"], "--out: cannot make the directory '/proc/nope'"),
])
def test_adapter_throughput_bench_refuses_bad_flags(tmp_path, args, message):
    """Bad flags stop the run before any work, naming the flag (exit status 2), instead of a traceback or rows
    labelled with a popularity that was never drawn."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench_adapter_throughput.py"), "--shape", "tiny",
           "--out", str(tmp_path / "out"), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("file_dtype,cold", [("bfloat16", False), ("float32", False), ("bfloat16", True)])
def test_adapter_load_bench_runs(file_dtype, cold, tmp_path):
    """The tier-move bench (CPU: disk -> host only): every provider at every thread count, rates against the plain
    read of the same bytes, the cache's own stats beside, in the JSON; ``--cold`` (the files' page cache dropped
    before each run) and ``--modules`` recorded in the rows, ``image.READ_AHEAD`` as it was (off)."""
    if cold and not hasattr(os, "posix_fadvise"):
        pytest.skip("--cold needs os.posix_fadvise (Linux)")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_adapter_load.py"), "--shape", "tiny", "--rank", "4",
           "--adapters", "3", "--file-dtype", file_dtype, "--pool-dtype", "float32", "--threads", "1,2",
           "--runs", "1", "--general", "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out),
           "--pipe-piece-bytes", "1000"]
    cmd += ["--cold", "--modules", "q_proj,v_proj"] if cold else []
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads((out / "adapter_moves_tiny.json").read_text())
    got = {(r["move"], r["provider"], r.get("threads")) for r in rows}
    assert got == {("disk_to_host", name, t) for name in ("plain", "ours", "ours_readahead", "ours_split", "ours_host_finish",
                                                               "ours_host_finish_split", "ours_host_finish_pipe",
                                                               "ours_host_finish_serial", "ours_host_finish_parallel",
                                                               "ours_per_tensor", "ours_tensor_reads",
                                                               "ours_verified", "general")
                   for t in (1, 2)} | {("disk_to_host", "cache", 4)}, got
    assert all(r["gbps"] > 0 and r["file_dtype"] == file_dtype and r["adapters"] == 3 for r in rows)
    assert all(r["modules"] == (["q_proj", "v_proj"] if cold else list(TARGET_MODULES)) and r["read_ahead"] is False
               and r["split_read_threads"] == 1 and r["pipeline_piece_bytes"] == 4 << 20
               and r["pipe_piece_bytes_of_pipe_row"] == 1000 for r in rows)
    # the pipe row's 1000-byte pieces: its tiny files are in the page cache, so no read was pipelined
    # (``image.PIPELINE_COLD_ONLY``) and, in the pool dtype (the batched path, where pieces apply), each of its 3
    # reads per row was finished serially; the default's 4 MiB is one piece of these files: no decision to make
    if not cold:
        assert all(r["reads_pipelined"] == 0 for r in rows if r.get("reads_pipelined") is not None)
    for r in rows:
        if r["move"] == "disk_to_host" and r["provider"] != "cache":
            assert r["reads_cached_serial"] == (3 if r["provider"] == "ours_host_finish_pipe"
                                                and file_dtype == "float32" and not cold else 0), r
    assert all(r["cold"] is cold for r in rows if r["provider"] != "cache")
    for r in rows:
        if r["provider"] == "plain":
            assert r["vs_plain"] == 1.0
        elif r["provider"] != "cache":
            plain = next(q for q in rows if q["provider"] == "plain" and q["threads"] == r["threads"])
            assert r["vs_plain"] == pytest.approx(r["gbps"] / plain["gbps"])
    cache = next(r for r in rows if r["provider"] == "cache")
    assert cache["stats_bytes_disk_to_host"] == 3 * rows[0]["image_bytes"] and cache["stats_disk_to_host_gbps"] > 0


def test_adapter_load_bench_puts_read_image_switches_back(tmp_path):
    """The A/B providers set ``runtime.adapters.image``'s switches for their runs only: after a run on several
    threads (where a switch set per job leaked) every switch is at its default, and each provider's reads saw its
    own value (seen by a spy on ``read_image``'s fast path, which makes each read slow enough to overlap)."""
    from multilora.runtime.adapters import image

    bl = _load_bench("bench_adapter_load")
    names = ("READ_AHEAD", "_DEFER_CHECK", "_SCATTER", "PIPELINE_PIECE_BYTES", "PARALLEL_FINISH")
    before = {n: getattr(image, n) for n in names}
    seen, real = [], image._read
    mp = pytest.MonkeyPatch()

    def spy(*a, **k):  # (slow enough that the threads' reads overlap)
        seen.append(tuple(getattr(image, n) for n in names))
        time.sleep(0.01)
        return real(*a, **k)

    mp.setattr(image, "_read", spy)
    try:
        assert bl.main(["--shape", "tiny", "--rank", "4", "--adapters", "3", "--threads", "1,3", "--runs", "2",
                        "--pool-dtype", "float32", "--adapter-dir", str(tmp_path / "a")]) == 0
    finally:
        mp.undo()
    assert {n: getattr(image, n) for n in names} == before
    flips = [("READ_AHEAD", not before["READ_AHEAD"]), ("_DEFER_CHECK", not before["_DEFER_CHECK"]),
             ("_SCATTER", not before["_SCATTER"]), ("PIPELINE_PIECE_BYTES", 4 << 20),  # (the pipe row's default)
             ("PIPELINE_PIECE_BYTES", 0), ("PARALLEL_FINISH", True)]  # (the serial row, the parallel row)
    flipped = {tuple(v if n == name else before[n] for n in names) for name, v in flips}
    assert set(seen) == {tuple(before.values())} | flipped  # no read saw two switches flipped at once


def test_adapter_load_bench_pipe_row_runs_the_pipelined_finish(tmp_path):
    """The ``ours_host_finish_pipe`` row reads through the pipelined finish in pieces of ``--pipe-piece-bytes`` (a
    spy counts its pieces' finishes), the ``ours_host_finish_serial`` row never does, and the module's value is put
    back after the run."""
    from multilora.runtime.adapters import image

    bl = _load_bench("bench_adapter_load")
    calls, real = [], image._finish_piece
    mp = pytest.MonkeyPatch()
    mp.setattr(image, "_finish_piece", lambda *a: calls.append(image.PIPELINE_PIECE_BYTES) or real(*a))
    mp.setattr(image, "PIPELINE_COLD_ONLY", False)  # (the files are in the page cache)
    before = image.PIPELINE_PIECE_BYTES
    try:
        for provider in ("ours_host_finish_serial", "ours_host_finish_pipe"):
            calls.clear()
            assert bl.main(["--shape", "tiny", "--rank", "4", "--adapters", "2", "--threads", "1", "--runs", "1",
                            "--file-dtype", "float32", "--pool-dtype", "float32", "--providers", f"plain,{provider}",
                            "--no-cache-row", "--pipe-piece-bytes", "1000", "--adapter-dir", str(tmp_path / "a"),
                            "--out", str(tmp_path / provider)]) == 0
            assert (set(calls) == {1000}) if provider.endswith("pipe") else calls == []
            rows = json.loads((tmp_path / provider / "adapter_moves_tiny.json").read_text())
            (row,) = [r for r in rows if r["provider"] == provider]
            assert row["reads_pipelined"] == (2 if provider.endswith("pipe") else 0)
    finally:
        mp.undo()
    assert image.PIPELINE_PIECE_BYTES == before


def test_adapter_load_bench_refuses_unknown_modules(capsys):
    """``--modules`` names target modules: an unknown one is refused naming the flag and what it takes."""
    bl = _load_bench("bench_adapter_load")
    with pytest.raises(SystemExit):
        bl.main(["--shape", "tiny", "--modules", "q_proj,qkv_proj"])
    err = capsys.readouterr().err
    assert "--modules: expected a comma list of q_proj" in err and "'q_proj,qkv_proj'" in err


def test_adapter_load_bench_runs_chosen_providers(tmp_path, capsys):
    """``--providers`` times only the rows named (the read-ahead A/B with more runs in the same time), each row's
    ``vs_plain`` against the plain read of its thread count; ``--no-cache-row`` leaves the cache's row out; an
    unknown provider is refused naming the flag and the providers there are."""
    bl = _load_bench("bench_adapter_load")
    out = tmp_path / "out"
    assert bl.main(["--shape", "tiny", "--rank", "4", "--adapters", "2", "--threads", "1,2", "--runs", "3",
                    "--pool-dtype", "float32", "--providers", "plain,ours_readahead", "--no-cache-row",
                    "--adapter-dir", str(tmp_path / "a"), "--out", str(out)]) == 0
    rows = json.loads((out / "adapter_moves_tiny.json").read_text())
    assert sorted((r["provider"], r["threads"]) for r in rows) == [("ours_readahead", 1), ("ours_readahead", 2),
                                                                   ("plain", 1), ("plain", 2)]
    for r in rows:
        assert len(r["runs_gbps"]) == 3
        plain = next(q for q in rows if q["provider"] == "plain" and q["threads"] == r["threads"])
        assert r["vs_plain"] == pytest.approx(r["gbps"] / plain["gbps"])
    with pytest.raises(SystemExit):
        bl.main(["--shape", "tiny", "--providers", "plain,fast"])
    err = capsys.readouterr().err
    assert "--providers: expected a comma list of plain, ours" in err and "'plain,fast'" in err


def test_cold_read_patterns_bench_runs(tmp_path):
    """The cold-read probe: every pattern timed each round with its rate against the plain read's, the block
    queue's settings recorded (where the files' file system has a block device), ``image.READ_AHEAD`` put back."""
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("needs os.posix_fadvise (Linux)")
    from multilora.runtime.adapters import image

    before = image.READ_AHEAD
    cr = _load_bench("cold_read_patterns")
    out = tmp_path / "out"
    assert cr.main(["--shape", "tiny", "--rank", "4", "--adapters", "2", "--rounds", "2",
                    "--adapter-dir", str(tmp_path / "a"), "--out", str(out)]) == 0
    assert image.READ_AHEAD is before
    rows = json.loads((out / "cold_read_patterns.json").read_text())
    assert [r["pattern"] for r in rows] == ["plain", "header_then_rest", "header_then_rest_willneed",
                                            "header_then_rest_sequential", "header_then_rest_split2",
                                            "header_then_rest_split4", "ours", "ours_readahead"]
    plain = rows[0]["gbps"]
    for r in rows:
        assert len(r["runs_gbps"]) == 2 and r["gbps"] > 0 and r["vs_plain"] == pytest.approx(r["gbps"] / plain)
        assert r["bytes_per_run"] == 2 * r["file_bytes"] and set(r["queue"]) <= {*cr.QUEUE_KEYS, "device"}


def test_recapture_bench_runs(tmp_path):
    """The first-capture / recapture diagnostic: one row per phase with its TPOTs (the compile count means
    nothing on the CPU)."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_recapture.py"), "--shape", "tiny", "--device", "cpu",
           "--layers", "1", "--batch", "2", "--gen", "3", "--prompt-len", "4", "--repeats", "1", "--recaptures", "1",
           "--adapter-files", "2", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads((out / "recapture_tiny.json").read_text())["rows"]
    assert [r["phase"] for r in rows] == ["first", "recapture"]
    # a TPOT here is a difference of two CPU timings (gen tokens minus 1 token): finite, but of either sign on a busy
    # machine (CI once saw one below 0 while another process ran); its value is a GPU bench's business
    assert all(math.isfinite(r["tpot_ms"]) and r["layers"] == 1 and r["batch"] == 2 for r in rows)


def test_generate_bench_runs(tmp_path):
    """All four providers, each group in its own child process as on the GPU; fp32, so the same weights and
    adapters must give the same greedy tokens in multilora, transformers and peft."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_generate.py"), "--shape", "tiny", "--batches", "1,2",
           "--prompt-len", "8", "--gen", "3", "--peft-gen", "2", "--dtype", "float32", "--device", "cpu",
           "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny models: one intra-op thread is far faster on a shared CPU
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads((out / "generate_tiny.json").read_text())
    providers = ("multilora", "multilora-lora", "hf", "peft")
    assert sorted((r["provider"], r["batch"]) for r in rows) == sorted((q, b) for q in providers for b in (1, 2))
    for r in rows:
        assert r["status"] == "ok", (r["provider"], r["batch"], r.get("error"))
        assert r["gen"] == (2 if r["provider"] == "peft" else 3) and r["shape"] == "tiny" and r["copy_gbps"] > 0
        assert r["output_tokens_per_s"] > 0 and r["ttft_s"] > 0
        if r["provider"] in ("hf", "peft"):
            assert r["greedy_prefix_match_multilora"] == r["gen"], r
    assert "| target |" in (out / "generate_tiny.md").read_text()


def test_step_overhead_bench_runs(tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_step_overhead.py"), "--batches", "1,2", "--steps", "5",
           "--warmup", "1", "--profile", "--top", "3", "--out", str(out)]
    for mode in ("replay", "eager"):
        p = subprocess.run(cmd + ["--mode", mode], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        rows = json.loads(out.read_text())["rows"]
        assert sorted((r["batch"], r["adapters"]) for r in rows) == [(1, 0), (1, 1), (2, 0), (2, 2)]
        assert all(r["us_per_step_median"] > 0 and r["parts_us"] for r in rows)
    # batch 64 (its default's largest): 64 x 512 prompt tokens take several chunked-prefill steps, which it once timed
    # as decode steps ("a timed step was not a decode step")
    p = subprocess.run(cmd[:2] + ["--batches", "64", "--lora", "off", "--steps", "3", "--warmup", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]


def test_serving_bench_runs(tmp_path):
    """Every mode on one seeded trace: the in-process engine, the HTTP server in a child process (its engine on a
    thread of it, or in an engine process of its own) serve the same requests to the same output lengths
    (``ignore_eos``), burst and fixed-rate rows alike, none failing."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_serving.py"), "--shape", "tiny", "--adapters", "3",
           "--requests", "10", "--input-len", "4,24", "--output-len", "2,9", "--max-batch-size", "4",
           "--adapter-files", "2", "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out), "--timeout", "120",
           "--modes", "engine,http,http-engine-process"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads((out / "serving_tiny.json").read_text())["rows"]
    assert [(r["mode"], r["rate"] == "burst") for r in rows] == [
        ("engine", True), ("engine", False), ("http", True), ("http", False), ("http-engine-process", True),
        ("http-engine-process", False)]
    assert all(r["failed"] == 0 and r["requests"] == 10 for r in rows), rows
    assert len({r["output_tokens"] for r in rows}) == 1 and rows[0]["output_tokens"] >= 20
    rate = rows[0]["achieved_rps"] * 0.9  # --rate auto: 90% of the engine's burst capacity, offered to both modes
    assert all(r["offered_rps"] == pytest.approx(rate) for r in rows[1::2])
    for r in rows:
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"] and r["tpot_p50_s"] > 0
        assert (r["pool_hit_rate"] is None) == r["mode"].startswith("http")
        if r["mode"] == "engine":  # the step trace: every step timed, by kind
            d = r["decode_step_ms"]
            assert d["steps"] > 0 and 0 < d["p50"] <= d["p99"] <= d["max"] and r["stall_steps"] >= 0
            assert r["decode_steps"] == d["steps"]
            ph = r["decode_phase_ms"]  # the engine's host phases per step (StepTimes.phases_since)
            assert set(ph) == {"read_back", "schedule", "resident", "run"}
            assert all(0 <= v["p50"] <= d["max"] and v["mean"] >= 0 for v in ph.values())
            by = r["decode_step_ms_by_misses"]
            assert by["with_misses"]["steps"] + by["without_misses"]["steps"] == d["steps"]
            assert isinstance(r["stalls"], list) and len(r["stalls"]) <= r["stall_steps"]
            assert r["host_arena_chunks"] >= 0 and r["host_arena_map_seconds"] >= 0  # (the tier's growth in the row)
            split = r["ttft_split"]  # the engine's own times: every request, the parts in order of a TTFT
            assert split["all"]["requests"] == 10 and 0 <= split["all"]["queue_p50_s"] <= r["ttft_p99_s"]
            assert sum(t["requests"] for t in split["by_tier"].values()) == 10
        else:
            assert r["ttft_split"] is None
    assert "| http | apart | 3 | S1 | burst |" in (out / "serving_tiny.md").read_text()
    burst, fixed = rows[0::2], rows[1::2]  # every mode replayed the same trace at each rate
    assert len({r["trace_digest"] for r in burst}) == len({r["trace_digest"] for r in fixed}) == 1
    assert all(r["trace_span_s"] == 0 for r in burst) and all(r["trace_span_s"] > 0 for r in fixed)
    for r in rows:  # the first N's rows are their own SLO reference (issue 13: 5x its TTFT p50, 2x its TPOT p50)
        assert r["slo_ttft_s"] == pytest.approx(5 * r["ttft_p50_s"]) and r["slo_tpot_s"] == pytest.approx(2 * r["tpot_p50_s"])
        assert 0 <= r["slo_share"] <= 1
    for r in rows:  # issue 13's key names, a contract: present, and the same figures
        assert {"device", "adapter_set", "num_adapters", "popularity", "request_rate", "throughput_req_s",
                "output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "slo_attainment"} <= set(r)
        assert r["num_adapters"] == 3 and r["throughput_req_s"] == r["achieved_rps"]
        assert r["tpot_p50_ms"] == pytest.approx(1e3 * r["tpot_p50_s"]) and r["slo_attainment"] == r["slo_share"]
        assert r["request_rate"] == (None if r["rate"] == "burst" else pytest.approx(r["offered_rps"]))


def test_serving_bench_unified_pool_rows(tmp_path):
    """``--unified-pool off,on``: per N, rows of an engine with the pool and KV cache apart and of one with them in one
    buffer of the same bytes (``Engine(unified_pool=True)``), on the same trace and rate: same outputs, none
    failing, and the unified rows say where the boundary moved."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_serving.py"), "--shape", "tiny", "--adapters", "6",
           "--requests", "12", "--input-len", "4,24", "--output-len", "2,9", "--max-batch-size", "4",
           "--adapter-files", "2", "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out), "--modes", "engine",
           "--unified-pool", "off,on", "--warmup-requests", "8", "--urgent-read-wait", "off", "--adapter-pool-fill",
           "--adapter-finish", "device", "--host-arena-chunk-bytes", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads((out / "serving_tiny.json").read_text())["rows"]
    assert [(r["unified_pool"], r["rate"] == "burst") for r in rows] == [(False, True), (False, False),
                                                                         (True, True), (True, False)]
    assert all(r["failed"] == 0 for r in rows) and len({r["output_tokens"] for r in rows}) == 1
    assert rows[1]["offered_rps"] == pytest.approx(rows[3]["offered_rps"])
    assert [r["urgent_read_wait"] for r in rows] == [False] * 4  # --urgent-read-wait off, recorded per row
    assert [(r["adapter_pool_fill"], r["adapter_finish"], r["host_arena_chunk_bytes"]) for r in rows] == [
        (True, "device", 1)] * 4
    assert all(r["unified_floor_moves_up"] is None for r in rows[:2])
    assert all(r["unified_floor_moves_up"] is not None and r["adapters_resident_end"] >= 1 for r in rows[2:])
    assert "| engine | unified | 6 | S1 |" in (out / "serving_tiny.md").read_text()


def test_serving_bench_slo_share():
    """``slo_share`` by hand: TTFT from the scheduled arrival, TPOT over the tokens after the first, failures miss."""
    bs = _load_bench("bench_serving")
    R = bs.Result
    results = [R(0.0, first=0.5, end=1.5, tokens=11),   # TTFT 0.5, TPOT 0.1: in
               R(1.0, first=2.1, end=2.2, tokens=2),    # TTFT 1.1: out
               R(2.0, first=2.2, end=4.2, tokens=11),   # TPOT 0.2: out
               R(3.0, first=3.1, end=3.1, tokens=1),    # one token (no TPOT): in
               R(4.0, error="boom")]                    # failed: out
    assert bs.slo_share(results, ttft_max=1.0, tpot_max=0.15) == pytest.approx(2 / 5)
    assert bs.slo_share(results, None, 0.1) is None
    # under load: arrivals span [0, 4]; tokens inside it: 11 (0.5..1.5), 2 (2.1..2.2), 11 * 1.8 / 2 (2.2..4.2 cut at
    # 4.0), 1 (at 3.1); at t = 4 the requests arrived at 2.0 (ends 4.2) and 4.0 (failed: never ended) are unfinished
    got = bs.under_load(results)
    assert got["output_tok_s_under_load"] == pytest.approx((11 + 2 + 11 * 1.8 / 2 + 1) / 4)
    assert got["backlog_at_last_arrival"] == 2
    assert bs.under_load([R(0.0, first=1, end=2, tokens=3)] * 2) == {"output_tok_s_under_load": None,
                                                                      "backlog_at_last_arrival": None}


def test_serving_bench_ttft_split():
    """``ttft_split`` by hand: percentiles of the submit / queue / prefill parts for all requests and for those over
    the TTFT bound, and per adapter tier at submission the TTFT percentiles and the share within the bound; rows
    without the engine's times (HTTP) give None."""
    bs = _load_bench("bench_serving")
    R = bs.Result
    rs = [R(0.0, first=0.05, end=1, tokens=5, submit_s=0.001, queue_s=0.010, prefill_s=0.039, tier="gpu"),
          R(1.0, first=1.06, end=2, tokens=5, submit_s=0.001, queue_s=0.020, prefill_s=0.038, tier="gpu"),
          R(2.0, first=2.30, end=3, tokens=5, submit_s=0.002, queue_s=0.250, prefill_s=0.046, tier="disk",
            preemptions=1),
          R(3.0, first=3.20, end=4, tokens=5, submit_s=0.001, queue_s=0.150, prefill_s=0.048, tier="host"),
          R(4.0, first=4.04, end=5, tokens=5, submit_s=0.001, queue_s=0.001, prefill_s=0.038, tier=None),
          R(5.0, error="boom")]
    got = bs.ttft_split(rs, ttft_max=0.1)
    assert got["all"]["requests"] == 5 and got["all"]["queue_p50_s"] == 0.020 and got["all"]["queue_p90_s"] == 0.250
    assert got["all"]["prefill_p50_s"] == 0.039 and got["all"]["submit_p90_s"] == 0.002 and got["all"]["preempted"] == 1
    # delivery: what the client's TTFT holds past the engine's first token (0 / 0.001 / 0.002 / 0.001 / 0)
    assert got["all"]["deliver_p50_s"] == pytest.approx(0.001) and got["all"]["deliver_p90_s"] == pytest.approx(0.002)
    slow = got["slow"]
    assert (slow["requests"], slow["preempted"], slow["submit_p50_s"], slow["queue_p50_s"], slow["queue_p90_s"],
            slow["prefill_p50_s"], slow["prefill_p90_s"]) == (2, 1, 0.001, 0.150, 0.250, 0.046, 0.048)
    tiers = got["by_tier"]
    assert set(tiers) == {"gpu", "disk", "host", "base"} and tiers["gpu"]["requests"] == 2
    assert tiers["gpu"]["ttft_p50_s"] == pytest.approx(0.05) and tiers["gpu"]["within_ttft"] == 1.0
    assert tiers["disk"]["within_ttft"] == 0.0 and tiers["base"]["ttft_p90_s"] == pytest.approx(0.04)
    assert bs.ttft_split([R(0.0, first=0.1, end=1, tokens=2)], 0.5) is None  # (no engine times: HTTP)
    assert bs.ttft_split(rs[:2], ttft_max=None)["slow"] == {"requests": 0}


def test_serving_bench_step_trace_records_its_stalls():
    """``StepTrace.summary`` by hand: the stall threshold per kind (5x its median, at least 50 ms), the stall count and
    seconds above the median, and ``stalls``: each stall step in order with its phases in ms, its counts and the
    step after it; at most ``STALLS_KEPT``; steps without phases give bare records."""
    from multilora.runtime.engine import StepTimes

    bs = _load_bench("bench_serving")

    class E:  # what StepTrace reads of an engine
        step_times = StepTimes()

    e = E()
    ph = {"read_back_s": 0.008, "schedule_s": 0.0001, "resident_s": 0.0, "run_s": 0.001, "adapter_misses": 0,
          "adapter_prefetches": 0, "pool_compactions": 0, "host_arena_map_seconds": 0.0}
    with bs.StepTrace(e) as st:
        for i in range(20):
            e.step_times.observe("decode", 0.010, 8, dict(ph))
        e.step_times.observe("decode", 0.200, 8, {**ph, "schedule_s": 0.19, "pool_compactions": 1})  # step 20
        e.step_times.observe("decode", 0.040, 8, {**ph, "read_back_s": 0.035})  # under 50 ms: not a stall
        e.step_times.observe("mixed", 0.020, 9, dict(ph))
        e.step_times.observe("mixed", 0.020, 9, None)
        e.step_times.observe("mixed", 0.120, 9, None)  # step 24: 6x the mixed median, phases unknown
    got = st.summary()
    assert got["stall_steps"] == 2 and got["stall_seconds"] == pytest.approx((0.200 - 0.010) + (0.120 - 0.020))
    first, second = got["stalls"]
    assert first["step"] == 20 and first["kind"] == "decode" and first["ms"] == pytest.approx(200)
    assert first["rows"] == 8 and first["schedule_ms"] == pytest.approx(190) and first["pool_compactions"] == 1
    assert first["host_arena_map_ms"] == 0.0 and "schedule_s" not in first and "host_arena_map_seconds" not in first
    assert first["next"]["ms"] == pytest.approx(40) and first["next"]["read_back_ms"] == pytest.approx(35)
    assert second == {"step": 24, "kind": "mixed", "ms": pytest.approx(120), "rows": 9, "next": None}
    with bs.StepTrace(e) as st:
        for i in range(10 * bs.STALLS_KEPT):
            e.step_times.observe("decode", 0.5 if i % 5 == 0 else 0.010, 1, None)
    got = st.summary()
    assert got["stall_steps"] == 2 * bs.STALLS_KEPT and len(got["stalls"]) == bs.STALLS_KEPT
    assert [r["step"] for r in got["stalls"]] == list(range(0, 5 * bs.STALLS_KEPT, 5))


def test_serving_bench_long_prompt_mix_chunked_on_and_off(tmp_path):
    """The long-prompt mix (issue 13) in mode engine, chunked prefill off then on: the same requests served, steps
    mixed only when on; the trace of share 0 is the plain trace."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "bench" / "bench_serving.py")
    bs = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = bs
    try:
        spec.loader.exec_module(bs)
    finally:
        sys.modules.pop("bench_serving", None)
    kw = dict(n_requests=40, rate=2.0, arrival="poisson", popularity="zipf", n_adapters=3, input_len=(4, 9),
              output_len=(2, 5), vocab=100, seed=1)
    import torch

    def trace(**extra):
        return bs.make_trace(**kw, **extra)

    assert trace() == trace(long_share=0.0, long_len=50)
    # the arrival times depend on the seed alone, not on torch's global generator (which the bench's rows before
    # consume): every row of a run replays the same arrivals
    first = trace()
    torch.rand(1000)
    assert [r.arrival for r in trace()] == [r.arrival for r in first]
    gaps = [b.arrival - a.arrival for a, b in zip(first, first[1:])]
    assert first[0].arrival == 0.0 and all(x >= 0 for x in gaps)
    assert abs(sum(gaps) / len(gaps) - 1 / kw["rate"]) < 0.5 / kw["rate"]  # exponential gaps of mean 1 / rate
    for arrival in ("poisson", "gamma"):
        torch.manual_seed(5)
        a = [r.arrival for r in bs.make_trace(**{**kw, "arrival": arrival})]
        torch.manual_seed(6)
        assert a == [r.arrival for r in bs.make_trace(**{**kw, "arrival": arrival})], arrival
    mixed = trace(long_share=0.3, long_len=50)
    lens = [len(r.prompt) for r in mixed]
    assert 0 < lens.count(50) < 40 and all(n == 50 or 4 <= n <= 9 for n in lens)
    rows = {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        cmd = [sys.executable, str(ROOT / "bench" / "bench_serving.py"), "--shape", "tiny", "--adapters", "2",
               "--requests", "8", "--input-len", "4,12", "--output-len", "4,8", "--max-batch-size", "4",
               "--long-prompt-share", "0.4", "--long-prompt-len", "64", "--max-num-batched-tokens", "16",
               "--chunked-prefill", mode, "--modes", "engine", "--rate", "burst", "--no-burst-rows",
               "--warmup-requests", "4", "--adapter-files", "2", "--adapter-dir", str(tmp_path / "adapters"),
               "--out", str(out)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        (rows[mode],) = json.loads((out / "serving_tiny.json").read_text())["rows"]
    off, on = rows["off"], rows["on"]
    assert off["failed"] == on["failed"] == 0 and off["output_tokens"] == on["output_tokens"]
    assert (off["chunked_prefill"], on["chunked_prefill"]) == ("off", "on") and on["long_prompt_len"] == 64
    assert off["mixed_steps"] == 0 and on["mixed_steps"] > 0 and on["prefill_chunks"] > off["prefill_chunks"]


def test_serving_bench_rows_of_each_n_replay_one_trace(tmp_path):
    """Rows of different N at one rate replay the same arrivals and lengths (``trace_digest``, ``trace_span_s``):
    the gaps no longer come from torch's global generator, which each row before consumed."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_serving.py"), "--shape", "tiny", "--adapters", "2,3",
           "--requests", "6", "--input-len", "4,12", "--output-len", "2,5", "--max-batch-size", "4",
           "--adapter-files", "2", "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out), "--modes", "engine",
           "--warmup-requests", "0", "--no-burst-rows", "--rate", "50", "--pipe-piece-bytes", "1000",
           "--parallel-finish", "on"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads((out / "serving_tiny.json").read_text())["rows"]
    assert [r["n_adapters"] for r in rows] == [2, 3]
    assert all(r["pipe_piece_bytes"] == 1000 and r["parallel_finish"] is True for r in rows)  # the A/B switches
    # the in-process engine's reads through the pipelined finish's choice, counted per row (the files are in the
    # page cache: none pipelined)
    assert all(r["reads_pipelined"] == 0 and r["reads_cached_serial"] >= 0 for r in rows)
    assert rows[0]["trace_digest"] == rows[1]["trace_digest"] and rows[0]["trace_span_s"] == rows[1]["trace_span_s"] > 0
    assert rows[0]["output_tokens"] == rows[1]["output_tokens"]


def test_serving_adapter_set_is_the_same_whatever_the_threads(tmp_path):
    """``write_adapter_set`` writes each file from its own seeded generator: the bytes do not depend on how many
    threads write them (S4: ranks 16, 32, 64 in turn)."""
    import hashlib

    import torch

    bs = _load_bench("bench_serving")
    from multilora.config import ModelConfig
    from multilora.runtime.weights import MODEL_SHAPES

    cfg = ModelConfig(**MODEL_SHAPES["tiny"])

    def digests(paths):
        return [hashlib.sha256((p / "adapter_model.safetensors").read_bytes()).hexdigest() for p in paths]

    one = bs.write_adapter_set(tmp_path / "one", cfg, "S4", 5, torch.bfloat16, threads=1)
    many = bs.write_adapter_set(tmp_path / "many", cfg, "S4", 5, torch.bfloat16, threads=3)
    assert [p.name for p in one] == [p.name for p in many] == [f"S4-{i}" for i in range(5)]
    assert digests(one) == digests(many) and len(set(digests(one))) == 5
    ranks = [json.loads((p / "adapter_config.json").read_text())["r"] for p in one]
    assert ranks == [16, 32, 64, 16, 32]


def test_serving_bench_engine_warmup_flag(tmp_path):
    """``--engine-warmup`` runs the product's ``Engine.warmup`` (on adapter a0) before the rows and says what it did."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_serving.py"), "--shape", "tiny", "--adapters", "2",
           "--requests", "6", "--input-len", "4,24", "--output-len", "2,9", "--max-batch-size", "4",
           "--adapter-files", "2", "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out), "--modes", "engine",
           "--engine-warmup", "--warmup-requests", "0", "--no-burst-rows", "--rate", "20"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    line = next(x for x in p.stdout.splitlines() if "Engine.warmup:" in x)
    assert int(line.split("Engine.warmup: ")[1].split(" requests")[0]) == 0  # a CPU engine has nothing to warm
    rows = json.loads((out / "serving_tiny.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["failed"] == 0 and rows[0]["requests"] == 6



@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="--drop-page-cache needs os.posix_fadvise (Linux)")
def test_serving_bench_drop_page_cache(tmp_path):
    """``--drop-page-cache S``: every row says it dropped the adapter files' page cache during the row (at least one
    pass), and the run's environment carries the cold sequential read it is held against."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_serving.py"), "--shape", "tiny", "--adapters", "2",
           "--requests", "6", "--input-len", "4,12", "--output-len", "2,5", "--max-batch-size", "4",
           "--adapter-files", "2", "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out), "--modes", "engine",
           "--warmup-requests", "0", "--rate", "50", "--drop-page-cache", "0.05"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "page cache of 4 adapter files dropped every 0.05 s during rows" in p.stdout  # 2 dirs: config + weights
    data = json.loads((out / "serving_tiny.json").read_text())
    rows = data["rows"]
    assert len(rows) == 2 and all(r["failed"] == 0 for r in rows)  # the burst row and the fixed-rate row
    assert all(r["drop_page_cache_s"] == 0.05 and r["page_cache_drops"] >= 1 for r in rows), rows
    # all readers' speed beside one reader's (None in a row that read nothing from disk)
    assert all(r["disk_to_host_aggregate_gbps"] is None or r["disk_to_host_aggregate_gbps"] > 0 for r in rows), rows
    env = data["meta"]["environment"]
    assert env["cold_read_gbps"] > 0 and env["cold_read_bytes"] > 0


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="--drop-after-read needs os.posix_fadvise (Linux)")
def test_serving_bench_drop_after_read(tmp_path):
    """``--drop-after-read``: the engine's reads from the disk tier (adapters registered with ``--preload 0``: each
    read on first use) each drop their directory's page cache when done: the row counts them and says the mode, it
    read bytes from the disk tier, and the run measured the cold read."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_serving.py"), "--shape", "tiny", "--adapters", "3",
           "--requests", "8", "--input-len", "4,12", "--output-len", "2,5", "--max-batch-size", "4",
           "--adapter-files", "3", "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out), "--modes", "engine",
           "--warmup-requests", "0", "--rate", "50", "--no-burst-rows", "--preload", "0", "--drop-after-read"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "page cache of 6 adapter files dropped after each engine read (cold sequential read:" in p.stdout
    data = json.loads((out / "serving_tiny.json").read_text())
    rows = data["rows"]
    assert len(rows) == 1 and rows[0]["failed"] == 0 and rows[0]["drop_after_read"] is True
    reads = rows[0]["drops_after_reads"]
    assert reads >= 1 and rows[0]["bytes_disk_to_host"] > 0, rows[0]
    assert data["meta"]["environment"]["cold_read_gbps"] > 0


@pytest.mark.parametrize("value", ["-1", "x", "nan"])
def test_serving_bench_drop_page_cache_refuses_bad_values(value, capsys):
    bs = _load_bench("bench_serving")
    with pytest.raises(SystemExit):
        bs.parse_args(["--shape", "tiny", f"--drop-page-cache={value}"])
    err = capsys.readouterr().err
    assert "--drop-page-cache" in err and "expected seconds >= 0" in err and repr(value) in err
    assert bs.parse_args(["--shape", "tiny"]).drop_page_cache == 0  # off by default
    # where Python has no posix_fadvise (not Linux), the flag is refused at once rather than ignored
    mp = pytest.MonkeyPatch()
    mp.delattr(os, "posix_fadvise", raising=False)
    try:
        with pytest.raises(SystemExit):
            bs.parse_args(["--shape", "tiny", "--drop-page-cache", "1"])
    finally:
        mp.undo()
    assert "--drop-page-cache: needs os.posix_fadvise" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="drop_page_cache needs os.posix_fadvise (Linux)")
def test_serving_drop_page_cache_helper(tmp_path):
    """``drop_page_cache`` advises every regular file under the directories (subdirectories too) and counts them; the
    page cache's state itself cannot be checked portably. ``cold_read`` reads them whole."""
    bs = _load_bench("bench_serving")
    (tmp_path / "a" / "sub").mkdir(parents=True)
    (tmp_path / "a" / "w.bin").write_bytes(os.urandom(1 << 20))
    (tmp_path / "a" / "sub" / "c.json").write_text("{}")
    assert (tmp_path / "a" / "w.bin").read_bytes()  # in the page cache now
    os.sync()
    assert bs.drop_page_cache([tmp_path / "a"]) == 2
    got = bs.cold_read([tmp_path / "a"], buffer_bytes=1 << 16)
    assert got["cold_read_bytes"] == (1 << 20) + 2 and got["cold_read_gbps"] > 0


def _load_bench(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "bench"))
        sys.modules.pop(name, None)
    return mod


def test_generate_merge_rounds_by_hand():
    """``merge_rounds``: the median ok round by TPOT of each (provider, batch) (of two, the slower), first-seen
    order, per-round TPOTs kept in round order, failed rounds noted, a lone row or a key with no ok row passed
    through."""
    bg = _load_bench("bench_generate")
    rows = [dict(provider="a", batch=1, status="ok", round=0, tpot_ms=5.0, ttft_s=0.1, note="x"),
            dict(provider="b", batch=1, status="skipped", error="budget"),
            dict(provider="a", batch=1, status="ok", round=1, tpot_ms=7.0, ttft_s=0.3),
            dict(provider="c", batch=64, status="ok", round=0, tpot_ms=10.0, ttft_s=None),
            dict(provider="a", batch=1, status="error", round=2, error="boom"),
            dict(provider="a", batch=1, status="ok", round=3, tpot_ms=6.5, ttft_s=0.2),
            dict(provider="b", batch=1, status="skipped", error="budget again")]
    out = bg.merge_rounds(rows)
    assert [(r["provider"], r["batch"]) for r in out] == [("a", 1), ("b", 1), ("c", 64)]
    a, b, c = out
    assert a["tpot_ms"] == 6.5 and a["ttft_s"] == 0.2 and a["round"] == 3 and a["rounds"] == 3  # TPOT 5, 7, 6.5
    assert a["tpot_ms_rounds"] == [5.0, 7.0, 6.5] and a["note"] == "1 of 4 rounds did not run ok"
    assert a["ttft_s_median"] == 0.2  # TTFTs 0.1, 0.3, 0.2
    assert b == rows[1] and c == rows[3]
    two = bg.merge_rounds(rows[:3])
    assert two[0]["tpot_ms"] == 7.0 and two[0]["round"] == 1 and "note" not in two[0]  # of two rounds: the slower
    assert two[0]["ttft_s_median"] == 0.3  # of two TTFTs (0.1, 0.3): the slower
    # the median round by TPOT is not the median TTFT: the TTFT target takes the rounds' median
    skew = [dict(provider=p, batch=64, status="ok", round=i, tpot_ms=t, ttft_s=f)
            for p, tf in (("multilora", ((6.0, 1.0), (7.0, 1.0), (8.0, 1.0))),
                          ("multilora-lora", ((8.0, 1.05), (9.0, 1.3), (10.0, 1.06))))
            for i, (t, f) in enumerate(tf)]
    got = {t: (v, n) for t, v, n in bg.targets(bg.merge_rounds(skew)) if "TTFT" in t}
    verdict, numbers = got["multilora-lora batch 64 on 64 adapters: TTFT <= 1.1x multilora's"]
    assert verdict == "met" and numbers.startswith("1.06x by the rounds' median TTFT") and "round's 1.3x" in numbers


def test_generate_bench_rounds(tmp_path):
    """--rounds 2: each multilora provider runs twice, the second round in reverse order; the table shows the
    median round's TPOT (of two, the slower) and each round's."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_generate.py"), "--shape", "tiny", "--batches", "1",
           "--prompt-len", "8", "--gen", "3", "--dtype", "float32", "--device", "cpu", "--providers",
           "multilora,multilora-lora", "--rounds", "2", "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out),
           "--in-process"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads((out / "generate_tiny.json").read_text())
    assert [(r["provider"], r["round"]) for r in rows] == [("multilora", 0), ("multilora-lora", 0),
                                                           ("multilora-lora", 1), ("multilora", 1)]
    # TPOT subtracts a 1-token run from a 3-token one: on a busy 2-core machine their difference can even come out
    # negative, so only its presence is asserted here (the rounds and the table are what this test checks)
    assert all(r["status"] == "ok" and math.isfinite(r["tpot_ms"]) for r in rows)
    md = (out / "generate_tiny.md").read_text()
    for prov in ("multilora", "multilora-lora"):
        t = [r["tpot_ms"] for r in rows if r["provider"] == prov]
        cell = f"| {prov} | 1 | 3 | "
        line = next(ln for ln in md.splitlines() if ln.startswith(cell))
        assert f"| {max(t):.2f} ({t[0]:.2f} / {t[1]:.2f}) |" in line, (line, t)


def test_generate_bench_fp8_rows_take_the_engines_default_head(tmp_path, monkeypatch):
    """The fp8 providers' one engine: multilora-fp8 (and -lmhead) run with the LM head in fp8 as
    ``Engine(weight_dtype="fp8")`` builds it for an untied model (``fp8_lm_head=None``), -bf16head with the model-dtype
    head; the rows record which (tiny model on the CPU)."""
    bg = _load_bench("bench_generate")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    bg.main(["--shape", "tiny", "--batches", "1", "--prompt-len", "8", "--gen", "2", "--dtype", "float32", "--device",
             "cpu", "--providers", "multilora-fp8,multilora-fp8-bf16head,multilora-fp8-lmhead", "--out", str(out),
             "--in-process"])
    got = json.loads((out / "generate_tiny.json").read_text())
    assert all(r["status"] == "ok" for r in got), got
    head = {r["provider"]: r["fp8_lm_head"] for r in got}
    assert head == {"multilora-fp8": True, "multilora-fp8-bf16head": False, "multilora-fp8-lmhead": True}


def test_generate_bench_variants_set_record_and_restore_their_knobs(tmp_path, monkeypatch):
    """The provider variants' knobs (``variant_knobs``): each variant's rows record the values it ran with (the
    zeroed buffer, plain LoRA launches, the side stream off, reads back synchronously), the plain rows the defaults,
    and every knob is back at its default after the run (in-process, as ``--in-process`` runs it)."""
    from multilora.kernels import triton_sgmv
    from multilora.runtime import model as model_mod

    bg = _load_bench("bench_generate")
    monkeypatch.chdir(tmp_path)
    before = (model_mod.LORA_DELTA_OVERWRITE_MIN_TOKENS, triton_sgmv.PDL, triton_sgmv.DECODE_EXPAND_LOOP)
    out = tmp_path / "out"
    provs = ("multilora,multilora-lora,multilora-lora-zeroed,multilora-lora-nopdl,multilora-lora-onetile,"
             "multilora-lora-sync,multilora-lora-sidepf0,multilora-lora-nowideout,multilora-lora-addafter,"
             "multilora-lora-s29tiles,multilora-lora-boundgrid,multilora-lora-gridsplit,multilora-lora-gemmfused,"
             "multilora-lora-glushrink")
    bg.main(["--shape", "tiny", "--batches", "1", "--prompt-len", "8", "--gen", "2", "--dtype", "float32", "--device",
             "cpu", "--providers", provs, "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out), "--in-process",
             "--rounds", "2"])  # round 1 runs the variants in reverse: the plain rows come after the others
    got = json.loads((out / "generate_tiny.json").read_text())
    assert all(r["status"] == "ok" for r in got), got
    rows = {r["provider"]: r for r in got if r["round"] == 1}
    base = rows["multilora-lora"]
    assert base["lora_delta_overwrite_min_tokens"] == before[0] and base["lora_pdl"] == before[1]
    assert rows["multilora-lora-zeroed"]["lora_delta_overwrite_min_tokens"] == 1 << 30
    assert rows["multilora-lora-nopdl"]["lora_pdl"] is False
    assert rows["multilora-lora-onetile"]["decode_expand_loop"] == [[512, 1, 256, 2]]
    assert rows["multilora-lora-sync"]["async_scheduling"] is False
    side = rows["multilora-lora-sidepf0"]
    assert (side["lora_side_stream_max_tokens"], side["lora_side_sm_carveout"]) == (1 << 20, 0)
    assert base["lora_side_stream_max_tokens"] == 0  # (on the CPU the default side stream is off)
    assert rows["multilora-lora-nowideout"]["decode_expand_rank_wide_out"] is None
    assert base["decode_expand_rank_wide_out"] == list(triton_sgmv.DECODE_EXPAND_RANK_WIDE_OUT)
    assert rows["multilora-lora-addafter"]["lora_before_gemm_min_tokens"] == 1 << 30
    assert base["lora_before_gemm_min_tokens"] == model_mod.LORA_BEFORE_GEMM_MIN_TOKENS
    old_tiles = rows["multilora-lora-s29tiles"]
    assert (old_tiles["prefill_shrink_block_k"], old_tiles["prefill_write_block_n"]) == (None, None)
    assert (base["prefill_shrink_block_k"], base["prefill_write_block_n"]) == (128, 256)
    assert rows["multilora-lora-boundgrid"]["lora_grid_by_segments"] is False and base["lora_grid_by_segments"] is True
    assert rows["multilora-lora-gridsplit"]["lora_split_by_grid"] is True and base["lora_split_by_grid"] is False
    assert rows["multilora-lora-gemmfused"]["lora_gemm_epilogue_min_tokens"] == model_mod.LORA_BEFORE_GEMM_MIN_TOKENS
    assert base["lora_gemm_epilogue_min_tokens"] == 1 << 30
    assert rows["multilora-lora-glushrink"]["glu_shrink_min_tokens"] == model_mod.LORA_BEFORE_GEMM_MIN_TOKENS
    assert base["glu_shrink_min_tokens"] == 1 << 30
    for name in ("lora_delta_overwrite_min_tokens", "lora_pdl", "decode_expand_loop", "fp8_gemv_preload",
                 "lora_side_stream_max_tokens", "lora_side_sm_carveout", "decode_expand_rank_wide_out",
                 "lora_before_gemm_min_tokens", "prefill_shrink_block_k", "prefill_write_block_n",
                 "lora_grid_by_segments", "lora_split_by_grid", "lora_gemm_epilogue_min_tokens", "glu_shrink_min_tokens"):
        assert rows["multilora"][name] == base[name], name  # the variants' values did not leak into later rows
    assert (model_mod.LORA_DELTA_OVERWRITE_MIN_TOKENS, triton_sgmv.PDL, triton_sgmv.DECODE_EXPAND_LOOP) == before
    assert triton_sgmv.DECODE_EXPAND_RANK_WIDE_OUT == (48, 64, 16384, 256, 4)


def test_fused_quant_bench_checks_the_bits(tmp_path):
    """``bench_fused_quant.py --smoke``: on the CPU (Triton's interpreter) every row's fused copy is its output's
    quantization and, there, fused and separate agree bit for bit; the table and JSON are written."""
    pytest.importorskip("triton")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_fused_quant.py"), "--smoke", "--tokens", "1,5", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads((out / "fused_quant.json").read_text())["rows"]
    assert [(r["op"], r["tokens"]) for r in rows] == [("add_rms_norm", 1), ("silu_mul", 1), ("add_rms_norm", 5),
                                                     ("silu_mul", 5)]
    assert all(r["copy_exact"] and r["outputs_differing"] == 0 and r["fp8_differing"] == 0 for r in rows)
    assert "| silu_mul | 5 |" in (out / "fused_quant.md").read_text()


def test_read_contention_bench_runs(tmp_path):
    """``read_contention.py`` on the tiny shape: three variants, each timed alone and beside a busy Python thread, the
    image's bytes and GB/s consistent with the times."""
    rc = _load_bench("read_contention")
    interval = sys.getswitchinterval()
    from multilora.runtime.adapters import image

    chunk = image._CHECK_CHUNK
    rows = rc.main(["--shape", "tiny", "--rank", "4", "--reads", "1", "--adapter-dir", str(tmp_path), "--busy-fractions", "0.5",
                    "--check-chunks", "0.25", "--json", str(tmp_path / "rc.json")])
    assert image._CHECK_CHUNK == chunk  # put back
    assert [r["variant"] for r in rows] == ["the read", "the read, finite check in chunks of 0.25M elements",
                                            "the read without the finite check",
                                            "the read in 1 MiB groups (before session 28)",
                                            "groups, without the finite check",
                                            "groups, without the finite check and the lora_B transposes"]
    saved = json.loads((tmp_path / "rc.json").read_text())
    for r in saved["rows"]:
        assert r["alone_ms"] > 0 and r["beside_busy_ms"] > 0
        assert r["alone_gbps"] == pytest.approx(saved["image_bytes"] / (r["alone_ms"] / 1e3) / 1e9)
    assert [d["busy_fraction"] for d in saved["duty"]] == [0.5]
    assert all(d["groups_ms"] > 0 and d["batched_ms"] > 0 for d in saved["duty"])
    assert sys.getswitchinterval() == interval  # the interpreter's switch interval put back


def test_expand_glu_bench_refuses_bad_flags_clearly(capsys):
    """``bench_expand_glu.py`` (GPU only): bad ``--fused-configs`` and ``--pool-rank`` values, and a machine without
    CUDA, end in argparse errors naming the flag or the need, before anything is built."""
    bg = _load_bench("bench_expand_glu")
    assert bg._configs("128:4:4,64:2:8") == [(128, 4, 4), (64, 2, 8)]
    for argv, words in ((["--fused-configs", "100:1:4"], "argument --fused-configs: expected BLOCK_N:TILES:WARPS"),
                        (["--fused-configs", "128:4"], "argument --fused-configs: expected BLOCK_N:TILES:WARPS"),
                        (["--pool-rank", "8"], "--pool-rank: expected comma-separated ints >= 16, got '8'")):
        with pytest.raises(SystemExit):
            bg.main(argv)
        assert words in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bg.main([])
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_interleaved_rounds_alternate_the_order():
    """``_common.interleaved_rounds``: every key once per round, every other round reversed, values kept per key in
    round order (what bench_lora_overlap.py --rounds and bench_expand_glu.py take medians of)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import interleaved_rounds

    calls = []
    got = interleaved_rounds(["a", "b", "c"], 3, lambda k: calls.append(k) or len(calls))
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert got == {"a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]}
    assert interleaved_rounds(["a"], 0, lambda k: 1) == {"a": []}


def test_kernel_times_rank_a_schedules_ops():
    """``_common.kernel_times`` (``bench_expand_glu.py --profile``): the ops of a function run under the profiler, slowest
    first, with calls and times per run (on this CPU: its ops' self time; on a GPU: its kernels). A function of one
    big matmul and a small add: the matmul's op first, each called once per run."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from _common import kernel_times

    if torch.cuda.is_available():
        pytest.skip("on a GPU the rows are CUDA kernels, whose names depend on the libraries")
    a, b, c = torch.randn(384, 384), torch.randn(384, 384), torch.randn(4)
    rows = kernel_times(lambda: (torch.mm(a, b), c + 1), runs=3)
    assert rows and rows[0]["name"] in ("aten::mm", "aten::matmul") and rows[0]["calls_per_run"] == 1
    assert all(r["us_per_run"] == pytest.approx(r["us_per_call"] * r["calls_per_run"]) for r in rows)
    assert [r["us_per_run"] for r in rows] == sorted((r["us_per_run"] for r in rows), reverse=True)
    assert any(r["name"] == "aten::add" for r in rows)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the smoke run needs TRITON_INTERPRET=1")
def test_gemm_lora_bench_smoke(tmp_path):
    """``bench_gemm_lora.py --smoke`` (CPU, interpreter, tiny groups): every provider of every group timed, the fused
    kernel's checks against the engine's path and the fp32 reference recorded (fp32: within 1e-5), the layer table
    written; a bad ``--configs`` is an argparse error naming it."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench_gemm_lora.py"), "--out", str(tmp_path), "--smoke"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "gemm_lora.json").read_text())
    assert [g["group"] for g in res["groups"]] == ["qkv", "o", "gate_up", "down"]
    for g in res["groups"]:
        checks = [k for k in g if k.startswith("fused_") and k.endswith("_max_rel")]
        assert len(checks) == 2 * len(res["settings"]["configs"]) and all(g[k] < 1e-5 for k in checks), g
        assert all(f"{prov}_us" in g for prov in ("cublas", "engine")), g
    assert set(res["layer"]) == {"cublas", "engine"} | {f"{kind}_{c}" for kind in ("triton", "fused")
                                                        for c in res["settings"]["configs"]}
    assert "| provider | layer us | over cuBLAS |" in (tmp_path / "gemm_lora.md").read_text()
    p = subprocess.run(cmd + ["--configs", "7"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 2 and "--configs: expected indices 0..1" in p.stderr, p.stderr


def test_serving_bench_fits_the_shapes_context(capsys):
    """The default trace (prompts and outputs up to 512 tokens) on the tiny shape (a context of 1,024): max_seq_len at
    most the context (it was 1,032, which the engine refuses); a trace past the context is refused naming the flags."""
    bs = _load_bench("bench_serving")
    args = bs.parse_args(["--shape", "tiny"])
    assert bs.longest_request(args) == 1024 and bs.max_seq_len(args, 1024) == 1024
    assert bs.max_seq_len(bs.parse_args(["--shape", "tiny", "--input-len", "8,100"]), 1024) == 100 + 512 + 8
    with pytest.raises(SystemExit):
        bs.parse_args(["--shape", "tiny", "--output-len", "8,600"])
    assert "--input-len / --output-len: the longest request (1112 tokens) is past the tiny shape's context of 1024" \
        in capsys.readouterr().err


def test_serving_bench_lets_each_engine_go_before_the_next_is_built(tmp_path, monkeypatch):
    """Each N's engine is freed before the next N's is built (its memory plan sizes the pool from the free memory):
    with --drop-after-read (its reload wrapper makes a cycle through the cache) and a StepTrace per row, the N = 5
    engine outlived its rows until session 39, and S4's N = 2,000 rows on a GPU got 344 pool slots, not 1,231."""
    import weakref

    bs = _load_bench("bench_serving")
    built = []
    real = bs.build_engine

    def build(*a, **kw):
        assert [r() for r in built] == [None] * len(built), "an earlier row's engine is still alive"
        e = real(*a, **kw)
        built.append(weakref.ref(e))
        return e

    monkeypatch.setattr(bs, "build_engine", build)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    rows = bs.main(["--shape", "tiny", "--adapters", "2,3", "--requests", "4", "--input-len", "4,8", "--output-len",
                    "2,4", "--max-batch-size", "4", "--adapter-files", "2", "--adapter-dir", str(tmp_path / "adapters"),
                    "--out", str(out), "--modes", "engine", "--warmup-requests", "0", "--rate", "50",
                    "--drop-after-read"])
    assert len(built) == 2 and [r["n_adapters"] for r in rows] == [2, 2, 3, 3]  # a burst row and a rate row each
    assert built[0]() is None and built[1]() is None  # the last one too, once main returns
    assert all(r["gpu_bytes_allocated_before_engine"] is None for r in rows)  # (recorded on CUDA only)


def test_host_register_bench_smoke(tmp_path):
    """``bench_host_register.py --smoke``: both modes run on the CPU (nothing pinned there) with the module's
    ``PREFAULT`` put back, and the JSON holds a row per mode with its summary."""
    hr = _load_bench("bench_host_register")
    from multilora.memory import host_arena

    before, register = host_arena.PREFAULT, host_arena._register
    rows = hr.main(["--smoke", "--out", str(tmp_path)])
    assert host_arena.PREFAULT == before and host_arena._register is register
    assert [r["prefault"] for r in rows] == [False, True] and all(r["chunk_bytes"] == 16 << 20 for r in rows)
    assert all(not r["pinned"] and 0 <= r["pin_seconds"] <= r["map_seconds"] for r in rows)
    saved = json.loads((tmp_path / "host_register.json").read_text())
    assert set(saved["summary"]) == {"off", "on"} and len(saved["rows"]) == 2


def test_generate_bench_fails_when_no_row_was_measured(tmp_path):
    """A run whose every row was skipped or failed exits 1 with the reasons on stderr (it exited 0: a CI smoke run
    could not tell), the rows still written."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench_generate.py"), "--shape", "tiny", "--batches", "1",
           "--prompt-len", "8", "--gen", "2", "--providers", "multilora", "--time-budget", "0.0001",
           "--out", str(tmp_path / "out")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 1 and "no row was measured" in p.stderr, (p.returncode, p.stderr[-2000:])
    rows = json.loads((tmp_path / "out" / "generate_tiny.json").read_text())
    assert [r["status"] for r in rows] == ["skipped"]


@pytest.mark.parametrize("script,args,message", [
    ("bench_generate.py", ["--batches", "x"], "--batches: expected comma-separated batch sizes, got 'x'"),
    ("bench_generate.py", ["--load-threads", "0"], "--load-threads: expected an integer >= 1, got 0"),
    ("bench_generate.py", ["--prompt-len", "100000"], "is past the tiny shape's context of"),
    ("bench_generate.py", ["--out", "/proc/nope"], "--out: cannot make the directory '/proc/nope'"),
    ("bench_serving.py", ["--adapters", "0"], "--adapters: expected comma-separated adapter counts >= 1, got '0'"),
    ("bench_serving.py", ["--requests", "0"], "--requests: expected an integer >= 1, got 0"),
    ("bench_serving.py", ["--adapter-files", "0"], "--adapter-files: expected an integer >= 1, got 0"),
    ("bench_serving.py", ["--rate-fraction", "0"], "--rate-fraction: expected a positive fraction"),
    ("bench_adapter_load.py", ["--adapters", "0"], "--adapters: expected an integer >= 1, got 0"),
    ("bench_adapter_load.py", ["--threads", "0"], "--threads: expected a comma list of reader thread counts >= 1"),
    ("bench_adapter_load.py", ["--pool-device", "cuda"], "--pool-device: 'cuda' needs a CUDA GPU"),
])
def test_bench_scripts_refuse_bad_flags(tmp_path, script, args, message):
    """Bad flags stop a bench before any work with exit status 2, naming the flag (they were tracebacks, some only
    after the first row, or runs of failed rows with exit status 0)."""
    if "cuda" in args and __import__("torch").cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    cmd = [sys.executable, str(ROOT / "bench" / script), "--shape", "tiny", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
