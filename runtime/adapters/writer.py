"""Writing an adapter in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``)."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Mapping

import torch

from multilora.config import MODULE_INDEX, MODULE_PARENT, TARGET_MODULES
from multilora.runtime.adapters.disk import SAFETENSORS_NAME
from multilora.runtime.adapters.spec import CONFIG_NAME, AdapterError, _fmt_shape, _is_int, _parse_config
from multilora.runtime.adapters.targets import _PEFT_PREFIX, _is_targeted, _overlap_hint, _pattern_value


def save_peft_adapter(
    out_dir: str | os.PathLike,
    modules: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    *,
    r: int,
    lora_alpha: float,
    target_modules: list[str] | str,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    layers_to_transform: int | list[int] | None = None,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write a LoRA adapter in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

    ``peft.PeftModel.from_pretrained`` loads the result, and so does :func:`load_peft_adapter`.

    Args:
        out_dir: the directory to write (created if needed; the two files are replaced atomically).
        modules: ``(layer, module) -> (A [r_m, in_features], B [out_features, r_m])``, PEFT's ``lora_A.weight``
            and ``lora_B.weight``; ``module`` in ``TARGET_MODULES``. Tensors are written in their own dtype.
        r, lora_alpha, use_rslora, rank_pattern, alpha_pattern, layers_to_transform, base_model_name_or_path:
            the LoraConfig fields of the same names. ``r_m`` must be the module's rank after ``rank_pattern``.
        target_modules: module names (suffix match) or one regex string, as in PEFT.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: no modules; an unknown module; a tensor that is not 2-D, whose A and B ranks differ, whose
            rank disagrees with ``r`` / ``rank_pattern``; or a (layer, module) that the config would not target.
        OSError: a file that cannot be written (a directory that cannot be made, a full disk; safetensors' own
            write errors too), the files already there left as they were.
    """
    if not modules:
        raise ValueError("save_peft_adapter: modules is empty; an adapter needs at least one (layer, module)")
    if not _is_int(r) or r <= 0:
        raise ValueError(f"save_peft_adapter: r must be a positive int, got {r!r}")
    if isinstance(target_modules, str):
        tm: list[str] | str = target_modules
    else:
        tm = list(dict.fromkeys(target_modules))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": tm,
        "exclude_modules": None,
        "use_rslora": bool(use_rslora),
        "use_dora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "lora_bias": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "rank_pattern": dict(rank_pattern or {}),
        "alpha_pattern": dict(alpha_pattern or {}),
        "layers_to_transform": layers_to_transform,
        "layers_pattern": None,
    }
    # PEFT writes the config with sorted keys, which also reorders rank_pattern / alpha_pattern (first match
    # wins): validate what a reader of the file will see.
    config = json.loads(json.dumps(config, sort_keys=True))
    here = Path(out_dir) / CONFIG_NAME
    try:
        spec = _parse_config(config, here)
    except AdapterError as e:
        raise ValueError(f"save_peft_adapter: {e}") from e

    tensors: dict[str, torch.Tensor] = {}
    for (layer, module), (a, b) in sorted(modules.items(), key=lambda kv: (kv[0][0], MODULE_INDEX.get(kv[0][1], 99))):
        if module not in MODULE_INDEX or not _is_int(layer) or layer < 0:
            raise ValueError(
                f"save_peft_adapter: bad module key {(layer, module)!r}; "
                f"expected (layer >= 0, one of {TARGET_MODULES})"
            )
        name = f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"save_peft_adapter: {name}: expected A [r, in] and B [out, r] with the same r, "
                f"got A {_fmt_shape(a.shape)} and B {_fmt_shape(b.shape)}"
            )
        if not _is_targeted(spec, name):
            raise ValueError(f"save_peft_adapter: {name} is not targeted by target_modules={tm!r} / "
                             f"layers_to_transform={layers_to_transform!r}")
        want, _ = _pattern_value(spec.rank_pattern, name, r)
        if a.shape[0] != want:
            raise ValueError(
                f"save_peft_adapter: {name}: rank from r / rank_pattern is {want}, got {a.shape[0]}"
                + _overlap_hint(spec.rank_pattern, name)
            )
        tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().to("cpu").contiguous().clone()
        tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = b.detach().to("cpu").contiguous().clone()

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def atomic(dest: Path, write) -> None:
        for _ in range(100):  # a new file of a free name (mkstemp's 0600 would keep other users out): the mode
            tmp = out / f".{dest.name}.{secrets.token_hex(6)}.tmp"  # open() gives, 0666 less the umask
            try:
                os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"{out}: no free temporary file name for {dest.name}")
        try:
            mode = os.stat(tmp).st_mode & 0o777  # what the umask of this moment gave it
            write(str(tmp))
            if os.stat(tmp).st_mode & 0o777 != mode:  # (safetensors writes a new file of mode 0600)
                try:
                    os.chmod(tmp, mode)
                except OSError:  # a file system without modes (vfat, some FUSE mounts): the file is still written
                    pass
            os.replace(tmp, dest)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def write_safetensors(p: str) -> None:
        try:
            save_file(tensors, p, metadata={"format": "pt"})
        except SafetensorError as e:  # (its I/O errors are not OSErrors: "File too large (os error 27)")
            raise OSError(f"{out / SAFETENSORS_NAME}: {e}") from e

    atomic(out / SAFETENSORS_NAME, write_safetensors)

    def write_json(p: str) -> None:
        with open(p, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")

    atomic(out / CONFIG_NAME, write_json)
    return out
