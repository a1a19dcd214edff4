"""specverify: speculative decoding with adaptive verification from an online-calibrated estimator."""

from specverify.config import ConfigError, EngineConfig, SpeculativeConfig
from specverify.engine.sequence import RequestOutput
from specverify.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AcceptanceEstimator",
    "ConfigError",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Heavy modules load on first use so `import specverify` stays fast for the CLI.
    if name == "LLM":
        from specverify.llm import LLM

        return LLM
    if name == "AcceptanceEstimator":
        from specverify.estimator import AcceptanceEstimator

        return AcceptanceEstimator
    raise AttributeError(f"module 'specverify' has no attribute {name!r}")
