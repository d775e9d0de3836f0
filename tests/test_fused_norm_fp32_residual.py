"""The float32 residual stream (ModelConfig.fp32_residual) on the engine's GPU path, under the
Triton interpreter: ops/fused_norm.py add_rms_norm with a float32 residual (float32 h in and
out, bf16 delta and y) against torch and the eager RMSNorm, and the whole bf16 engine with the
fused elementwise kernels against its torch path, key on and off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import triton_interp

# As tests/test_engine_fused_kernels.py: interpreted kernels need TRITON_INTERPRET=1 before triton
# is first imported; otherwise this file runs itself in a child process.
(
    INTERPRET,
    IN_CHILD,
    needs_interpreter,
    triton_interpreter,
    test_fp32_residual_kernel_tests_in_child_process,
) = triton_interp.kernel_test_module(("ops.fused_norm", "paged_attention", "qk_rope", "gemv"), __file__)


from ops import fused_norm  # noqa: E402
from services.common.config import EngineConfig, load_config  # noqa: E402
from services.common.modeldir import hf_config  # noqa: E402
from services.common.schemas import GenerateRequest, SamplingParams  # noqa: E402
from services.common.weights_dir import write_model_dir  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.layers.norm import RMSNorm  # noqa: E402
from services.engine.models.causal_lm import CausalLM  # noqa: E402
from services.engine.models.decoder import DecoderLayer  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
BF16_ULP = 2**-7  # relative: bf16 keeps 8 significant bits


@needs_interpreter
def test_add_rms_norm_float32_residual_variant() -> None:
    """x float32, delta bf16 -> h float32 (the exact float32 add), y bf16 (rms_norm in float32,
    one rounding); the eager RMSNorm on the float32 stream computes the same y."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 96, generator=g) * 4).to(DEVICE)  # 96: a masked tail; a large stream
    d = (torch.randn(6, 96, generator=g) * 0.05).bfloat16().to(DEVICE)  # a small sublayer output
    w = (torch.rand(96, generator=g) + 0.5).bfloat16().to(DEVICE)
    h, y = fused_norm.add_rms_norm(x, d, w, 1e-6)
    assert h.dtype == torch.float32 and y.dtype == torch.bfloat16
    ref_h = x + d.float()
    assert torch.equal(h, ref_h)  # float32 add: nothing of delta's bits is lost to a bf16 rounding
    assert not torch.equal(ref_h.bfloat16().float(), ref_h)  # (a bf16 stream would have lost some)
    ref_y = torch.nn.functional.rms_norm(ref_h, (96,), w.float(), 1e-6)
    # One bf16 ulp: the GPU rounds to nearest like torch; the interpreter's numpy cast truncates.
    torch.testing.assert_close(y.float(), ref_y, atol=0, rtol=BF16_ULP)
    norm = RMSNorm(96, 1e-6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
        eager = norm(ref_h)
    assert eager.dtype == torch.bfloat16
    torch.testing.assert_close(eager.float(), ref_y.bfloat16().float(), atol=0, rtol=0)
    torch.testing.assert_close(y.float(), eager.float(), atol=0, rtol=BF16_ULP)
    # Rows read through their stride (a column slice of a wider float32 stream).
    wide = torch.randn(6, 200, generator=g).to(DEVICE)
    h2, _ = fused_norm.add_rms_norm(wide[:, :96], d, w, 1e-6)
    assert torch.equal(h2, wide[:, :96] + d.float())


@needs_interpreter
def test_add_rms_norm_bf16_residual_variant_unchanged() -> None:
    """The key off: x and delta bf16 -> h and y bf16 (the bf16 stream of before)."""
    g = torch.Generator().manual_seed(6)
    x, d = (torch.randn(4, 64, generator=g).bfloat16().to(DEVICE) for _ in range(2))
    w = (torch.rand(64, generator=g) + 0.5).bfloat16().to(DEVICE)
    h, y = fused_norm.add_rms_norm(x, d, w, 1e-6)
    assert h.dtype == torch.bfloat16 and y.dtype == torch.bfloat16
    torch.testing.assert_close(h, x + d, atol=0, rtol=BF16_ULP)
    ref_y = torch.nn.functional.rms_norm((x + d).float(), (64,), w.float(), 1e-6)
    torch.testing.assert_close(y.float(), ref_y, atol=1e-2, rtol=1e-2)


@needs_interpreter
@pytest.mark.skipif(
    not INTERPRET, reason="CPU engine under the interpreter; on CUDA: bench/engine/gpu_fused_check.py"
)
@pytest.mark.parametrize("fp32_residual", [True, False])
def test_bf16_engine_fused_path_matches_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fp32_residual: bool
) -> None:
    """A bf16 engine on the paged (triton) backend with the fused add+norm kernels on (as on CUDA)
    against the torch backend of the same checkpoint: greedy tokens and log-probs agree, and the
    fused path's residual stream between layers has the key's dtype."""
    m = load_config("debug").model.model_copy(update={"fp32_residual": fp32_residual})
    torch.manual_seed(1)
    state = {k: v for k, v in CausalLM(m, m.max_seq_len).state_dict().items() if "rope" not in k}
    path = write_model_dir(tmp_path / "step_0", state, hf_config(m, eos_token_id=0), None, {"version": 0})
    base: dict[str, Any] = dict(
        device="cpu",
        dtype="bfloat16",
        max_batch_size=4,
        max_seq_len=64,
        block_size=4,
        max_num_batched_tokens=24,
    )
    reqs = [
        GenerateRequest(
            input_ids=list(range(3, 3 + n)),
            sampling=SamplingParams(temperature=0.0, max_tokens=5, seed=i, ignore_eos=True),
        )
        for i, n in enumerate((5, 19))
    ]
    ref = LLMEngine(path, EngineConfig(**base, attention_backend="torch")).generate(reqs)
    engine = LLMEngine(path, EngineConfig(**base, attention_backend="triton"))
    assert engine.model.fp32_residual is fp32_residual  # from config.json
    engine.model.fused_elementwise = True
    streams: list[torch.dtype] = []
    fused = DecoderLayer.forward_fused

    def recording(self: DecoderLayer, h: torch.Tensor, *a: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = fused(self, h, *a)
        streams.append(out[0].dtype)
        return out

    monkeypatch.setattr(DecoderLayer, "forward_fused", recording)
    out = engine.generate(reqs)
    assert streams and set(streams) == {torch.float32 if fp32_residual else torch.bfloat16}
    for a, b in zip(ref, out, strict=True):
        assert a.choices[0].output_ids == b.choices[0].output_ids
        # bf16 kernels (attention, fused norms) sum in other orders than the torch ops
        assert a.choices[0].logprobs == pytest.approx(b.choices[0].logprobs, abs=3e-2)
