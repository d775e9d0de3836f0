"""Nemotron-H / Nemotron-3 (nemotron_h) in the trainer: the Mamba-2 scan (ops/mamba2.py)
against the naive recurrence, forward and gradients; the hybrid stack (trainer/nemotron.py)
against HF NemotronHForCausalLM (logits and float32 gradients); the HF checkpoint layouts; packed
micro-batches; Router Replay on its MoE layers; one trainer step."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.moe import (
    RouterTap,
    check_packed_replay_equals_padded,
    nemotron_model,
    own_choice,
    random_routes,
    routed_sample,
    run_one_step,
    small_nemotron,
    tokens,
)

from ops.mamba2 import causal_conv1d, conv1d_step, conv_state_after, ssd_chunked, ssd_naive, ssd_step
from services.common.config import ModelConfig, RunConfig
from services.common.modeldir import hf_config, model_config_from_hf
from services.common.schemas import RolloutGroup, TrainerStepMetrics
from services.common.weights_dir import read_model_dir, step_dir
from trainer.loss import token_logprobs
from trainer.model import adapter, build_model, from_hf_state, load_weights_dir, save_weights_dir, to_hf_state
from trainer.replay import UNRECORDED, micro_batch_routes, routing

# ------------------------------------------------------------------ the scan


def scan_inputs(
    seed: int, b: int = 2, t: int = 29, h: int = 4, p: int = 3, g: int = 2, n: int = 5
) -> list[torch.Tensor]:
    """float64 x, dt (> 0), A (< 0), B, C, D and an initial state; decays wide enough that early
    tokens matter late and late ones matter more."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, p, generator=gen, dtype=torch.float64)
    dt = torch.nn.functional.softplus(torch.randn(b, t, h, generator=gen, dtype=torch.float64))
    a = -torch.rand(h, generator=gen, dtype=torch.float64) * 1.5
    bm = torch.randn(b, t, g, n, generator=gen, dtype=torch.float64)
    cm = torch.randn(b, t, g, n, generator=gen, dtype=torch.float64)
    d = torch.randn(h, generator=gen, dtype=torch.float64)
    s0 = torch.randn(b, h, p, n, generator=gen, dtype=torch.float64)
    return [x, dt, a, bm, cm, d, s0]


@pytest.mark.parametrize("chunk", [1, 4, 8, 29, 64])
def test_chunked_scan_equals_the_recurrence(chunk: int) -> None:
    """float32 chunked scan (chunks that divide T or not, one chunk, chunks of one token) against
    the float64 recurrence: outputs, final state, and an initial state carried in."""
    x, dt, a, bm, cm, d, s0 = scan_inputs(0)
    y_ref, s_ref = ssd_naive(x, dt, a, bm, cm, d, s0)
    y, s = ssd_chunked(*(v.float() for v in (x, dt, a, bm, cm)), chunk, d.float(), s0.float())
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=2e-5 * y_ref.abs().max().item())
    torch.testing.assert_close(s.double(), s_ref, rtol=0, atol=2e-5 * s_ref.abs().max().item())
    # Split in two at any point, the second half starting from the first's final state.
    y1, s1 = ssd_chunked(
        *(v[:, :11].float() for v in (x, dt)),
        a.float(),
        bm[:, :11].float(),
        cm[:, :11].float(),
        chunk,
        d.float(),
        s0.float(),
    )
    y2, s2 = ssd_chunked(
        *(v[:, 11:].float() for v in (x, dt)),
        a.float(),
        bm[:, 11:].float(),
        cm[:, 11:].float(),
        chunk,
        d.float(),
        s1,
    )
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=0, atol=1e-5 * y_ref.abs().max().item())
    torch.testing.assert_close(s2, s, rtol=0, atol=1e-5 * s_ref.abs().max().item())


def test_chunked_scan_gradients_equal_the_recurrences() -> None:
    """Autograd through the float32 chunked scan gives the gradients of the float64 recurrence
    (every input: x, dt, A, B, C, D, the initial state), to float32 accuracy."""
    ref_in = [v.requires_grad_() for v in scan_inputs(1)]
    y_ref, s_ref = ssd_naive(*ref_in)
    gy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    gs = torch.randn(s_ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = torch.autograd.grad((y_ref * gy).sum() + (s_ref * gs).sum(), ref_in)
    ins = [v.detach().float().requires_grad_() for v in ref_in]
    x, dt, a, bm, cm, d, s0 = ins
    y, s = ssd_chunked(x, dt, a, bm, cm, 8, d, s0)
    got = torch.autograd.grad((y * gy.float()).sum() + (s * gs.float()).sum(), ins)
    for name, g, w in zip(("x", "dt", "A", "B", "C", "D", "state"), got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=3e-5 * w.abs().max().item(), msg=name)
    # float32 against float32: the chunked form is as accurate as the recurrence itself.
    y32, _ = ssd_naive(*(v.detach().float() for v in ref_in))
    err_chunked = (y.double() - y_ref).abs().max().item()
    err_naive = (y32.double() - y_ref).abs().max().item()
    assert err_chunked < 10 * err_naive + 1e-6


def test_step_and_convolution_forms_equal_the_sequence_forms() -> None:
    """Decode's forms: ssd_step token by token = the scan; conv1d_step = the causal convolution,
    and the state after a prefix continues it exactly."""
    x, dt, a, bm, cm, d, s0 = (v.float() for v in scan_inputs(4))
    y, s = ssd_chunked(x, dt, a, bm, cm, 8, d, s0)
    state, ys = s0, []
    for i in range(x.shape[1]):
        yi, state = ssd_step(state, x[:, i], dt[:, i], a, bm[:, i], cm[:, i], d)
        ys.append(yi)
    torch.testing.assert_close(torch.stack(ys, 1), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, s, rtol=1e-5, atol=1e-5)
    gen = torch.Generator().manual_seed(5)
    u = torch.randn(2, 13, 6, generator=gen)
    w, bias = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    full = causal_conv1d(u, w, bias)
    head = causal_conv1d(u[:, :5], w, bias)
    tail = causal_conv1d(u[:, 5:], w, bias, conv_state_after(u[:, :5], 4))
    torch.testing.assert_close(torch.cat([head, tail], 1), full)
    cs = conv_state_after(u[:, :2], 4)  # shorter than the kernel: zeros before it
    outs = []
    for i in range(2, 13):
        o, cs = conv1d_step(u[:, i], cs, w, bias)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), full[:, 2:], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ the model against HF


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import NemotronHForCausalLM

    return NemotronHForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_config_round_trips_and_counts_parameters() -> None:
    m = small_nemotron()
    assert model_config_from_hf(hf_config(m, 0)) == m
    assert m.moe_layers() == [2, 5]
    model = build_model(m, seed=0)
    assert sum(p.numel() for p in model.parameters()) == m.param_counts()["total"]
    with pytest.raises(ValueError, match="hybrid_pattern"):
        small_nemotron(hybrid_pattern="M*EX-E")
    with pytest.raises(ValueError, match="n_layers"):
        small_nemotron(n_layers=5)
    with pytest.raises(ValueError, match="untied"):
        small_nemotron(tie_embeddings=True)
    # A Mamba-2 state is not in the KV pages: no KV store, no prefill services.
    from services.common.config import ConfigError, load_config

    for bad in ("--kvstore.enabled=true", "--prefill.replicas=1"):
        with pytest.raises(ConfigError, match="Mamba-2"):
            load_config("debug-nemotron", [bad])


def test_logits_match_hf_nemotron_h(tmp_path: Path) -> None:
    m = small_nemotron()
    model = nemotron_model(m)
    d = save_weights_dir(m, model.state_dict(), tmp_path / "w", {"version": 0})
    hf = hf_model(d)
    x = tokens(m, b=2, t=27)  # > 3 Mamba chunks
    with torch.no_grad():
        ours, theirs = model(x), hf(input_ids=x).logits
    assert ours.abs().mean().item() > 0.1
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-5)


def test_trainer_gradients_match_hf_float32(tmp_path: Path) -> None:
    """d(sum of log-probs)/d(weights) equals HF's float32 autograd (its torch Mamba path), every
    parameter through the one name map; experts against HF's fused tensors."""
    m = small_nemotron()
    model = nemotron_model(m)
    d = save_weights_dir(m, model.state_dict(), tmp_path / "w", {"version": 0})
    hf = hf_model(d)
    hf.train()  # (HF's training branch: its torch fallback of the fused kernel path)
    x = tokens(m, b=2, t=20)
    logp, _ = token_logprobs(model, x)
    hf_logp = hf(input_ids=x[:, :-1]).logits.float().log_softmax(-1).gather(-1, x[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logp, hf_logp, rtol=0, atol=1e-5)
    logp.sum().backward()
    hf_logp.sum().backward()
    ours = adapter(m).to_hf({k: p.grad for k, p in model.named_parameters()})
    theirs = {k.replace("model.", "backbone.", 1): p for k, p in hf.named_parameters()}
    checked = 0
    for k, g in ours.items():
        if ".experts." in k:
            layer, e, proj = k.split(".")[2], int(k.split(".")[5]), k.split(".")[6]
            ref = theirs[f"backbone.layers.{layer}.mixer.experts.{proj}"].grad[e]
        else:
            ref = theirs[k].grad
        assert ref is not None and g is not None, k
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=2e-5 * scale, msg=k)
        checked += 1
    assert checked == len(ours) > 40


def test_weights_round_trip_in_both_hf_layouts(tmp_path: Path) -> None:
    """Ours -> HF names -> ours exactly; HF's save_pretrained directory (backbone.*, per-expert)
    and transformers' in-memory names (model.*, fused experts) load as the same weights."""
    m = small_nemotron()
    model = nemotron_model(m)
    state = model.state_dict()
    hf_state = to_hf_state(m, state)
    for name in (
        "backbone.layers.0.mixer.A_log",
        "backbone.layers.0.mixer.conv1d.weight",
        "backbone.layers.1.mixer.k_proj.weight",
        "backbone.layers.2.mixer.experts.7.down_proj.weight",
        "backbone.layers.2.mixer.gate.e_score_correction_bias",
        "backbone.layers.4.mixer.up_proj.weight",
        "backbone.norm_f.weight",
    ):
        assert name in hf_state, name
    back = from_hf_state(m, hf_state)
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())
    d = save_weights_dir(m, state, tmp_path / "w", {"version": 0})
    hf = hf_model(d)
    memory = {k: v.detach() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mixer.experts.up_proj") for k in memory)
    fused = from_hf_state(m, memory)
    assert all(torch.equal(fused[k], v) for k, v in state.items())
    hf.save_pretrained(str(tmp_path / "hf"))
    m2, loaded = load_weights_dir(tmp_path / "hf")
    assert m2 == m and all(torch.equal(loaded[k], v) for k, v in state.items())


# ------------------------------------------------------------------ the trainer's paths


def test_packed_equals_padded_nemotron() -> None:
    """A packed row (every Mamba layer restarts its state and convolution at each sample, the
    attention is document-masked) gives each sample's log-probs of a padded batch."""
    from trainer.attention import enable_document_attention

    m = small_nemotron()
    model = enable_document_attention(nemotron_model(m), "sdpa")
    check_packed_replay_equals_padded(model, m, [13, 9, 21], rtol=0, atol=1e-5)


def test_replay_routes_exactly_as_recorded_nemotron() -> None:
    m = small_nemotron()
    model = nemotron_model(m)
    x = tokens(m, b=2, t=16)
    b, t = x.shape
    routes = random_routes(m, b, t, seed=2)
    routes[0, 2:5] = UNRECORDED
    recorded = (routes >= 0).all(-1)
    with torch.no_grad():
        free = model(x)
    tap = RouterTap(model)
    with torch.no_grad(), routing(model, routes, replay=True) as rec:
        out = model(x)
    tap.close()
    assert len(tap.calls) == len(m.moe_layers()) == 2
    assert (out - free).abs().max().item() > 1e-3
    for li, (layer, call) in enumerate(zip(m.moe_layers(), tap.calls, strict=True)):
        own = own_choice(model, layer, call.x, m).view(b, t, -1)  # on the input this layer saw
        want = torch.where(recorded[:, :, li, None], routes[:, :, li], own)
        assert torch.equal(call.ids.view(b, t, -1).sort(-1).values, want.sort(-1).values)
    assert rec.replayed.tolist() == [float(recorded[..., 0].sum())] * 2


def on_policy_groups(model: torch.nn.Module, m: ModelConfig) -> list[RolloutGroup]:
    """Two groups of 4 random samples whose behaviour log-probs are the model's own (replaying
    each sample's recorded routes): on-policy, so a step's mismatch is ~0."""
    rng = np.random.default_rng(1)
    groups = []
    for gi in range(2):
        samples = []
        for i in range(4):
            s, _ = routed_sample(f"g{gi}.{i}", 10 + i, m, rng)
            (routes,) = micro_batch_routes([s], m, False, 10_000)
            with torch.no_grad(), routing(model, routes, replay=True):
                logp, _ = token_logprobs(model, torch.tensor([s.tokens]))
            update = {"logprobs": [0.0, *logp[0].tolist()], "versions": [0] * len(s.tokens)}
            samples.append(
                s.model_copy(update=update | {"reward": float(i % 2), "advantage": float(i % 2) - 0.5})
            )
        groups.append(RolloutGroup(group_id=f"nem-{gi}", env="reverse", seed=gi, samples=samples))
    return groups


def train_nemotron_step(
    m: ModelConfig,
    model: torch.nn.Module,
    run_dir: Path,
    redis_url: str,
    groups: list[RolloutGroup] | None = None,
    **trainer: object,
) -> tuple[TrainerStepMetrics, dict[str, torch.Tensor], Path]:
    """One trainer.train.run step (torchrun for nproc > 1) from `model`'s weights on `groups`
    (default: its own on-policy groups): (metrics, the published step_1 tensors, step_0's
    directory)."""
    import shutil
    import uuid

    d0 = save_weights_dir(m, model.state_dict(), run_dir.parent / f"{run_dir.name}-step0", {"version": 0})
    shutil.copytree(d0, step_dir(run_dir, 0))
    tree = RunConfig().model_dump()
    tree["model"] = m.model_dump()
    tree["redis"]["prefix"] = f"nem-{uuid.uuid4().hex[:8]}"
    tree["run"].update(max_steps=1, dir=str(run_dir))
    tree["orchestrator"].update(batch_size=2, group_size=4)
    tree["trainer"].update(lr=1e-2, micro_batch_tokens=64, **trainer)
    groups = groups or on_policy_groups(model, m)
    mt, w1 = run_one_step(RunConfig.model_validate(tree), run_dir, redis_url, groups, timeout_s=300)
    return mt, w1, d0


def test_trainer_step_publishes_a_model_hf_loads(redis_server: str, tmp_path: Path) -> None:
    """trainer.train.run on a nemotron_h model (packed, full activation checkpointing, grouped
    expert GEMMs): one step learns (every kind of layer moves) and step_1 loads in transformers."""

    m = small_nemotron()
    mt, w1, d0 = train_nemotron_step(
        m,
        nemotron_model(m, seed=5),
        tmp_path / "run",
        redis_server,
        packing=True,
        activation_checkpoint="full",
        moe_grouped_mm="on",
    )
    assert mt.routing_replayed_frac == 1.0 and mt.loss != 0.0 and abs(mt.mismatch_kl_k3) < 1e-6
    w0 = read_model_dir(d0)[1]
    for k in (
        "backbone.layers.0.mixer.A_log",
        "backbone.layers.0.mixer.in_proj.weight",
        "backbone.layers.1.mixer.q_proj.weight",
        "backbone.layers.2.mixer.experts.0.up_proj.weight",
        "backbone.layers.4.mixer.down_proj.weight",
    ):
        assert (w1[k] - w0[k]).abs().max() > 0, k
    assert torch.equal(
        w1["backbone.layers.2.mixer.gate.e_score_correction_bias"],
        w0["backbone.layers.2.mixer.gate.e_score_correction_bias"],
    )
    hf_model(step_dir(tmp_path / "run", 1))


def test_trainer_step_in_fp8_nemotron(redis_server: str, tmp_path: Path) -> None:
    """trainer.fp8 on nemotron_h (trainer/fp8.py: FP8 linears and squared-ReLU experts, the FP8
    backward): the step's forward is the FP8 model's, so samples scored by that model are on-policy
    (mismatch ~0; the high-precision model's scores are not), and every kind of layer moves."""
    import copy

    from trainer.fp8 import convert

    m = small_nemotron()
    model = nemotron_model(m, seed=5)
    fp8 = copy.deepcopy(model)
    convert(fp8)
    groups = on_policy_groups(fp8, m)
    mt, w1, d0 = train_nemotron_step(m, model, tmp_path / "run", redis_server, groups, packing=True, fp8=True)
    assert mt.routing_replayed_frac == 1.0 and mt.loss != 0.0 and abs(mt.mismatch_kl_k3) < 1e-6
    w0 = read_model_dir(d0)[1]
    for k in (
        "backbone.layers.0.mixer.in_proj.weight",
        "backbone.layers.0.mixer.conv1d.weight",
        "backbone.layers.1.mixer.q_proj.weight",
        "backbone.layers.2.mixer.experts.0.up_proj.weight",
        "backbone.layers.2.mixer.experts.0.down_proj.weight",
        "backbone.layers.2.mixer.shared_experts.up_proj.weight",
        "backbone.layers.4.mixer.down_proj.weight",
    ):
        assert (w1[k] - w0[k]).abs().max() > 0, k
    hp, _, _ = train_nemotron_step(m, model, tmp_path / "hp", redis_server, groups, packing=True)
    print(f"fp8 step mismatch {mt.mismatch_kl_k3:.2e}, high-precision step {hp.mismatch_kl_k3:.2e}")
    assert hp.mismatch_kl_k3 > 1e-5


@pytest.mark.full  # EP itself: test_two_processes_match_one_deepseek, test_trainer_parallel.py
@pytest.mark.skipif(sys.platform != "linux", reason="torchrun/gloo test runs on Linux")
@pytest.mark.parametrize("fp8", [False, True])
def test_fsdp_and_expert_parallel_match_one_process_nemotron(
    redis_server: str, tmp_path: Path, fp8: bool
) -> None:
    """FSDP2 with the squared-ReLU experts split over 2 EP ranks (torchrun, gloo) trains the
    nemotron_h step (packed: Mamba-2 layers split per sample) as one process does; with
    trainer.fp8 too (the FP8 experts on each rank's local experts)."""
    m = small_nemotron()
    model = nemotron_model(m, seed=5)
    # fp8_backward off: its weight gradients quantise along the tokens, in 128-token blocks that
    # differ when the tokens are split over ranks; the forward and the STE backward do not.
    kw = {"packing": True, "fp8": fp8, "fp8_backward": False}
    m1, w1, _ = train_nemotron_step(m, model, tmp_path / "run1", redis_server, **kw)
    m2, w2, _ = train_nemotron_step(m, model, tmp_path / "run2", redis_server, nproc=2, ep=2, **kw)
    assert m2.routing_replayed_frac == 1.0
    for f in ("loss", "grad_norm", "mismatch_kl_k3"):
        assert getattr(m2, f) == pytest.approx(getattr(m1, f), rel=1e-5, abs=1e-7), f
    assert w1.keys() == w2.keys()
    for k in w1:  # 1e-4: 1% of a first Adam step at lr 1e-2 (test_two_processes_match_one_deepseek)
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-4)


def test_nemotron3_configs_size() -> None:
    """configs/models/nemotron3.toml is Nemotron-3 Nano's published size, and the run config's dry
    run sizes it: KV for the 6 attention layers only, plus each sequence's Mamba-2 state."""
    import subprocess
    import tomllib

    from services.common.config import CONFIG_DIR, REPO_ROOT

    m = ModelConfig(**tomllib.loads((CONFIG_DIR / "models" / "nemotron3.toml").read_text()))
    p = m.param_counts()
    assert 31.5e9 < p["total"] < 31.7e9 and 3.5e9 < p["active"] < 3.7e9  # published: 31.6B / 3.6B
    assert (
        m.hybrid_pattern.count("M") == m.hybrid_pattern.count("E") == 23 and m.hybrid_pattern.count("*") == 6
    )
    small = ModelConfig(**tomllib.loads((CONFIG_DIR / "models" / "debug-nemotron.toml").read_text()))
    assert sum(t.numel() for t in build_model(small, seed=0).parameters()) == small.param_counts()["total"]
    out = subprocess.run(
        [sys.executable, "-m", "sbatch.launch", "run", "nemotron3", "--dry-run"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sizing: 31.6B params (3.6B active)" in out.stdout
    assert "KV 6.0 KiB/token, 0.81 GB per max-length sequence + 49 MB of recurrent state" in out.stdout


def test_fresh_untied_head_starts_near_uniform() -> None:
    """trainer.init_std redraws the untied output matrix (nemotron_h never ties it), so a fresh
    run's policy starts near uniform, as the tied debug models do."""
    import math

    m = small_nemotron()
    x = tokens(m, b=4, t=12)
    entropy = {}
    for std in (None, 0.02):
        with torch.no_grad():
            lp = build_model(m, seed=0, init_std=std)(x).log_softmax(-1)
        entropy[std] = float(-(lp.exp() * lp).sum(-1).mean())
    assert entropy[0.02] > math.log(m.vocab_size) - 0.02 > entropy[None]


def test_grouped_experts_take_a_float32_square_under_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA autocast computes square (a pow) in float32 whatever its input; the grouped path must
    hand its second GEMM the first one's dtype again (the result is the bf16 square's bits)."""
    import trainer.nemotron as nemotron

    torch.manual_seed(0)
    experts = nemotron.Relu2Experts(16, 32, 4)
    for w in (experts.w1, experts.w2):
        torch.nn.init.normal_(w, std=0.1)
    experts.use_grouped_mm = True
    x = torch.randn(12, 16).bfloat16()
    counts = torch.tensor([3, 0, 5, 4])
    w1, w2 = (w.detach().bfloat16() for w in experts.local_weights())
    want = experts.run(w1, w2, x, counts)
    monkeypatch.setattr(nemotron, "relu2", lambda t: torch.square(torch.relu(t.float())))
    got = experts.run(w1, w2, x, counts)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
