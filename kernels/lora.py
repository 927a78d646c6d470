"""The LoRA apply op: shrink + expand for a batch in which every token names its own adapter slot.

Semantics (for each fused slice ``i`` with output columns ``[c_i, c_i + d_out_i)``)::

    for every token t with s = token_slots[t] >= 0 and r = ranks_i[s] > 0:
        y[t, c_i : c_i + d_out_i] += scalings_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T
    rows with s == -1 (and modules an adapter does not touch, r == 0) are left exactly as they were.

``A_i[s]`` [r, d_in] and ``B_i[s]`` [d_out_i, r] are read from the paged adapter pool through
``page_table[s]`` (layout: ``multilora.memory.pool``); shrink is ``v = x A^T`` (d_in -> r),
expand is ``y += scaling * v B^T`` (r -> d_out). Accumulation is in float32.

The per-step ``LoRAPlan`` is built ONCE per engine step (``build_lora_plan``) and passed explicitly
to every layer; nothing is read from module-global state.

Backends: ``"torch"`` (this file; the CPU path and the test oracle) and ``"triton"`` (GPU kernels in
``multilora.kernels.triton_sgmv`` when present). ``lora_apply(..., backend=None)`` picks triton for CUDA
tensors when it is importable, else torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch



@dataclass(frozen=True)
class LoRAModuleView:
    """Where one (layer, module) lives in the paged adapter pool: what a kernel needs to read every slot's A
    and B (layout: ``multilora.memory.pool``, which builds these with ``AdapterPool.module_view``).

    All tensors are shared with the pool (no copies). ``ranks[slot]`` and ``scalings[slot]`` are this
    module's entries; ``page_table`` is the pool's.
    """

    buffer: torch.Tensor  # [num_pages, page_elems]
    page_table: torch.Tensor  # int32 [max_slots, max_pages_per_slot]
    ranks: torch.Tensor  # int32 [max_slots]
    scalings: torch.Tensor  # float32 [max_slots]
    offset_a: int
    offset_b: int
    d_in: int
    d_out: int
    page_rows: int
    page_elems: int
    layer: int
    module: str


@dataclass(frozen=True)
class LoRAPlan:
    """The frozen per-step description of which adapter slot each token uses.

    Attributes:
        token_slots: int32 ``[num_tokens]`` on the compute device; ``-1`` = no adapter.
        num_tokens: ``T``.
        slot_ids: the distinct slots ``>= 0`` of the batch, ascending (host ints).
        token_index: for each entry of ``slot_ids``, int64 ``[n_s]`` indices of its tokens (device).
        has_lora: False when no token has an adapter (every op is then a no-op).
        extra: backend-specific metadata built once per step (e.g. sorted token order, segments).

    Example: ``token_slots = [1, 2, 3, 2, 3, 2, 3, -1]`` gives ``slot_ids = (1, 2, 3)`` and
    ``token_index = ([0], [1, 3, 5], [2, 4, 6])``; token 7 is untouched.
    """

    token_slots: torch.Tensor
    num_tokens: int
    slot_ids: tuple[int, ...]
    token_index: tuple[torch.Tensor, ...]
    has_lora: bool
    extra: dict = field(default_factory=dict)


def build_lora_plan(token_slots: Sequence[int] | torch.Tensor, device: torch.device | str = "cpu") -> LoRAPlan:
    """Build the per-step LoRA plan from one slot id per token (``-1`` = no adapter).

    Args:
        token_slots: ``[num_tokens]`` ints (list or tensor), each ``-1`` or a resident slot.
        device: where the plan's tensors live (the model's device).

    Raises:
        ValueError: a slot id below -1 or a tensor that is not 1-D.
    """
    slots = torch.as_tensor(token_slots, dtype=torch.int64).cpu()
    if slots.dim() != 1:
        raise ValueError(f"token_slots: expected a 1-D sequence of slot ids, got shape {tuple(slots.shape)}")
    if slots.numel() and int(slots.min()) < -1:
        raise ValueError(f"token_slots: slot ids must be >= -1, got {int(slots.min())}")
    # tokens grouped by slot, ascending within each slot (stable sort; the -1 tokens sort first), on the host
    s = slots.numpy()
    order = np.argsort(s, kind="stable")
    order = order[np.count_nonzero(s < 0) :]
    grouped = s[order]
    starts = np.ones(grouped.size, dtype=bool)
    np.not_equal(grouped[1:], grouped[:-1], out=starts[1:])
    first = np.flatnonzero(starts)  # where each slot's run starts
    ids = grouped[first].tolist()
    ends = np.empty_like(first)
    ends[:-1] = first[1:]
    ends[-1:] = grouped.size
    counts = (ends - first).tolist()
    index = torch.from_numpy(order).to(device).split(counts) if ids else ()
    plan = LoRAPlan(
        token_slots=slots.to(torch.int32).to(device),
        num_tokens=int(slots.numel()),
        slot_ids=tuple(ids),
        token_index=tuple(index),
        has_lora=bool(ids),
    )
    from multilora.kernels.backends import _extend_plan  # backends add their metadata once per step

    _extend_plan(plan)
    return plan


def _check(y: torch.Tensor, x: torch.Tensor, views: Sequence[LoRAModuleView], plan: LoRAPlan) -> None:
    if x.dim() != 2 or y.dim() != 2:
        raise ValueError(f"x and y must be 2-D [num_tokens, features], got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[0] != plan.num_tokens or y.shape[0] != plan.num_tokens:
        raise ValueError(
            f"plan has {plan.num_tokens} tokens but x has {x.shape[0]} rows and y has {y.shape[0]} rows"
        )
    if not views:
        raise ValueError("views: expected at least one LoRAModuleView (fused slice)")
    if any(v.d_in != x.shape[1] for v in views):
        raise ValueError(f"x: expected {views[0].d_in} features for module {views[0].module}, got {x.shape[1]}")
    total = sum(v.d_out for v in views)
    if y.shape[1] != total:
        raise ValueError(f"y: expected {total} columns (sum of fused slice widths), got {y.shape[1]}")


def gather_adapter(view: LoRAModuleView, slot: int) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """(A [r, d_in], B^T [r, d_out], scaling, r) of one slot for one module, gathered from the pool pages."""
    r = int(view.ranks[slot])
    R = view.page_rows
    npg = -(-r // R)
    pages = view.page_table[slot, :npg].long()
    # narrow first (a view), then gather only this module's slice of each page
    a = view.buffer.narrow(1, view.offset_a, R * view.d_in).index_select(0, pages).reshape(npg * R, view.d_in)[:r]
    bt = view.buffer.narrow(1, view.offset_b, R * view.d_out).index_select(0, pages).reshape(npg * R, view.d_out)[:r]
    return a, bt, float(view.scalings[slot]), r


def lora_apply_torch(y: torch.Tensor, x: torch.Tensor, views: Sequence[LoRAModuleView], plan: LoRAPlan) -> torch.Tensor:
    """Torch reference of ``lora_apply``: a loop over the distinct slots of the batch (fp32 math)."""
    if not plan.has_lora:
        return y
    col = 0
    for v in views:
        ys = y[:, col : col + v.d_out]
        for slot, idx in zip(plan.slot_ids, plan.token_index):
            a, bt, scaling, r = gather_adapter(v, slot)
            if r == 0:
                continue
            xs = x.index_select(0, idx).float()  # [n_s, d_in]
            delta = (xs @ a.float().t()) @ bt.float()  # shrink [n_s, r], expand [n_s, d_out]
            delta.mul_(scaling)
            ys.index_copy_(0, idx, (ys.index_select(0, idx).float() + delta).to(y.dtype))
        col += v.d_out
    return y


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    views: Sequence[LoRAModuleView],
    plan: LoRAPlan,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Add every token's LoRA delta to ``y`` in place (semantics in the module docstring).

    Args:
        y: ``[num_tokens, sum(v.d_out for v in views)]`` base output, float16/bfloat16/float32; updated in place.
        x: ``[num_tokens, d_in]`` layer input, same device.
        views: one ``LoRAModuleView`` per fused slice (e.g. q, k, v), in the column order of ``y``.
        plan: the step's ``LoRAPlan``.
        backend: ``"torch"``, ``"triton"`` or None (triton on CUDA when available, else torch).

    Returns:
        ``y``.

    Raises:
        ValueError: shapes that disagree with each other or with the plan.
    """
    _check(y, x, views, plan)
    from multilora.kernels.backends import resolve_backend

    return resolve_backend(backend, x)(y, x, views, plan)
