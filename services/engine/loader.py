"""Read and check an HF model directory (the format: services/common/weights_dir.py): its config,
and its tensors as memory-mapped views (a rank's slice of each, services/common/weights_slice.py),
read once into the page cache here so that applying them later is a copy at memory speed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ops.fp8.checkpoint import check_checkpoint
from services.common.config import ModelConfig
from services.common.modeldir import model_config_from_hf
from services.common.tokenizer import model_eos_ids
from services.common.weights_dir import WeightsReader, read_meta
from services.common.weights_slice import SliceSpec, read_slices

# Biases of the attention input projections: Qwen2-style q/k/v, MLA's q_a / kv_a (HF attention_bias).
ATTENTION_BIAS_KEYS = (
    "self_attn.q_proj.bias",
    "self_attn.q_a_proj.bias",
    "self_attn.kv_a_proj_with_mqa.bias",
)


class WeightsError(ValueError):
    """A weights directory is missing or unusable; the message starts with its path."""


@dataclass
class Checkpoint:
    path: Path
    hf_config: dict[str, Any]
    config: ModelConfig
    state: dict[str, torch.Tensor]
    version: int | None  # relay.json's version, if the directory has one
    eos_token_ids: list[int]
    attention_bias: bool  # Qwen2-style q/k/v biases
    # HF "fp8" quantization_config: quantised linears are (X.weight E4M3, X.weight_scale_inv) pairs
    # (ops/fp8/checkpoint.py); consumers dequantise them or copy them into fp8 buffers.
    fp8: bool = False
    nbytes: int = 0  # the bytes of `state` (this rank's slices): what applying it reads
    read_s: float = 0.0  # opening the directory and reading those bytes into the page cache

    def same_architecture(self, other: ModelConfig) -> bool:
        # max_seq_len only bounds positions; a checkpoint may advertise a different one.
        def arch(m: ModelConfig) -> dict[str, Any]:
            return m.model_dump(exclude={"max_seq_len"})

        return arch(self.config) == arch(other)


def read_checkpoint(
    path: str | Path,
    spec: SliceSpec | None = None,
    tiled: Callable[[str, tuple[int, ...]], bool] | None = None,
) -> Checkpoint:
    """The directory's config and the tensors (or slices, `spec`) a rank applies. `tiled`: the
    weights the rank quantises in 128x128 tiles (services/common/weights_slice.read_slices)."""
    t0 = time.monotonic()
    p = Path(path)
    if not p.is_dir():
        raise WeightsError(f"{p}: not a directory")
    if not (p / "config.json").is_file():
        raise WeightsError(f"{p}: no config.json")
    try:
        hf = json.loads((p / "config.json").read_text())
        config = model_config_from_hf(hf)
        reader = WeightsReader.open(p)
        state = read_slices(reader, spec or SliceSpec(), config.n_routed_experts, tiled=tiled)
        reader.prefetch()
        meta = read_meta(p)
        fp8 = check_checkpoint(hf, state)
    except (OSError, ValueError, KeyError, TypeError) as e:  # incl. JSON and safetensors errors
        raise WeightsError(f"{p}: {e}") from e
    except Exception as e:  # noqa: BLE001 - safetensors raises its own (non-ValueError) error type
        raise WeightsError(f"{p}: unreadable weights ({type(e).__name__}: {e})") from e
    # The tensors are the ground truth for two layout choices config.json may not state reliably
    # (a "qwen3" model_type always implies QK-norm there, and tie_word_embeddings defaults vary).
    update = {
        "qk_norm": any(k.endswith("self_attn.q_norm.weight") for k in state),
        "tie_embeddings": "lm_head.weight" not in state,
    }
    if config.is_moe:
        # DeepSeek-V3's config names the selection bias only through topk_method; the tensor decides.
        update["expert_bias"] = any(k.endswith(".gate.e_score_correction_bias") for k in state)
    try:
        # Validated again: e.g. a "llama" directory holding q_norm tensors contradicts its arch.
        config = ModelConfig.model_validate({**config.model_dump(), **update})
    except ValueError as e:
        raise WeightsError(f"{p}: {e}") from e
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default", "llama3"):
        raise WeightsError(f"{p}: rope_scaling {json.dumps(scaling)} is not supported")
    try:
        # config.json's and generation_config.json's: a Qwen3 turn ends with <|im_end|>, which
        # some snapshots list only in generation_config.json.
        eos_ids = model_eos_ids(p)
    except ValueError as e:  # incl. a generation_config.json that is not JSON
        raise WeightsError(f"{p}: {e}") from e
    version = meta.get("version")
    return Checkpoint(
        path=p,
        hf_config=hf,
        config=config,
        state=state,
        version=int(version) if version is not None else None,
        eos_token_ids=eos_ids,
        attention_bias=any(k.endswith(ATTENTION_BIAS_KEYS) for k in state),
        fp8=fp8,
        nbytes=reader.bytes_mapped,
        read_s=time.monotonic() - t0,
    )
