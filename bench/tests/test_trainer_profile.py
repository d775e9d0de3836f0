"""bench/trainer/profile_step.py attributes a real profile's work to the right categories, and
bench/trainer/attn.py's float32 reference equals the trainer's attention module (CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from services.common.config import ModelConfig, TrainerSection
from trainer.chunked import enable_chunked_output
from trainer.model import build_model
from trainer.parallel import parallelize

BENCH = Path(__file__).resolve().parents[2] / "bench" / "trainer"
M = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64)


@pytest.fixture(scope="module")
def bench_modules() -> tuple[object, object]:
    sys.path.insert(0, str(BENCH))
    try:
        import attn
        import profile_step
    finally:
        sys.path.remove(str(BENCH))
    return attn, profile_step


def test_profile_classifies_kernels(bench_modules: tuple[object, object]) -> None:
    _, ps = bench_modules
    c = ps.classify  # type: ignore[attr-defined]
    cases = {
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", ()): "attention_fwd",
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7", ()): "attention_bwd",
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", ()): "attention_fwd",
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<>", ()): "attention_bwd",
        ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", ()): "attention_bwd",
        (
            "void at::native::vectorized_elementwise_kernel<4>",
            ("aten::_scaled_dot_product_flash_attention",),
        ): ("attention_fwd"),
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", ("aten::linear", "aten::matmul", "aten::mm")): "matmul",
        (
            "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN",
            ("relay::logprob_head_fwd", "aten::mm"),
        ): "lm_head_logprob",
        ("void at::native::reduce_kernel<512>", ("relay::logprob_head_bwd", "aten::exp_")): "lm_head_logprob",
        (
            "void multi_tensor_apply_kernel<TensorListMetadata<4>>",
            ("Optimizer.step#AdamW.step",),
        ): "optimizer",
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", ()): "communication",
        ("void at::native::elementwise_kernel<128, 4>", ("FSDP::post_backward_reduce",)): "communication",
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", ("CompiledFunction",)): "norms_elementwise",
        ("Memcpy DtoD (Device -> Device)", ()): "other",
    }
    for (name, stack), want in cases.items():
        assert c(name, list(stack)) == want, name


def test_profile_attributes_a_real_cpu_step(bench_modules: tuple[object, object]) -> None:
    """A tiny model's forward + backward + AdamW profiled on CPU: the leaf ops land in the
    categories (the GPU run attributes kernels through the same stacks)."""
    _, ps = bench_modules
    model = enable_chunked_output(build_model(M, seed=0))
    model, _, _ = parallelize(model, TrainerSection(), 1, torch.device("cpu"), distributed=False)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    from trainer.loss import sequence_logprobs

    toks = torch.randint(0, 64, (1, 33))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logp, _ = sequence_logprobs(model, toks[:, :-1], toks[:, 1:], chunk=8)
        logp.sum().backward()
        opt.step()
    kernels = ps.kernels_from_trace(ps.trace_events(prof), cuda=False)  # type: ignore[attr-defined]
    res = ps.table(kernels, 1, [1.0])  # type: ignore[attr-defined]
    cats = res["categories_ms_per_step"]
    for want in (
        "attention_fwd",
        "attention_bwd",
        "matmul",
        "lm_head_logprob",
        "optimizer",
        "norms_elementwise",
    ):
        assert cats[want] > 0, (want, cats)
    assert res["top_kernels"] and sum(res["categories_share_of_kernel_sum"].values()) == pytest.approx(1.0)
    assert ps.busy_us(kernels) <= sum(k.dur for k in kernels) + 1e-6  # type: ignore[attr-defined]


def test_attn_reference_equals_the_trainer_module(bench_modules: tuple[object, object]) -> None:
    """attn.py checks every kernel against `reference` (float32, dense mask, expanded kv): it must
    be the trainer's attention, one document and packed."""
    attn, _ = bench_modules
    for lens in ([40], [13, 20, 7]):
        qkv = attn.inputs(4, 2, 16, sum(lens), torch.float32, torch.device("cpu"), seed=0)  # type: ignore[attr-defined]
        dout = torch.randn_like(qkv[0])
        ref = attn.reference(qkv, lens, dout)  # type: ignore[attr-defined]
        out = attn.trainer_fn(lens)(*qkv)  # type: ignore[attr-defined]
        got = [out, *torch.autograd.grad(out, qkv, dout)]
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert attn.causal_flops(16, 128, [16384]) == 2.0 * 16 * 128 * 16384**2  # type: ignore[attr-defined]


def test_profile_attributes_gpu_kernels_through_launch_stacks(bench_modules: tuple[object, object]) -> None:
    """The CUDA path on a trace in Kineto's chrome format: each kernel gets the op stack of the
    thread that launched it (matched by correlation id), nested ranges innermost last."""
    _, ps = bench_modules

    def op(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    def launch(corr: int, ts: float, tid: int = 1) -> dict[str, object]:
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid,
                "ts": ts, "dur": 1, "args": {"correlation": corr}}  # fmt: skip

    def kernel(name: str, corr: int, ts: float, dur: float) -> dict[str, object]:
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
                "args": {"correlation": corr}}  # fmt: skip

    events = [
        op("relay::logprob_head_fwd", 0, 100, cat="user_annotation"),
        op("aten::mm", 10, 20),
        launch(1, 15),
        op("aten::exp_", 40, 10),
        launch(2, 45),
        op("aten::_scaled_dot_product_cudnn_attention", 200, 50),
        launch(3, 210),
        # the autograd thread: backward named after the forward op
        op("autograd::engine::evaluate_function: ScaledDotProductCudnnAttentionBackward0", 300, 80, tid=2),
        launch(4, 310, tid=2),
        op("Optimizer.step#AdamW.step", 400, 50, cat="user_annotation"),
        launch(5, 410),
        kernel("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT", 1, 20, 30),
        kernel("void at::native::vectorized_elementwise_kernel<4>", 2, 50, 5),
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", 3, 220, 40),
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", 4, 320, 60),
        kernel("void multi_tensor_apply_kernel<TensorListMetadata<4>>", 5, 415, 10),
        kernel("void at::native::vectorized_elementwise_kernel<4>", 99, 40, 20),  # overlaps: busy counts once
    ]
    ks = ps.kernels_from_trace(events, cuda=True)  # type: ignore[attr-defined]
    cats = [ps.classify(k.name, k.stack) for k in ks]  # type: ignore[attr-defined]
    assert cats == [
        "lm_head_logprob",
        "lm_head_logprob",
        "attention_fwd",
        "attention_bwd",
        "optimizer",
        "norms_elementwise",
    ]
    assert ks[0].stack == ["relay::logprob_head_fwd", "aten::mm"] and ks[-1].stack == []
    # [20, 50], [40, 60] and [50, 55] overlap: 40 us busy, then 40 + 60 + 10
    assert ps.busy_us(ks) == pytest.approx(40 + 40 + 60 + 10)  # type: ignore[attr-defined]
