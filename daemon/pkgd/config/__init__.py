"""The `VllmConfig` tree: models, composition (Hydra), schema, and reload planning."""

from pkgd.config.fields import ReloadClass
from pkgd.config.sections import (
    CacheConfig,
    FrontendConfig,
    LBConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SupervisorConfig,
)
from pkgd.config.vllm_config import ServePlan, VllmConfig

__all__ = [
    "CacheConfig",
    "FrontendConfig",
    "LBConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "ReloadClass",
    "SchedulerConfig",
    "ServePlan",
    "SupervisorConfig",
    "VllmConfig",
]
