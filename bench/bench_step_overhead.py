"""Host (CPU) overhead of one decode step, without the model forward.

On a GPU the decode forward is one CUDA-graph replay; everything else in ``Engine.step`` (scheduler, block
tables, LoRA chunk table, staging of the graph's static buffers, sampling tensors, sampling, the ``.tolist()``
read and the stop checks) is Python on the host, and the GPU waits for it: the step's ``.tolist()`` blocks
until the GPU is done, so the next step's host work is never overlapped with the previous step's GPU work.
This script measures that host work on the CPU alone.

Setup: the ``tiny`` random model on the CPU (vocab 512), ``max_batch_size=64``, ``max_seq_len=2048``, prompts
of 512 tokens (like bench_generate.py), greedy (``--temperature``), end-of-sequence ignored; the engine's runner
takes the graph path (``runner.enable_graphs``) with its forward stubbed out:

    replay  (default) the real replay path of ``ModelRunner.decode_graph``, with ``DecodeGraphs._record``
            replaced by a fake graph whose ``replay()`` does nothing and whose logits are a preallocated tensor:
            exactly the host work of a CUDA-graph decode step (less the CUDA calls themselves: launches, pinned
            copies)
    eager   ``enable_graphs(capture=False)`` with the forward returning a preallocated logits tensor (the same
            static plan, run without a graph)

For each batch size (default 1, 8, 64) and with / without adapters (request i on adapter a<i>, rank 16: B
distinct adapters), a fresh set of B requests is prefilled (the real tiny forward), then ``--steps`` decode
steps are timed one by one with ``time.perf_counter`` (median and mean per step), then the same number again
with timers around the parts of the step (inclusive times, mean per step; the timers add ~1 us each), and
optionally once more under cProfile (``--profile``: the top functions by own time).

    python bench/bench_step_overhead.py                      # ~1 min on 2 cores
    python bench/bench_step_overhead.py --profile --batches 64 --steps 500

Numbers are CPU time of the host side only: the GPU effect (how much of the step the GPU then sits idle) is
not measured here.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import logging
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from multilora import Engine, SamplingParams
from multilora.config import ModelConfig
from multilora.runtime.weights import MODEL_SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_adapter  # noqa: E402

PROMPT_LEN = 512
MAX_BATCH = 64
MAX_SEQ_LEN = 2048


class _FakeGraph:
    def replay(self) -> None:
        pass


def build_engine(adapter_dir: Path | None, n_adapters: int, mode: str) -> tuple[Engine, list[str]]:
    cfg = ModelConfig(**{**MODEL_SHAPES["tiny"], "max_position_embeddings": MAX_SEQ_LEN})
    e = Engine(cfg, device="cpu", progress=False, max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ_LEN, kv_block_size=16,
               max_lora_rank=16, adapter_slots=max(n_adapters, 1), max_prefill_tokens=4096)
    names = []
    if adapter_dir is not None:
        for i in range(n_adapters):
            names.append(f"a{i}")
            e.load_adapter(names[-1], write_adapter(adapter_dir / names[-1], cfg, seed=i, rank=16, dtype=torch.float32))
    g = e.runner.enable_graphs(capture=mode == "replay")  # the graph path, on the CPU
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(MAX_BATCH, cfg.vocab_size, generator=gen)
    if mode == "replay":  # the capture bookkeeping runs; only the CUDA recording is faked
        g._record = lambda plan: (_FakeGraph(), logits[: plan.input_ids.shape[0]].clone())
    else:
        g._forward = lambda plan: logits[: plan.input_ids.shape[0]]
    return e, names


TEMPERATURE = 0.0  # --temperature


def start_batch(e: Engine, B: int, names: list[str], decode_steps: int) -> None:
    """Queue B requests (prompt 512) that generate decode_steps + 1 tokens, and run their prefill."""
    gen = torch.Generator().manual_seed(B)
    sp = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True, temperature=TEMPERATURE, seed=0)
    for i in range(B):
        ids = torch.randint(0, e.config.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
        e.add_request(ids, names[i % len(names)] if names else None, sp)
    # until every prompt is computed: with chunked prefill (the default) a request leaves the waiting queue while its
    # prompt is still being computed in chunks of the step's token budget (64 x 512 tokens > 4,096)
    while e.scheduler.waiting or any(r.computed < len(r.prompt_ids) for r in e.scheduler.running):
        e.step()


def time_steps(e: Engine, n: int) -> list[float]:
    """Wall time of n decode steps, one by one (seconds)."""
    out = []
    d0 = e.stats()["decode_steps"]
    for _ in range(n):
        t0 = time.perf_counter()
        e.step()
        out.append(time.perf_counter() - t0)
    assert e.stats()["decode_steps"] - d0 == n, "a timed step was not a decode step"
    return out


def drain(e: Engine) -> None:
    while e.has_unfinished():
        e.step()


# ----------------------------------------------------------------------------------------- part timers
def _parts(e: Engine) -> list[tuple[str, int, Any, str]]:
    """(label, depth, owner, attribute): the functions timed, inclusive; depth = nesting for the printout."""
    from multilora.runtime import cuda_graphs, engine, postprocess, runner, sampling, scheduler

    return [
        ("schedule (scheduler.schedule)", 0, scheduler.Scheduler, "schedule"),
        ("prefetch (candidates, waiting, prefetch)", 0, scheduler.Scheduler, "prefetch_candidates"),
        ("prefetch (candidates, waiting, prefetch)", 0, scheduler.Scheduler, "waiting_handles"),
        ("prefetch (candidates, waiting, prefetch)", 0, e.cache, "prefetch"),
        ("wait_ready", 0, e.cache, "wait_ready"),
        ("forward, host side (ModelRunner.run)", 0, runner.ModelRunner, "run"),
        ("block tables (kv.block_table)", 1, e.kv, "block_table"),
        ("graph staging (DecodeBuffers.stage)", 1, runner.DecodeBuffers, "stage"),
        ("chunk table (fill_chunk_table)", 2, runner, "fill_chunk_table"),
        ("replay (DecodeGraphs.replay)", 1, cuda_graphs.DecodeGraphs, "replay"),
        ("postprocess (Postprocessor)", 0, postprocess.Postprocessor, "__call__"),
        ("sample (sample_tokens)", 1, postprocess, "sample_tokens"),
        ("SamplingTensors.from_params", 2, sampling.SamplingTensors, "from_params"),
        ("sample_batch", 2, postprocess, "sample_batch"),
        ("stop checks (Postprocessor.check_stop)", 1, postprocess.Postprocessor, "check_stop"),
        # async scheduling (the CUDA default): the draw is launched, the step before read back one call later
        ("draw launched (Engine._launch; async)", 0, engine.Engine, "_launch"),
        ("read back (Engine._read_back; async: waits for the step before)", 0, engine.Engine, "_read_back"),
        ("append + stops (Postprocessor.take)", 1, postprocess.Postprocessor, "take"),
    ]


def timed_parts(e: Engine, n: int) -> tuple[float, dict[str, float]]:
    acc: dict[str, float] = {}
    saved = []

    def wrap(label: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + time.perf_counter() - t0
        return w

    for label, _, owner, attr in _parts(e):
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        saved.append((owner, attr, owner.__dict__.get(attr, None), attr in owner.__dict__))
        if isinstance(raw, staticmethod):
            setattr(owner, attr, staticmethod(wrap(label, raw.__func__)))
        else:
            setattr(owner, attr, wrap(label, raw))
    try:
        total = sum(time_steps(e, n))
    finally:
        for owner, attr, old, had in reversed(saved):
            if had:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)
    return total / n, {k: v / n for k, v in acc.items()}


def profile_steps(e: Engine, n: int, top: int) -> str:
    pr = cProfile.Profile()
    pr.enable()
    time_steps(e, n)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def prefill_builders(batches: list[int], reps: int) -> list[dict]:
    """Host time of the prefill step's two per-token builders, for B prompts of PROMPT_LEN tokens (16-token
    blocks, B distinct adapters): ``build_attention_metadata`` and ``build_lora_plan`` (given the per-token
    slots as an int64 tensor), on the CPU. Median of ``reps`` calls."""
    from multilora.kernels import build_lora_plan
    from multilora.kernels.attention import build_attention_metadata

    rows = []
    for B in batches:
        q = [PROMPT_LEN] * B
        tables = [list(range(1 + b * PROMPT_LEN // 16, 1 + (b + 1) * PROMPT_LEN // 16)) for b in range(B)]
        per_token = torch.arange(B).repeat_interleave(PROMPT_LEN)  # a tensor, as the engine passes it now
        out = {"batch": B, "tokens": B * PROMPT_LEN}
        for name, fn in (("build_attention_metadata", lambda: build_attention_metadata(q, q, tables, block_size=16,
                                                                                          device="cpu")),
                         ("build_lora_plan", lambda: build_lora_plan(per_token, device="cpu"))):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            out[name] = statistics.median(ts) * 1e6
        rows.append(out)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=1000, help="timed decode steps per pass")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--mode", choices=("replay", "eager"), default="replay")
    ap.add_argument("--lora", choices=("both", "off", "on"), default="both")
    ap.add_argument("--profile", action="store_true", help="also run a pass under cProfile and print the top functions")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (as bench_generate.py)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows (and part times) to this JSON file")
    args = ap.parse_args(argv)
    global TEMPERATURE
    TEMPERATURE = args.temperature
    logging.getLogger("multilora").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if args.steps + args.warmup + 1 + PROMPT_LEN > MAX_SEQ_LEN:
        ap.error(f"--steps + --warmup must stay below {MAX_SEQ_LEN - PROMPT_LEN - 1}")
    loras = {"both": (False, True), "off": (False,), "on": (True,)}[args.lora]
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, mode {args.mode}, {args.steps} steps per pass, "
          f"{torch.get_num_threads()} thread(s), temperature {args.temperature}")
    summary, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for lora in loras:
            e, names = build_engine(Path(tmp) if lora else None, max(batches) if lora else 0, args.mode)
            for B in batches:
                steps = args.warmup + args.steps
                start_batch(e, B, names[:B], steps)
                time_steps(e, args.warmup)
                per = time_steps(e, args.steps)
                drain(e)
                start_batch(e, B, names[:B], steps)
                time_steps(e, args.warmup)
                tot, parts = timed_parts(e, args.steps)
                drain(e)
                med, mean = statistics.median(per) * 1e6, statistics.fmean(per) * 1e6
                summary.append((B, lora, med, mean))
                rows.append({"batch": B, "adapters": B if lora else 0, "mode": args.mode, "steps": args.steps,
                             "temperature": args.temperature,
                             "us_per_step_median": med, "us_per_step_mean": mean,
                             "parts_us": {k: v * 1e6 for k, v in parts.items()}, "timed_pass_us": tot * 1e6})
                print(f"\n== batch {B}, {'adapters (' + str(B) + ' distinct)' if lora else 'no adapters'}: "
                      f"{med:.1f} us/step median, {mean:.1f} mean (timed pass with part timers: {tot * 1e6:.1f})")
                top0, seen = 0.0, set()
                for label, depth, _, _ in _parts(e):
                    if label in seen:
                        continue
                    seen.add(label)
                    v = parts.get(label, 0.0)
                    if depth == 0:
                        top0 += v
                    print(f"   {'  ' * depth}{label:<{46 - 2 * depth}} {v * 1e6:8.1f} us")
                print(f"   {'other (step lock, counters, loop)':<46} {(tot - top0) * 1e6:8.1f} us")
                if args.profile:
                    start_batch(e, B, names[:B], args.steps)
                    print(profile_steps(e, args.steps, args.top))
                    drain(e)
    print("\n| batch | adapters | us/step (median) | us/step (mean) |\n|---|---|---|---|")
    for B, lora, med, mean in summary:
        print(f"| {B} | {'yes' if lora else 'no'} | {med:.1f} | {mean:.1f} |")
    pre = prefill_builders([b for b in batches if b * PROMPT_LEN <= 4096] or [1], reps=max(args.steps // 20, 5))
    print(f"\nprefill builders (host, {PROMPT_LEN}-token prompts, B distinct adapters; median)\n"
          "| batch | tokens | build_attention_metadata us | build_lora_plan us |\n|---|---|---|---|")
    for r in pre:
        print(f"| {r['batch']} | {r['tokens']} | {r['build_attention_metadata']:.1f} | {r['build_lora_plan']:.1f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"torch": torch.__version__, "python": sys.version.split()[0],
                                        "threads": torch.get_num_threads(), "rows": rows,
                                        "prefill_builders": pre}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
