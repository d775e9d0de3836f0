"""ModelConfig.fp32_residual against transformers: a bf16 engine with the float32 residual stream
is nearer HF's float32 model than with the bf16 stream, on a Hub-style directory (no relay key in
config.json: the default, on) and on the same directory with `relay_fp32_residual: false`; the key
round-trips through hf_config / model_config_from_hf; the float32 engine is unaffected."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from helpers.hf_random import PROMPTS, TINY, engine, engine_logprobs, hf_logprobs, randomize
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.common.config import ModelConfig
from services.common.modeldir import hf_config, model_config_from_hf


def test_key_round_trips_through_config_json() -> None:
    for fp32 in (True, False):
        m = ModelConfig(fp32_residual=fp32)
        cfg = hf_config(m, eos_token_id=1)
        assert ("relay_fp32_residual" in cfg) is (not fp32)  # written only when off
        assert model_config_from_hf(cfg).fp32_residual is fp32
    assert ModelConfig().fp32_residual is True


def test_bf16_engine_nearer_float32_hf_with_fp32_residual(tmp_path: Path) -> None:
    hf = randomize(
        Qwen3ForCausalLM(
            Qwen3Config(
                **TINY, intermediate_size=160, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False
            )
        ),
        seed=11,
    )
    on = tmp_path / "hub"
    hf.save_pretrained(on)
    off = tmp_path / "off"
    shutil.copytree(on, off)
    cfg = json.loads((off / "config.json").read_text())
    (off / "config.json").write_text(json.dumps(cfg | {"relay_fp32_residual": False}))
    err: dict[bool, float] = {}
    for fp32, d in ((True, on), (False, off)):
        eng = engine(d, dtype="bfloat16", max_batch_size=4, torch_threads=1)
        assert eng.model.fp32_residual is fp32
        diffs = [(engine_logprobs(eng, p) - hf_logprobs(hf, p)).abs().mean() for p in PROMPTS]
        err[fp32] = float(torch.stack(diffs).mean())
        # float32 engine: the key changes nothing (the stream is float32 either way), HF's 1e-4
        eng32 = engine(d, max_batch_size=4, torch_threads=1)
        for p in PROMPTS:
            torch.testing.assert_close(engine_logprobs(eng32, p), hf_logprobs(hf, p), atol=1e-4, rtol=0)
    assert err[True] < err[False], err
    assert err[False] > 1e-3  # bf16 rounding is visible at all
