"""multilora: batched multi-LoRA inference. ``from multilora import Engine, SamplingParams``."""

from multilora.runtime.engine import Engine, RequestOutput
from multilora.runtime.sampling import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
