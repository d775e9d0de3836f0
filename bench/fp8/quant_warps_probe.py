import torch
from triton.testing import do_bench
from services.engine.kernels.fp8_quant import triton_quantize_act_both, triton_quantize_act_t
from services.engine.kernels.fp8_gemm import triton_quantize_act
for m, c in [(8192, 2048), (16384, 9728), (8192, 18432)]:
    x = torch.randn(m, c, device="cuda").to(torch.bfloat16)
    sep = do_bench(lambda: (triton_quantize_act(x), triton_quantize_act_t(x)), warmup=10, rep=50)
    row = [f"{m}x{c} separate={sep*1e3:.0f}us"]
    ref = triton_quantize_act_both(x)
    for nw in (4, 8, 16):
        got = triton_quantize_act_both(x, num_warps=nw)
        same = all(torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a, b.view(torch.uint8) if b.dtype != torch.float32 else b) for pa, pb in zip(got, ref) for a, b in zip(pa, pb))
        t = do_bench(lambda: triton_quantize_act_both(x, num_warps=nw), warmup=10, rep=50)
        row.append(f"w{nw}={t*1e3:.0f}us{'' if same else '(DIFF)'}")
    print(" ".join(row), flush=True)
