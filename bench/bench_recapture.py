"""Decode speed of an engine's first CUDA-graph capture against a recapture (``DecodeGraphs.reset()``), and the
Triton kernels compiled in each phase: a diagnostic for the order effect seen in ``bench_generate.py`` (the first
LoRA rows after an engine's warm-up slower than the same rows after a recapture; bench/results/lora_side_stream/).

A random-weight model of ``--shape`` (``--layers`` of its layers), bf16, ``--batch`` requests on ``--batch``
distinct rank-8 q/k/v/o adapters (set S1 of ``bench_serving.py``), prompts of ``--prompt-len`` random ids,
greedy. Phases, in this order on one engine: ``first`` (warm-up then timed decode: the graphs of the engine's first
capture), then ``--recaptures`` times ``recapture`` (``engine.graphs.reset()``, the same warm-up, timed decode).
Each phase prints one JSON line: TPOT (ms, median of ``--repeats`` timed generations of ``--gen`` tokens, minus
the 1-token time) and ``triton_compiles`` (kernel variants compiled in the phase:
``multilora.kernels.backends.kernel_compiles``; None where this Triton has no JIT hooks).

    python bench/bench_recapture.py                       # H200, ~1-2 min on a fresh machine
    python bench/bench_recapture.py --shape tiny --device cpu --batch 4 --gen 4 --layers 2   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import DTYPES, write_adapter_set  # noqa: E402

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.config import ModelConfig  # noqa: E402
from multilora.kernels.backends import count_kernel_compiles, kernel_compiles  # noqa: E402
from multilora.runtime.weights import MODEL_SHAPES  # noqa: E402

def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="keep this many layers of the shape (default: all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapter-files", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--recaptures", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write recapture_<shape>.json here")
    args = ap.parse_args(argv)
    dtype = DTYPES[args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")]
    count_kernel_compiles()
    torch.manual_seed(0)
    shape = dict(MODEL_SHAPES[args.shape])
    if args.layers:
        shape["num_layers"] = args.layers
    config = ModelConfig(**shape)
    files = write_adapter_set(Path(tempfile.mkdtemp()), config, "S1", args.adapter_files, dtype)
    engine = Engine(config, device=args.device, dtype=dtype, progress=False, max_batch_size=args.batch,
                    max_seq_len=args.prompt_len + args.gen + 8, max_lora_rank=8)
    names = [f"a{i}" for i in range(args.batch)]
    for i, n in enumerate(names):
        engine.load_adapter(n, files[i % len(files)])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in names]

    def timed(tokens: int) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(prompts, adapters=names, sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t

    rows = []
    for phase in ["first"] + ["recapture"] * args.recaptures:
        c0, t0 = kernel_compiles()["kernel_compiles"], time.perf_counter()
        if phase == "recapture" and engine.graphs is not None:
            engine.graphs.reset()
        timed(2)  # warm-up: the prefill and every decode graph this batch reaches are made here
        tpots = [(timed(args.gen) - timed(1)) / (args.gen - 1) for _ in range(args.repeats)]
        c1 = kernel_compiles()["kernel_compiles"]
        row = {"phase": phase, "batch": args.batch, "layers": config.num_layers,
               "tpot_ms": 1e3 * statistics.median(tpots), "tpot_ms_all": [1e3 * x for x in tpots],
               "triton_compiles": None if c0 is None else c1 - c0,
               "phase_s": time.perf_counter() - t0}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python bench/bench_recapture.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
        (args.out / f"recapture_{args.shape}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
