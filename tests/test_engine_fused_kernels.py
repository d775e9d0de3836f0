"""The GPU path's fused kernels under the Triton interpreter.

Sampling (kernels/sampling.py): exact log-probs of the chosen token, greedy = argmax, frequencies
that follow softmax(logits / T), per-row seeded reproducibility, sanitising of NaN/inf rows, and
the Sampler / engine dispatch to it. Residual-add + RMSNorm and SiLU-mul (ops/fused_norm.py):
against the torch ops, and the whole engine with them on against the torch backend."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from helpers import triton_interp

# The kernels run under Triton's interpreter without CUDA (tests/helpers/triton_interp.py); if
# triton was imported too early for that, this file's tests skip and test_fused_kernel_tests_in_child_process
# runs them in a child process.
INTERPRET, IN_CHILD, needs_interpreter, triton_interpreter, test_fused_kernel_tests_in_child_process = (
    triton_interp.kernel_test_module(
        ("sampling", "ops.fused_norm", "paged_attention", "qk_rope", "gemv"), __file__
    )
)


from ops import fused_norm  # noqa: E402
from services.common.config import EngineConfig, load_config  # noqa: E402
from services.common.modeldir import hf_config  # noqa: E402
from services.common.schemas import GenerateRequest, SamplingParams  # noqa: E402
from services.common.weights_dir import write_model_dir  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.kernels import gemv, sampling  # noqa: E402
from services.engine.layers.sampler import Sampler  # noqa: E402
from services.engine.models.causal_lm import CausalLM  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"


def run(
    logits: torch.Tensor, temps: list[float], seeds: list[int], block: int = sampling.BLOCK_V
) -> tuple[list[int], list[float]]:
    t = torch.tensor(temps, dtype=torch.float32, device=DEVICE)
    s = torch.tensor(seeds, dtype=torch.int64, device=DEVICE)
    tokens, lps = sampling.fused_sample(logits.to(DEVICE), t, s, block)
    return tokens.tolist(), lps.tolist()


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_and_logprobs_exact(dtype: torch.dtype) -> None:
    # 5000 columns: three loop iterations of BLOCK_V, the last one partial.
    logits = (torch.randn(6, 5000, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    temps = [0.0, 0.0, 1.0, 0.7, 1.3, 1.0]
    tokens, lps = run(logits, temps, [0, 0, 11, 12, 13, 14])
    x = logits.float()
    for row, (t, lp, temp) in enumerate(zip(tokens, lps, temps, strict=True)):
        scaled = x[row] / (temp or 1.0)
        if temp == 0:
            assert t == int(scaled.argmax())
        ref = torch.log_softmax(scaled, -1)[t].item()
        assert math.isclose(lp, ref, abs_tol=2e-5), (row, lp, ref)


@needs_interpreter
def test_greedy_ties_take_first_maximum_across_blocks() -> None:
    logits = torch.zeros(1, 5000)
    logits[0, 4500] = 2.0
    logits[0, 2100] = 2.0  # same value, earlier block
    assert run(logits, [0.0], [0])[0] == [2100]


@pytest.mark.slow  # hundreds of interpreted programs: ~30-60 s on 2 busy cores
@needs_interpreter
def test_frequencies_follow_softmax_across_blocks() -> None:
    # Mass in three different blocks of the vocabulary loop; everything else masked.
    # Small blocks (16 columns) keep the interpreter fast while the loop still runs 3 iterations.
    probs = {3: 0.5, 21: 0.3, 44: 0.2}
    logits = torch.full((1, 45), float("-inf"))
    for j, p in probs.items():
        logits[0, j] = math.log(p)
    n = 600
    tokens, lps = run(logits.expand(n, -1), [1.0] * n, list(range(1, n + 1)), block=16)
    assert set(tokens) <= set(probs)
    for j, p in probs.items():
        assert abs(tokens.count(j) / n - p) < 0.06, (j, tokens.count(j) / n)
    for t, lp in zip(tokens, lps, strict=True):
        assert math.isclose(lp, math.log(probs[t]), abs_tol=1e-5)


@pytest.mark.slow  # hundreds of interpreted programs: ~30-60 s on 2 busy cores
@needs_interpreter
def test_temperature_sharpens() -> None:
    # Both temperatures in one launch, the same 400 seeds each: a row's draw depends only on its
    # logits, temperature and seed, so these are the draws of two launches (one costs ~20% less
    # under the interpreter).
    logits = torch.tensor([[0.0, 1.0]]).expand(800, -1)
    tokens, _ = run(logits, [1.0] * 400 + [0.25] * 400, list(range(400)) * 2, block=16)
    hot, cold = tokens[:400], tokens[400:]
    # P(1) = sigmoid(1) = 0.73 at T=1, sigmoid(4) = 0.98 at T=0.25.
    assert abs(sum(hot) / 400 - 0.731) < 0.07
    assert sum(cold) / 400 > 0.94


@needs_interpreter
def test_seeded_rows_reproduce_and_ignore_the_batch() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    seeds = [101, 202, 303, 404, 505]
    a, _ = run(logits, [1.0] * 5, seeds)
    b, _ = run(logits, [1.0] * 5, seeds)
    assert a == b
    alone = [run(logits[i : i + 1], [1.0], [seeds[i]])[0][0] for i in range(5)]
    assert alone == a
    # Different seeds give different draws somewhere (300 near-flat tokens: collisions are rare).
    c, _ = run(logits, [1.0] * 5, [s + 1 for s in seeds])
    assert c != a


@needs_interpreter
def test_chunking_a_row_changes_nothing() -> None:
    """A row split over many programs (batch 1 on a GPU) picks the same tokens as one program per
    row, greedy ties included, with the same log-probs up to summation order."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 1000, generator=g) * 2
    logits[0, 10] = logits[0, 900] = 50.0  # a greedy tie in the first and the last chunk
    logits[2, :] = float("-inf")  # a dead row: the uniform race, also chunked
    t = torch.tensor([0.0, 0.8, 1.0], device=DEVICE)
    s = torch.tensor([7, 8, 9], dtype=torch.int64, device=DEVICE)
    x = logits.to(DEVICE)
    one_tok, one_lp = sampling.fused_sample(x, t, s, block=16, programs=1)
    many_tok, many_lp = sampling.fused_sample(x, t, s, block=16, programs=3 * 40)
    assert many_tok.tolist() == one_tok.tolist() and one_tok[0] == 10
    assert torch.allclose(many_lp, one_lp, atol=1e-5)


@needs_interpreter
def test_nan_inf_and_dead_rows_are_sanitised() -> None:
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [
            [0.0, inf, -inf, 3.0],  # +inf -> the largest float: always chosen
            [nan, 2.0, 1.0, -inf],  # NaN -> -inf: never chosen
            [-inf, -inf, -inf, -inf],  # nothing finite: uniform
            [nan, nan, nan, nan],
        ]
    )
    for temp in (0.0, 1.0):
        tokens, lps = run(logits, [temp] * 4, [7, 8, 9, 10])
        assert tokens[0] == 1 and math.isclose(lps[0], 0.0, abs_tol=1e-6)
        assert tokens[1] in (1, 2) and all(math.isfinite(lp) and lp <= 0 for lp in lps)
        assert math.isclose(lps[2], -math.log(4), abs_tol=1e-6)
        assert math.isclose(lps[3], -math.log(4), abs_tol=1e-6)
        if temp == 0:
            assert tokens[1] == 1 and tokens[2] == 0 and tokens[3] == 0  # torch.argmax of zeros


@needs_interpreter
def test_sampler_dispatch_and_rng_use() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)) * 2
    plain = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8),
        SamplingParams(),
    ]
    rngs_f = [random.Random(i) for i in range(4)]
    rngs_t = [random.Random(i) for i in range(4)]
    fused = Sampler(fused=True).sample(logits, plain, rngs_f)
    torch_out = Sampler().sample(logits, plain, rngs_t)
    # Same RNG consumption as the torch path (one draw per sampled row, none for greedy).
    assert [r.random() for r in rngs_f] == [r.random() for r in rngs_t]
    assert fused.tokens[1] == torch_out.tokens[1]  # greedy rows agree exactly
    ref = torch.log_softmax(logits / torch.tensor([1.0, 1.0, 0.8, 1.0])[:, None], -1)
    for row, (t, lp) in enumerate(zip(fused.tokens, fused.logprobs, strict=True)):
        assert math.isclose(lp, ref[row, t].item(), abs_tol=2e-5)
    # A truncated row anywhere in the batch: the whole batch takes the torch path, as before.
    mixed = [*plain[:3], SamplingParams(top_k=5)]
    a = Sampler(fused=True).sample(logits, mixed, [random.Random(i) for i in range(4)])
    b = Sampler().sample(logits, mixed, [random.Random(i) for i in range(4)])
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    # Top-n log-probs still come with the fused path.
    with_top = Sampler(fused=True).sample(logits[:1], [SamplingParams(logprobs=3)], [random.Random(0)])
    assert with_top.top[0] is not None and len(with_top.top[0]) == 3


@needs_interpreter
def test_engine_greedy_with_fused_sampler_equals_torch_sampler(tmp_path: Path) -> None:
    m = load_config("debug").model
    torch.manual_seed(0)
    state = {k: v for k, v in CausalLM(m, m.max_seq_len).state_dict().items() if "rope" not in k}
    path = write_model_dir(tmp_path / "step_0", state, hf_config(m, eos_token_id=0), None, {"version": 0})
    cfg = EngineConfig(device="cpu", max_batch_size=8, max_seq_len=64)
    reqs = [
        GenerateRequest(input_ids=p, sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for p in ([5, 6, 7], [10, 11, 12, 13], [30])
    ]
    base = LLMEngine(path, cfg)
    fused = LLMEngine(path, cfg)
    fused.sampler = Sampler(fused=True)  # what the engine picks on CUDA
    for a, b in zip(base.generate(reqs), fused.generate(reqs), strict=True):
        assert a.choices[0].output_ids == b.choices[0].output_ids
        for x, y in zip(a.choices[0].logprobs, b.choices[0].logprobs, strict=True):
            assert math.isclose(x, y, abs_tol=2e-5)
    # Sampled (T=1, seeded) requests reproduce on the fused path.
    seeded = [
        GenerateRequest(input_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=8, seed=3, ignore_eos=True))
    ]
    assert fused.generate(seeded)[0].choices[0].output_ids == fused.generate(seeded)[0].choices[0].output_ids


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_and_silu_mul_match_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    x, d = (torch.randn(5, 96, generator=g).to(dtype) for _ in range(2))  # 96: a masked tail
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    h, y = fused_norm.add_rms_norm(x, d, w, 1e-6)
    ref_h = x + d
    if dtype == torch.float32:
        assert torch.equal(h, ref_h)  # the residual stream is the torch add's
    else:
        # One bf16 ulp: the GPU rounds to nearest like torch; the interpreter's numpy cast truncates.
        torch.testing.assert_close(h, ref_h, atol=0, rtol=2**-7)
    ref_y = torch.nn.functional.rms_norm(ref_h.float(), (96,), w.float(), 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), ref_y, atol=tol, rtol=tol)
    gate, up = (torch.randn(3, 1500, generator=g).to(dtype) for _ in range(2))  # two column blocks
    ref = torch.nn.functional.silu(gate.float()) * up.float()
    torch.testing.assert_close(fused_norm.silu_mul(gate, up).float(), ref, atol=tol, rtol=tol)
    # Non-contiguous rows (a column slice) are read through their row stride.
    wide = torch.randn(5, 200, generator=g).to(dtype)
    h2, _ = fused_norm.add_rms_norm(wide[:, :96], d, w, 1e-6)
    torch.testing.assert_close(h2, wide[:, :96] + d, atol=0, rtol=0 if dtype == torch.float32 else 2**-7)


@needs_interpreter
def test_engine_with_fused_elementwise_matches_torch_backend(tmp_path: Path) -> None:
    """Whole engine, paged (triton) backend with the fused add+norm / SiLU-mul kernels on (as on
    CUDA): the torch backend's tokens and log-probs, through chunked prefill and decode steps."""
    m = load_config("debug").model
    torch.manual_seed(1)
    state = {k: v for k, v in CausalLM(m, m.max_seq_len).state_dict().items() if "rope" not in k}
    path = write_model_dir(tmp_path / "step_0", state, hf_config(m, eos_token_id=0), None, {"version": 0})
    base = dict(device="cpu", max_batch_size=8, max_seq_len=96, block_size=4, max_num_batched_tokens=24)
    reqs = [
        GenerateRequest(
            input_ids=list(range(3, 3 + n)),
            sampling=SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=6, seed=i, ignore_eos=True),
        )
        for i, n in enumerate((5, 30, 1, 17))
    ]
    ref = LLMEngine(path, EngineConfig(**base, attention_backend="torch")).generate(reqs)  # type: ignore[arg-type]
    engine = LLMEngine(path, EngineConfig(**base, attention_backend="triton"))  # type: ignore[arg-type]
    assert not engine.model.fused_elementwise  # CPU default: torch ops
    engine.model.fused_elementwise = True
    out = engine.generate(reqs)
    for a, b in zip(ref, out, strict=True):
        assert a.choices[0].output_ids == b.choices[0].output_ids
        assert a.choices[0].logprobs == pytest.approx(b.choices[0].logprobs, abs=1e-4)

    # Fused q/k/v and gate/up GEMMs (what the engine does on CUDA): the same outputs, the HF-named
    # parameters are views of the fused weights, and a weight update reaches the fused GEMMs.
    fused = engine.model.fuse_projections()
    assert len(fused) == 2 * m.n_layers
    attn, mlp = engine.model.model.layers[0].self_attn, engine.model.model.layers[0].mlp
    assert (
        attn.qkv is not None
        and attn.k_proj.weight.data_ptr() == attn.qkv.weight[attn.q_proj.weight.shape[0]].data_ptr()
    )
    assert (
        mlp.gate_up is not None
        and mlp.up_proj.weight.data_ptr() == mlp.gate_up.weight[m.hidden_dim].data_ptr()
    )
    assert set(engine.model.state_dict()) == set(LLMEngine(path, EngineConfig(**base)).model.state_dict())  # type: ignore[arg-type]
    for a, b in zip(ref, engine.generate(reqs), strict=True):
        assert a.choices[0].output_ids == b.choices[0].output_ids
        assert a.choices[0].logprobs == pytest.approx(b.choices[0].logprobs, abs=1e-4)
    torch.manual_seed(2)
    state2 = {k: v for k, v in CausalLM(m, m.max_seq_len).state_dict().items() if "rope" not in k}
    path2 = write_model_dir(tmp_path / "step_1", state2, hf_config(m, eos_token_id=0), None, {"version": 1})
    engine.load_weights(path2, 1)
    ref2 = LLMEngine(path2, EngineConfig(**base, attention_backend="torch")).generate(reqs)  # type: ignore[arg-type]
    for a, b in zip(ref2, engine.generate(reqs), strict=True):
        assert a.choices[0].output_ids == b.choices[0].output_ids
        assert a.choices[0].logprobs == pytest.approx(b.choices[0].logprobs, abs=1e-4)


@needs_interpreter
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_equals_linear(m: int) -> None:
    """The decode GEMV (kernels/gemv.py), every configuration it may pick, against F.linear: N and K
    not multiples of the tiles (masked edges), M rows padded to its bucket."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 300, generator=g).to(DEVICE)
    w = torch.randn(40, 300, generator=g).to(DEVICE)
    ref = torch.nn.functional.linear(x, w)
    for cfg in gemv.CONFIGS:
        out = gemv.gemv(x, w, cfg)
        assert out.shape == (m, 40) and torch.allclose(out, ref, atol=1e-4, rtol=1e-5), cfg
