"""FP8 checkpoints with their own scales: HF's `"quant_method": "fp8"` (DeepSeek-V3, Kimi-K2,
Qwen3-*-FP8).

config.json carries

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

and every quantised linear `X.weight` is float8_e4m3fn (N, K) with a partner `X.weight_scale_inv`
float32 (ceil(N/128), ceil(K/128)): the weight is `q.float() * scale_inv` per 128x128 tile, which
is exactly ops/fp8/recipe.py's decoding-scale convention (dequantize_weight), so the pairs can be
used as they are. Everything else (embeddings, norms, lm_head, MoE routers) is high precision.

This module only parses/validates that config, finds the pairs and dequantises them; the engine
(services/engine/layers/fp8.load_hf_state) copies the pairs' bits into its FP8 buffers, the
trainer (trainer/model.load_weights_dir) dequantises them into its float32 master weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ops.fp8.recipe import BLOCK, FP8_DTYPE, _cdiv, default_skip, dequantize_weight
from services.common.weights_dir import SCALE_SUFFIX  # X.weight -> X.weight_scale_inv

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
FLOAT8_DTYPES = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
)


def kept_high_precision(module: str) -> bool:
    """Linears an FP8 engine keeps in high precision: ops/fp8/recipe.default_skip (lm_head,
    routers, embeddings, norms) plus MLA's kv_b_proj, whose weight the absorbed decode path reads
    directly (services/engine/layers/mla.py) rather than calling the module."""
    return default_skip(module) or module.split(".")[-1] == "kv_b_proj"


def is_fp8_weight(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether an FP8 engine holds the HF tensor `name` as E4M3 with 128x128 scales: the 2-D weight
    of every attention/MLP linear and routed expert it does not keep in high precision. A weights
    directory published for such an engine stores exactly these as (X.weight, X.weight_scale_inv)."""
    return name.endswith(".weight") and len(shape) == 2 and not kept_high_precision(name[: -len(".weight")])


class QuantizationConfig(BaseModel):
    """config.json's `quantization_config` for block-wise FP8 (transformers' FineGrainedFP8Config).
    Only what relay's kernels compute is accepted: E4M3 weights in 128x128 tiles and activations
    quantised at run time (1x128, "dynamic"). Keys this does not name are ignored (HF loading
    options such as `dequantize`); the tensors, not modules_to_not_convert, decide what is fp8."""

    model_config = ConfigDict(extra="ignore")

    quant_method: Literal["fp8"]
    fmt: Literal["e4m3"] = "e4m3"
    # "static" checkpoints ship per-tensor activation scales (input_scale) that our 1x128 dynamic
    # activation quantisation would ignore: refused rather than silently computing something else.
    activation_scheme: Literal["dynamic"] = "dynamic"
    weight_block_size: list[int]
    modules_to_not_convert: list[str] | None = None
    ignored_layers: list[str] | None = None

    @field_validator("weight_block_size")
    @classmethod
    def _block_128(cls, v: list[int]) -> list[int]:
        if v != [BLOCK, BLOCK]:
            raise ValueError(f"only [{BLOCK}, {BLOCK}] blocks are supported (the engine's tiles), got {v}")
        return v


def parse_quantization_config(hf_config: Mapping[str, Any]) -> QuantizationConfig | None:
    """config.json's quantization_config, validated; None when there is none. ValueError naming
    the field (`quantization_config.<key>: ...`) for anything relay cannot load as it is."""
    raw = hf_config.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config: expected an object, got {raw!r}")
    try:
        return QuantizationConfig.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ValueError(
            f"quantization_config.{key}: {first['msg']} (got {first.get('input')!r})"
            + (f"; {len(e.errors()) - 1} more error(s)" if len(e.errors()) > 1 else "")
        ) from None


def fp8_pairs(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """`X.weight` -> `X.weight_scale_inv` for every fp8 weight of `state`, checked: each fp8 tensor
    is a 2-D E4M3 `.weight` with a floating scale of shape (ceil(N/128), ceil(K/128)), and each
    scale has its fp8 weight. ValueError naming the tensor otherwise."""
    pairs: dict[str, str] = {}
    for key, t in state.items():
        if key.endswith(SCALE_SUFFIX):
            weight_key = key[: -len(SCALE_SUFFIX)]
            w = state.get(weight_key)
            if w is None or w.dtype != FP8_DTYPE:
                what = "missing" if w is None else f"{w.dtype}, not {FP8_DTYPE}"
                raise ValueError(f"{key}: a scale without its fp8 tensor ({weight_key} is {what})")
            continue
        if t.dtype not in FLOAT8_DTYPES:
            continue
        if t.dtype != FP8_DTYPE:
            raise ValueError(f"{key}: {t.dtype} is not supported (only {FP8_DTYPE}, fmt e4m3)")
        if not key.endswith(".weight") or t.dim() != 2:
            raise ValueError(
                f"{key}: fp8 tensors must be 2-D linear weights (`X.weight`), got shape {tuple(t.shape)}"
            )
        scale_key = key + SCALE_SUFFIX
        s = state.get(scale_key)
        if s is None:
            raise ValueError(f"{key}: fp8 tensor without its scale {scale_key}")
        n, k = t.shape
        want = (_cdiv(n, BLOCK), _cdiv(k, BLOCK))
        if tuple(s.shape) != want or not s.dtype.is_floating_point or s.dtype in FLOAT8_DTYPES:
            raise ValueError(
                f"{scale_key}: shape {tuple(s.shape)} {s.dtype}, expected float {want} "
                f"(one scale per {BLOCK}x{BLOCK} tile of {key} {tuple(t.shape)})"
            )
        pairs[key] = scale_key
    return pairs


def check_checkpoint(hf_config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> bool:
    """Validate an HF directory's quantization_config against its tensors; True when it holds fp8
    pairs. fp8 tensors need a quantization_config saying so (without one, nothing says they are
    block-scaled E4M3 with inverse scales). A config without fp8 tensors loads as high precision."""
    qc = parse_quantization_config(hf_config)
    pairs = fp8_pairs(state)
    if pairs and qc is None:
        raise ValueError(f"{next(iter(pairs))}: fp8 tensors but config.json has no quantization_config")
    return bool(pairs)


def dequantize_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` with every (X.weight fp8, X.weight_scale_inv) pair replaced by the dequantised
    X.weight in `dtype` (computed in float32, rounded once); other tensors are passed as they are."""
    pairs = fp8_pairs(state)
    scales = set(pairs.values())
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if key in scales:
            continue
        out[key] = dequantize_weight(t, state[pairs[key]]).to(dtype) if key in pairs else t
    return out
