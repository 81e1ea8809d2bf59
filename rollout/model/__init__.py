"""The Llama-family decoder the engine runs: its config, weights, attention
over paged KV, rotary embedding and checkpoint loader."""

from .config import ModelConfig, RopeConfig
from .decoder import Model, rms_norm

__all__ = ["Model", "ModelConfig", "RopeConfig", "rms_norm"]
