"""Routed-expert ids (Router Replay), packed for the wire.

The engine records, for every token it forwards, the expert ids each MoE layer chose: an integer
array of shape [tokens, moe_layers, top_k]. On the wire it travels as `RoutedExperts`: the array's
little-endian bytes, base64-encoded, as uint8 (<= 256 experts) or uint16. A token whose choice
was not recorded (e.g. the last sampled token, which the engine never forwarded) holds the dtype's
maximum value, `UNRECORDED`; the trainer routes such tokens with its own top-k.
"""

from __future__ import annotations

import base64

import numpy as np

from services.common.schemas import RoutedExperts


def routing_dtype(n_experts: int) -> np.dtype:
    # The maximum value is the "unrecorded" sentinel, so uint8 holds ids 0..254.
    return np.dtype(np.uint8) if n_experts < 255 else np.dtype(np.uint16)


def unrecorded(dtype: np.dtype) -> int:
    return int(np.iinfo(dtype).max)


def encode(ids: np.ndarray) -> RoutedExperts:
    if ids.ndim != 3 or ids.dtype not in (np.uint8, np.uint16):
        raise ValueError(
            f"routed experts must be a [tokens, layers, top_k] uint8/uint16 array, got {ids.dtype}{ids.shape}"
        )
    data = np.ascontiguousarray(ids).astype(ids.dtype.newbyteorder("<"), copy=False).tobytes()
    return RoutedExperts(dtype=str(ids.dtype), shape=list(ids.shape), data=base64.b64encode(data).decode())


def decode(r: RoutedExperts) -> np.ndarray:
    dtype = np.dtype(r.dtype).newbyteorder("<")
    arr = np.frombuffer(base64.b64decode(r.data), dtype=dtype)
    return arr.reshape(r.shape).astype(np.dtype(r.dtype), copy=False)


def blank(num_tokens: int, layers: int, top_k: int, dtype: np.dtype) -> np.ndarray:
    return np.full((num_tokens, layers, top_k), unrecorded(dtype), dtype=dtype)


def concat(parts: list[np.ndarray]) -> np.ndarray:
    """Join per-turn arrays along the token axis (shapes and dtypes must agree past axis 0)."""
    return np.concatenate(parts, axis=0)
