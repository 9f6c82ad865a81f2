"""`--kv-cache-dtype`: auto (the served dtype) and float8 (fp8_e4m3, fp8_e5m2).

A float8 pool stores value / scale in one byte, with one scale a layer, the same for keys and
values, from `--quantization-param-path` (the JSON SGLang and vLLM read:
`{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 1.0, ...}}}}`, the outer
key a tensor-parallel rank, the inner a layer); without it every scale is 1.0, as SGLang's
default. Attention computes in the served dtype on values read back through the scales.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from srv.sdk.attention import KVCache, KVCacheDtype

logger = logging.getLogger("srv.cache")


class AutoKVCacheDtype(KVCacheDtype):
    def __init__(self, server_args: Any = None) -> None:
        super().__init__(server_args)
        if getattr(server_args, "quantization_param_path", None):
            raise ValueError("--quantization-param-path holds float8 KV cache scales: it needs --kv-cache-dtype "
                             "fp8_e4m3 or fp8_e5m2")

    def storage_dtype(self, served: torch.dtype) -> torch.dtype:
        return served


class Float8KVCacheDtype(KVCacheDtype):
    DTYPE: torch.dtype
    NAMES: tuple[str, ...]   # how a scales file may name the dtype

    def __init__(self, server_args: Any = None) -> None:
        super().__init__(server_args)
        path = getattr(server_args, "quantization_param_path", None)
        self.scales = read_kv_scales(Path(path), self.NAMES) if path else None

    def storage_dtype(self, served: torch.dtype) -> torch.dtype:
        return self.DTYPE

    def create(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
               served: torch.dtype) -> KVCache:
        if self.scales is None:
            logger.warning("float8 KV cache without --quantization-param-path: every scale is 1.0")
            scales = [1.0] * num_layers
        else:
            missing = [layer for layer in range(num_layers) if layer not in self.scales]
            if missing:
                raise ValueError(f"--quantization-param-path has no KV cache scale for layers {missing[:8]}")
            scales = [self.scales[layer] for layer in range(num_layers)]
        return KVCache(num_slots, num_layers, num_kv_heads, head_dim, self.DTYPE, scales, scales)


class Float8E4M3(Float8KVCacheDtype):
    DTYPE, NAMES = torch.float8_e4m3fn, ("float8_e4m3fn", "fp8_e4m3", "float8_e4m3")


class Float8E5M2(Float8KVCacheDtype):
    DTYPE, NAMES = torch.float8_e5m2, ("float8_e5m2", "fp8_e5m2")


def read_kv_scales(path: Path, names: tuple[str, ...]) -> dict[int, float]:
    """Layer -> scale from a scales file, for tensor-parallel rank 0 (srv serves one rank)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--quantization-param-path {path}: {exc}") from None
    kv = data.get("kv_cache") if isinstance(data, dict) else None
    if not isinstance(kv, dict) or not isinstance(kv.get("scaling_factor"), dict):
        raise ValueError(f"--quantization-param-path {path}: no kv_cache.scaling_factor")
    if kv.get("dtype") not in (None, *names):
        raise ValueError(f"--quantization-param-path {path} holds scales for {kv.get('dtype')}, not {names[0]}")
    ranks = kv["scaling_factor"]
    if "0" not in ranks:
        raise ValueError(f"--quantization-param-path {path}: no scales for tensor-parallel rank 0")
    try:
        scales = {int(layer): float(scale) for layer, scale in ranks["0"].items()}
    except (TypeError, ValueError, AttributeError):
        raise ValueError(f"--quantization-param-path {path}: scales must map layer numbers to numbers") from None
    bad = [layer for layer, scale in scales.items() if not scale > 0 or scale == float("inf")]
    if bad:
        raise ValueError(f"--quantization-param-path {path}: layers {bad[:8]} have scales that are not positive")
    return scales
