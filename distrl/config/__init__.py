"""The one typed config tree.

Validated once at the boundary (`load`), then handed down in slices: each component receives only its own section
(`cfg.loss`, `cfg.rollout`, ...). Every model forbids unknown keys so that a typo is an error, not a silent default.
Variants that are different things (the policy objective, the KL's target, the correction mode, the learning-rate
schedule, the loop) are discriminated unions, so that a field of one cannot be written under another. Checks that
span sections live on `Config` and name every field they involve.

One module per section group; this package imports only Pydantic and PyYAML: `distrl validate` and `distrl --help`
must stay light.
"""

from distrl.config.algorithm import AlgorithmConfig
from distrl.config.cluster import ClusterConfig, HybridConfig, RecoveryConfig, RoleResources, RolloutResources
from distrl.config.correction import CorrectionConfig, RatioCorrection, SeqMaskTISCorrection
from distrl.config.env import EnvConfig
from distrl.config.eval import EvalConfig, EvalSamplingConfig, EvalSetConfig
from distrl.config.learner import (
    ConstantSchedule,
    CosineSchedule,
    CriticConfig,
    FSDPStrategy,
    LearnerConfig,
    LoraConfig,
    LRSchedule,
    ReferenceConfig,
    ReplicateStrategy,
    Strategy,
)
from distrl.config.loading import from_dict, load, to_yaml
from distrl.config.loop import AsyncLoop, Loop, SyncLoop
from distrl.config.loss import KLConfig, KLInLoss, KLInReward, LossConfig
from distrl.config.model import DataConfig, ModelConfig
from distrl.config.policy import (
    COVARIANCE_TYPES,
    CISPOConfig,
    ClipCovConfig,
    GMPOConfig,
    GPGConfig,
    GSPOConfig,
    KLCovConfig,
    PolicyConfig,
    PPOConfig,
    SAPOConfig,
)
from distrl.config.reward import RewardConfig
from distrl.config.rollout import DynamicSamplingConfig, RolloutConfig, SamplingConfig
from distrl.config.root import Config
from distrl.config.run import RunConfig
from distrl.config.sources import ConfigError
from distrl.config.trackers import MlflowConfig, WandbConfig

__all__ = [
    "COVARIANCE_TYPES",
    "AlgorithmConfig",
    "AsyncLoop",
    "CISPOConfig",
    "ClipCovConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "ConstantSchedule",
    "CorrectionConfig",
    "CosineSchedule",
    "CriticConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "EnvConfig",
    "EvalConfig",
    "EvalSamplingConfig",
    "EvalSetConfig",
    "FSDPStrategy",
    "GMPOConfig",
    "GPGConfig",
    "GSPOConfig",
    "HybridConfig",
    "KLConfig",
    "KLCovConfig",
    "KLInLoss",
    "KLInReward",
    "LRSchedule",
    "LearnerConfig",
    "Loop",
    "LoraConfig",
    "LossConfig",
    "MlflowConfig",
    "ModelConfig",
    "PPOConfig",
    "PolicyConfig",
    "RatioCorrection",
    "RecoveryConfig",
    "ReferenceConfig",
    "ReplicateStrategy",
    "RewardConfig",
    "RoleResources",
    "RolloutConfig",
    "RolloutResources",
    "RunConfig",
    "SAPOConfig",
    "SamplingConfig",
    "SeqMaskTISCorrection",
    "Strategy",
    "SyncLoop",
    "WandbConfig",
    "from_dict",
    "load",
    "to_yaml",
]
