"""Demo adapters for a fresh machine, and the demo run.

``make_demo_adapters`` writes PEFT-format LoRA adapters (``adapter_config.json`` +
``adapter_model.safetensors``) with seeded random weights for any Llama-family base model. The scale is
chosen so that greedy completions differ visibly between adapters yet stay fluent: every adapter's
low-rank update has a Frobenius norm of ``relative_norm`` times the base weight's, per module, at rank 8
on all seven projections. They are load tests of the runtime, not trained skills.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from multilora.runtime.adapters import save_peft_adapter
from multilora.config import TARGET_MODULES, ModelConfig

#: name -> (seed, relative_norm, target modules). Different seeds give different completions.
DEMO_ADAPTERS: dict[str, tuple[int, float, tuple[str, ...]]] = {
    "demo-a": (1, 0.12, TARGET_MODULES),
    "demo-b": (2, 0.12, TARGET_MODULES),
    "demo-c": (3, 0.10, ("q_proj", "v_proj", "down_proj")),
}

DEMO_PROMPTS: list[tuple[str, str | None]] = [
    ("Write one sentence about the sea.", None),
    ("Write one sentence about the sea.", "demo-a"),
    ("Write one sentence about the sea.", "demo-b"),
    ("Write one sentence about the sea.", "demo-c"),
    ("What is the capital of France?", None),
    ("What is the capital of France?", "demo-a"),
    ("Give me a tip for learning to cook.", "demo-b"),
    ("Name three colours.", "demo-c"),
]


def make_demo_adapters(
    out_dir: str | os.PathLike,
    base_weights: dict[str, torch.Tensor],
    config: ModelConfig,
    *,
    names: Sequence[str] | None = None,
    rank: int = 8,
    base_model_name_or_path: str | None = None,
) -> dict[str, Path]:
    """Write the demo adapters under ``out_dir/<name>/``; return name -> directory.

    Args:
        out_dir: parent directory (created).
        base_weights: HF-named base weights (to scale each update relative to its base weight).
        config: the base model's configuration.
        names: which of ``DEMO_ADAPTERS`` (default all).
        rank: LoRA rank r (lora_alpha = 2 r, so scaling = 2), at most the smallest input or output width of the
            modules the demo adapters target (a larger r adds no expressiveness, only bytes).

    Raises:
        ValueError: ``rank`` below 1 or above that width, an unknown name in ``names``, or an argument of the wrong
            type (``out_dir`` not a path, ``base_weights`` not a dict of tensors, ``config`` not a ``ModelConfig``),
            all before anything is written.
    """
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
        raise ValueError(f"out_dir: expected a directory path (str or os.PathLike), got {type(out_dir).__name__} "
                         f"{out_dir!r}"[:300])
    if not isinstance(base_weights, dict):
        raise ValueError(f"base_weights: expected a dict of HF-named base weights (name -> tensor), got "
                         f"{type(base_weights).__name__}")
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config: expected a ModelConfig (the base model's), got {type(config).__name__}")
    unknown = [n for n in (names or ()) if n not in DEMO_ADAPTERS]
    if isinstance(names, str) or unknown:
        raise ValueError(f"names: expected a list of {', '.join(DEMO_ADAPTERS)}, got {names!r}"[:300])
    check_demo_rank(rank, config, names)
    out = Path(out_dir)
    result = {}
    for name in names or DEMO_ADAPTERS:
        seed, rel, modules = DEMO_ADAPTERS[name]
        g = torch.Generator().manual_seed(seed)
        alpha = 2 * rank
        tensors = {}
        for layer in range(config.num_layers):
            for m in modules:
                d_in, d_out = config.module_shape(m)
                a = torch.randn(rank, d_in, generator=g) / d_in**0.5
                b = torch.randn(d_out, rank, generator=g)
                w = base_weights[f"{config.hf_module_name(layer, m)}.weight"].float()
                delta_norm = (alpha / rank) * (b @ a).norm()
                b *= rel * w.norm() / delta_norm
                tensors[(layer, m)] = (a, b)
        result[name] = save_peft_adapter(
            out / name, tensors, r=rank, lora_alpha=alpha, target_modules=list(modules),
            base_model_name_or_path=base_model_name_or_path,
        )
    return result


def check_demo_rank(rank: Any, config: ModelConfig, names: Sequence[str] | None = None) -> None:
    """Refuse a demo ``rank`` that is not an int from 1 to the narrowest side of the modules the demo adapters
    ``names`` (default: all) target in a model of ``config`` (a rank past it adds only bytes). Needs only the
    configuration, so ``make-demo-adapters`` checks ``--rank`` before the weights load.

    Raises:
        ValueError: ``"rank: expected an int from 1 to <width> (module ... is <in> -> <out> ...), got ..."``.
    """
    widths = {m: config.module_shape(m) for n in (names or DEMO_ADAPTERS) for m in DEMO_ADAPTERS[n][2]}
    narrowest = min(widths, key=lambda m: min(widths[m]))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(widths[narrowest]):
        raise ValueError(f"rank: expected an int from 1 to {min(widths[narrowest])} (module {narrowest!r} is "
                         f"{widths[narrowest][0]} -> {widths[narrowest][1]}: a LoRA rank above its narrower side "
                         f"adds only bytes), got {rank!r}")


def write_demo_adapters(out_dir: str | os.PathLike, what: str, *args, **kwargs) -> dict[str, Path]:
    """``make_demo_adapters(out_dir, *args, **kwargs)`` with a failed write (a directory that cannot be made, a full
    disk, a file system that refuses files: ``check_output_dir``'s permission test cannot see all of them) raised as a
    ValueError naming ``what`` (the flag), the path and the system's reason."""
    try:
        return make_demo_adapters(out_dir, *args, **kwargs)
    except OSError as e:  # (save_peft_adapter raises safetensors' write errors as OSErrors too)
        at = f" ({e.filename})" if e.filename and str(e.filename) != str(out_dir) else ""
        raise ValueError(f"{what} {out_dir}: the demo adapters could not be written: {e.strerror or e}{at}") from None


def default_demo_dir() -> Path:
    return Path(os.environ.get("MULTILORA_HOME", Path.home() / ".cache" / "multilora")) / "demo-adapters"


def check_output_dir(path: str | os.PathLike, what: str, *, writable: bool = True) -> None:
    """Raise ValueError naming ``what`` (a flag) when ``path`` cannot be a directory to write adapters in: it exists
    and is not a directory, its nearest existing ancestor is not a directory, or (``writable``) that ancestor is not
    writable, or (``writable``, for a directory still to be made) its ancestor refuses a new directory (a probe of a
    unique name, removed again). The path as given (no ``~`` expansion: the writes take it as given too)."""
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            raise ValueError(f"{what} {path}: not a directory (a file of that name exists)")
        ancestor = next((a for a in (p, *p.parents) if a.exists()), Path("."))
        if not ancestor.is_dir():
            raise ValueError(f"{what} {path}: {ancestor} is not a directory, so nothing can be made under it")
    except OSError as e:  # (a parent we may not search)
        raise ValueError(f"{what} {path}: {e.strerror or e}") from None
    if writable and not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: {ancestor} is not writable")
    if writable and not p.is_dir():
        # a file system that refuses a new directory says so now, not after the model loads (os.access passes for
        # root, and on /proc or a read-only mount): the probe makes a directory of a fresh unique name in the
        # nearest existing ancestor and removes exactly that one, so it never touches one it did not make
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".multilora-probe-", dir=ancestor))
        except OSError as e:
            raise ValueError(f"{what} {path}: cannot make the directory: {e.strerror or e}") from None


def run_demo(adapters_dir: str | os.PathLike | None = None, *, max_tokens: int = 32, model: str | None = None,
             max_lora_rank: int | None = None) -> int:
    """Load the (default) model, write demo adapters if missing, generate a mixed batch, print it.
    ``max_lora_rank``: the engine's (None: ``EngineConfig``'s default), for demo adapters of a higher rank."""
    from multilora.runtime.engine import Engine
    from multilora.runtime.sampling import SamplingParams
    from multilora.runtime.weights import load_model_files, model_label

    def missing_in(d: Path) -> list[str]:
        return [n for n in DEMO_ADAPTERS if not (d / n / "adapter_config.json").is_file()]

    # a path that cannot hold the adapters fails now, not after the model loads (writable only if some is missing)
    if adapters_dir:
        check_output_dir(adapters_dir, "--adapters-dir", writable=bool(missing_in(Path(adapters_dir))))
    engine = Engine(model) if max_lora_rank is None else Engine(model, max_lora_rank=max_lora_rank)
    d = Path(adapters_dir) if adapters_dir else default_demo_dir() / model_label(engine.model_path)
    missing = missing_in(d)
    if missing:
        print(f"Writing demo adapters {', '.join(missing)} to {d}")
        _, weights = load_model_files(engine.model_path, dtype=torch.float32, progress=False)
        write_demo_adapters(d, "--adapters-dir" if adapters_dir else "the demo adapters' directory ($MULTILORA_HOME/"
                            "demo-adapters/...)", weights, engine.config, names=missing,
                            base_model_name_or_path=str(engine.model_path))
        del weights
    for name in DEMO_ADAPTERS:
        a = engine.load_adapter(name, d / name)
        print(f"adapter {name}: {a.target_summary()}  ({d / name})")
    prompts = [[{"role": "user", "content": p}] for p, _ in DEMO_PROMPTS]
    names = [a for _, a in DEMO_PROMPTS]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, adapters=names, sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           progress=True)  # (a bar on stderr: the requests finished and the tokens so far)
    elapsed = time.perf_counter() - t0
    print()
    for (p, a), o in zip(DEMO_PROMPTS, outs):
        k = len(o.token_ids)
        print(f"[{a or 'base'}] {p}\n    -> {o.text.strip()!r}  ({k} token{'s' * (k != 1)}, {o.finish_reason})")
    n = sum(len(o.token_ids) for o in outs)
    print(f"\n{len(outs)} requests, {len(set(names) - {None})} adapters + base in one batch: "
          f"{n} tokens in {elapsed:.2f} s = {n / elapsed:.1f} tokens/s on {engine.device} ({engine.dtype})")
    return 0
