"""PEFT LoRA adapters for a Llama-family base model: load, validate, and write them.

An adapter on disk is a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``, the
files ``peft.PeftModel.save_pretrained`` writes. :func:`load_peft_adapter` turns one into a
:class:`LoRAAdapter`: for every targeted ``(layer, module)`` the pair

    A = lora_A.weight  [r, in_features]    float32, CPU, contiguous
    B = lora_B.weight  [out_features, r]   float32, CPU, contiguous

and the scaling ``s`` so that the module computes ``y = x W^T + s * (x A^T) B^T``:

    s = lora_alpha / r            (LoRA, Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")
    s = lora_alpha / sqrt(r)      (rsLoRA, Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for
                                   Fine-Tuning with LoRA"; ``use_rslora: true``)

with ``r`` and ``lora_alpha`` taken per module after ``rank_pattern`` / ``alpha_pattern``.

Which modules an adapter targets follows PEFT's rules, applied to the HF module names of the base model
(``model.layers.3.self_attn.q_proj``):

- ``target_modules`` as a list: an entry matches a module whose full name equals it or ends with
  ``"." + entry``; ``layers_to_transform`` (int or list, with optional ``layers_pattern``) then keeps only the
  listed layers (not for an entry that equals the full name; a layer the model does not have is skipped, as PEFT
  skips it, with a warning). An entry that matches no module of the model is skipped too (PEFT skips it
  silently; this warns once), as long as another entry matches. ``"all-linear"`` means the seven projections.
- ``target_modules`` as a string: a regex matched with ``re.fullmatch`` against the full module name.
- ``exclude_modules`` (list: exact name or suffix; string: ``re.fullmatch``) removes modules.
- ``rank_pattern`` / ``alpha_pattern``: the first key ``k`` (in the file's order) with
  ``re.match(rf"(.*\\.)?({k})$", module_name)`` gives the module's rank / alpha; else ``r`` / ``lora_alpha``.
  PEFT writes ``adapter_config.json`` with sorted keys, so when patterns overlap the file's order may differ
  from the one used in training. For ``rank_pattern`` the tensor shapes then disagree and loading fails with a
  note saying so; overlapping ``alpha_pattern`` keys of different values leave no such trace, so the load warns
  (once per file) naming the keys and the module, and uses the first key as PEFT's reload does.

Everything this runtime cannot serve exactly is refused with :class:`AdapterError`, never ignored: DoRA and
other LoRA variants, ``modules_to_save``, trained biases (a ``bias`` tensor in the weight file: ``bias`` "all" /
"lora_only" on a model without biases saves none, and is plain LoRA, as PEFT serves it), targets other than the seven
Llama projections, initialisations that expect a modified base model (PiSSA, OLoRA, CorDA, LoRA-GA, LoftQ),
and any tensor that does not fit the base model. ``fan_in_fan_out: true`` is taken as false with a warning, as
PEFT takes it for an ``nn.Linear`` target (every projection served here). Loading is all-or-nothing and touches no
global state.

One module per job; each imports only the ones listed above it:

- ``spec``: ``adapter_config.json`` parsed and validated, the table of PEFT features refused, :class:`AdapterError`.
- ``targets``: PEFT's target rules: which ``(layer, module)`` an adapter targets, with which rank and alpha,
  and which ``(layer, module)`` a tensor key names.
- ``disk``: the files as plain reads (never memory-mapped): odd paths said as such, the files' stamps
  (inode, size, mtime, ctime), reads that fail "changed while it was being read" under a concurrent writer.
- ``files``: the weight file: safetensors (whole, header-only or lazily), a pickle only when allowed.
- ``load``: one loading path that validates every tensor and hands each module to a sink:
  :func:`load_peft_adapter` (float32 copies), :func:`load_peft_adapter_into` (the caller's sink) and
  :func:`read_packed_adapter` (the pool image: the engine's disk -> host path).
- ``image``: :func:`~multilora.runtime.adapters.image.read_image`, the adapter cache's disk -> host read: a
  safetensors file straight into its pool image (a cached copy plan, lora_A read in place, lora_B transposed),
  bit-identical to ``read_packed_adapter`` and refusing with its messages; :func:`read_adapter`
  (``Engine.load_adapter``'s read: the image, or only the header, through the same cached plans: ``read_header``).
- ``writer``: :func:`save_peft_adapter`.
"""

from multilora.runtime.adapters.disk import PICKLE_NAME, SAFETENSORS_NAME
from multilora.runtime.adapters.load import (
    LoRAAdapter,
    LoRAModuleWeights,
    ModuleSink,
    check_adapter_files,
    load_peft_adapter,
    load_peft_adapter_into,
    read_packed_adapter,
)
from multilora.runtime.adapters.image import read_adapter
from multilora.runtime.adapters.spec import CONFIG_NAME, AdapterError
from multilora.runtime.adapters.writer import save_peft_adapter

__all__ = [
    "AdapterError",
    "LoRAAdapter",
    "LoRAModuleWeights",
    "check_adapter_files",
    "load_peft_adapter",
    "load_peft_adapter_into",
    "ModuleSink",
    "save_peft_adapter",
    "CONFIG_NAME",
    "SAFETENSORS_NAME",
    "PICKLE_NAME",
    "read_adapter",
    "read_packed_adapter",
]
