"""Configuration of the runtime. The model configuration lives in ``multilora.config`` (shared with
``memory/``); it is re-exported here so ``multilora.runtime.config.ModelConfig`` keeps working."""

from __future__ import annotations

from multilora.config import MODULE_INDEX, MODULE_PARENT, TARGET_MODULES, ModelConfig

__all__ = ["MODULE_INDEX", "MODULE_PARENT", "TARGET_MODULES", "ModelConfig"]
