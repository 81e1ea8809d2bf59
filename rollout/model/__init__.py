"""The Llama-family decoder the engine runs, dense or with experts: its
config, weights, attention over paged KV, rotary embedding, sparse layers
and checkpoint loader."""

from .config import ModelConfig, RopeConfig
from .decoder import Model, rms_norm
from .moe_config import MoeConfig

__all__ = ["Model", "ModelConfig", "MoeConfig", "RopeConfig", "rms_norm"]
