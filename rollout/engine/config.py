"""`EngineConfig`: the engine's resolved sizes, device and dtype, validated.

Resolving only validates and computes: nothing is allocated, built or compiled
here, so a bad argument raises before anything heavy happens."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from workspace import KVPool

from ..checks import check_int
from ..kernels.choice import REQUESTS as KERNELS
from ..kernels.triton.launch import unavailable_reason
from ..model.config import ModelConfig
from .decode_graphs import MODES, resolve_mode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Share of free memory the default KV pool may take. On the CPU the pool only
# reserves address space (pages become resident as KV is written), so the share
# bounds what a long run's KV and prefix cache can grow to, not the start-up cost.
_KV_SHARE_CUDA = 0.8
_KV_SHARE_CPU = 0.25


@dataclass(frozen=True, slots=True)
class EngineConfig:
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype  # the KV pool's dtype: `dtype`, or bfloat16 under float32 (half the bytes)
    matmul_dtype: torch.dtype  # what the layers' projections multiply in: `dtype`, or bfloat16 under float32
    max_batch_size: int  # sequences decoding at once
    max_seq_len: int  # prompt plus output tokens of one sequence
    page_size: int  # tokens per KV page
    num_pages: int  # pages in the KV pool
    max_step_tokens: int  # tokens computed per step (prefill chunk budget)
    seed: int  # seeds the per-request seeds of unseeded requests
    decode_graphs: str  # resolved: "off", "eager" or "cuda" (see rollout.engine.decode_graphs)
    kernels: str  # "compiled", "triton" (rollout.kernels) or "torch" (torch ops); "auto" until the Engine loads them
    max_request_tokens: int | None = None  # bound on one call's prompts x n x (prompt + max_tokens); None: none
    async_scheduling: bool = False  # resolved: steps overlapped with the host's work (rollout.engine.pipeline)

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_pages * self.page_size

    @classmethod
    def resolve(
        cls,
        mc: ModelConfig,
        *,
        device,
        dtype,
        max_batch_size,
        max_seq_len,
        kv_cache_tokens,
        seed,
        page_size,
        max_step_tokens,
        decode_graphs="auto",
        kernels="auto",
        kv_cache_dtype=None,
        matmul_dtype=None,
        max_request_tokens=None,
        async_scheduling="auto",
    ) -> EngineConfig:
        dev = _device(device)
        graphs = resolve_mode(decode_graphs, dev) if isinstance(decode_graphs, str) else None
        if graphs is None:
            raise TypeError(f"decode_graphs must be a str, one of {MODES}, got {type(decode_graphs).__name__}")
        if mc.moe is not None and graphs == "cuda":  # the sparse blocks read their experts' token counts on the host
            if decode_graphs == "cuda":
                raise ValueError("decode_graphs='cuda' is not available for mixture-of-experts models; use 'off'")
            graphs = "off"
        dt = _dtype(dtype)
        kv_dt = _narrower_dtype(kv_cache_dtype, dt, "kv_cache_dtype")
        matmul_dt = _narrower_dtype(matmul_dtype, dt, "matmul_dtype")
        # The checks return plain ints: numpy scalars from a caller stop here.
        max_batch_size = check_int("max_batch_size", max_batch_size, 1)
        page_size = check_int("page_size", page_size, 1)
        seed = check_int("seed", seed, 0)
        if max_seq_len is None:
            max_seq_len = mc.max_position_embeddings
        max_seq_len = check_int("max_seq_len", max_seq_len, 2)
        if max_seq_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_seq_len must be <= the model's max_position_embeddings "
                f"({mc.max_position_embeddings}), got {max_seq_len}"
            )
        if max_step_tokens is None:
            max_step_tokens = max(2048, max_batch_size)
        max_step_tokens = check_int("max_step_tokens", max_step_tokens, max_batch_size, "(at least max_batch_size)")
        if kv_cache_tokens is None:
            kv_cache_tokens = _default_kv_tokens(mc, dev, kv_dt, max_batch_size * max_seq_len)
        kv_cache_tokens = check_int("kv_cache_tokens", kv_cache_tokens, page_size, "(at least one page)")
        kernel_choice = check_kernels(kernels, dev)
        overlap = resolve_async_scheduling(async_scheduling, dev)
        if max_request_tokens is not None:
            max_request_tokens = check_int("max_request_tokens", max_request_tokens, 1, "or None (no bound)")
        return cls(
            device=dev,
            dtype=dt,
            kv_cache_dtype=kv_dt,
            matmul_dtype=matmul_dt,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            page_size=page_size,
            num_pages=-(-kv_cache_tokens // page_size),
            max_step_tokens=max_step_tokens,
            seed=seed,
            decode_graphs=graphs,
            kernels=kernel_choice,
            max_request_tokens=max_request_tokens,
            async_scheduling=overlap,
        )


def resolve_async_scheduling(value, dev: torch.device) -> bool:
    """`async_scheduling` checked: "auto" is on for a CUDA device, off elsewhere
    (on the CPU the host computes the steps: there is nothing to overlap)."""
    if not isinstance(value, (bool, str)):
        raise TypeError(f"async_scheduling must be 'auto', True or False, got {type(value).__name__}")
    if value not in ("auto", True, False):
        raise ValueError(f"async_scheduling must be 'auto', True or False, got {value!r}")
    return dev.type == "cuda" if value == "auto" else value


def check_kernels(kernels, dev: torch.device) -> str:
    """The kernels request, checked for `dev` without building anything. "auto"
    stays "auto" (`rollout.kernels.load_kernels` decides: the compiled kernels on
    the CPU, the Triton ones on CUDA); "compiled" needs the CPU; "triton" needs
    CUDA, or the CPU under Triton's interpreter."""
    if not isinstance(kernels, str):
        raise TypeError(f"kernels must be a str, one of {KERNELS}, got {type(kernels).__name__}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "compiled" and dev.type != "cpu":
        raise ValueError(f"kernels='compiled' needs device 'cpu', got {dev}")
    if kernels == "triton" and (reason := unavailable_reason(dev)) is not None:
        raise ValueError(f"kernels='triton' cannot run here: {reason}")
    return kernels


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device ('cpu', 'cuda', 'cuda:1'), got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices")
    return dev


def _dtype(dtype, field: str = "dtype") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"{field} must be one of {tuple(DTYPES)}, got {dtype}")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"{field} must be a str or torch.dtype, got {type(dtype).__name__}")
    if dtype not in DTYPES:
        raise ValueError(f"{field} must be one of {tuple(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _narrower_dtype(value, dtype: torch.dtype, field: str) -> torch.dtype:
    """`kv_cache_dtype` or `matmul_dtype`: None means the model's `dtype`; a
    float32 model may also take bfloat16 there (the KV pool's bytes halved, or
    the projections multiplied in bfloat16; logprobs then move away from a
    float32 trainer's by that rounding, see docs/design.md)."""
    if value is None:
        return dtype
    narrow = _dtype(value, field)
    allowed = (dtype, torch.bfloat16) if dtype == torch.float32 else (dtype,)
    if narrow not in allowed:
        names = ", ".join(repr(str(d).removeprefix("torch.")) for d in allowed)
        raise ValueError(f"{field} must be None or one of {names} for dtype {dtype}, got {value!r}")
    return narrow


def _default_kv_tokens(mc: ModelConfig, device: torch.device, dtype: torch.dtype, wanted: int) -> int:
    """KV tokens when `kv_cache_tokens` is not given: `wanted` (what `max_batch_size`
    full sequences need), capped at 80% of free CUDA memory or, on the CPU, 25% of
    the host's available memory, over the bytes one token's K and V take in every layer."""
    per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * _KV_SHARE_CUDA)
    else:
        budget = int(_available_host_memory() * _KV_SHARE_CPU)
    return max(1, min(wanted, budget // per_token))


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
