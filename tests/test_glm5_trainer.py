"""GLM-5 (glm_moe_dsa) in the trainer (trainer/glm5.py): torchtitan's DeepSeek-V3 with the DSA
indexer, against HF GlmMoeDsaForCausalLM and the inference engine on the same weights (float32),
its gradients against HF's float32 ones, Router Replay, packing, and the indexer's two training
modes (frozen, DeepSeek-V3.2's KL). Every check runs with sequences longer than index_topk, so
attention really is sparse (test_sparse_selection_changes_the_function shows it matters)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.moe import (
    RouterTap,
    check_packed_replay_equals_padded,
    choice_sample,
    engine_samples,
    own_choice,
    random_routes,
    run_one_step,
    small_glm,
    tokens,
)

from services.common.config import EngineConfig, ModelConfig, RunConfig
from services.common.schemas import GenerateRequest, RolloutGroup, SamplingParams, TrainerStepMetrics
from services.common.weights_dir import read_model_dir, step_dir
from trainer.batch import micro_batches
from trainer.glm5 import GlmAttention, glm_attentions, indexer_kl, indexer_loss, set_indexer_mode
from trainer.loss import token_logprobs
from trainer.model import (
    adapter,
    build_model,
    from_hf_state,
    load_weights_dir,
    moe_layer_ids,
    save_weights_dir,
    to_hf_state,
)
from trainer.replay import UNRECORDED, micro_batch_routes, moe_routers, routing

TOL = 1e-5  # float32 log-probs, engine vs trainer


def glm_model(m: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """Random weights with decisive routing (gate std 1, experts std 0.3, a correction bias that
    changes the selection) and an indexer whose scores spread (its weights std 0.3)."""
    model = build_model(m, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for r in moe_routers(model):
            r.gate.weight.copy_(torch.randn(r.gate.weight.shape, generator=g))
        for layer in moe_layer_ids(m):
            moe = model.layers[str(layer)].moe
            for w in [moe.experts.w1, moe.experts.w2, moe.experts.w3]:
                w.copy_(0.3 * torch.randn(w.shape, generator=g))
            moe.expert_bias.copy_(0.5 * torch.rand(m.n_routed_experts, generator=g))
        for name, p in model.named_parameters():
            if ".indexer." in name and "norm" not in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import GlmMoeDsaForCausalLM

    return GlmMoeDsaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def dense_copy(model: torch.nn.Module) -> None:
    for a in glm_attentions(model):
        a.indexer.topk = 10_000


# ------------------------------------------------------------------ the HF contract


def test_logits_match_hf_glm_moe_dsa(tmp_path: Path) -> None:
    m = small_glm()
    model = glm_model(m)
    d = save_weights_dir(m, model.state_dict(), tmp_path / "w", {"version": 0})
    hf = hf_model(d)
    x = tokens(m, b=2, t=24)
    with torch.no_grad():
        ours, theirs = model(x), hf(input_ids=x).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_sparse_selection_changes_the_function() -> None:
    """The parity above checks sparse attention itself: with every key selected the logits move."""
    m = small_glm()
    model = glm_model(m)
    x = tokens(m, b=2, t=24)
    with torch.no_grad():
        sparse = model(x)
        dense_copy(model)
        dense = model(x)
    assert (sparse - dense).abs().max().item() > 1e-2
    # A query that sees at most index_topk keys keeps them all: the first positions are dense MLA.
    k = m.index_topk
    torch.testing.assert_close(sparse[:, :k], dense[:, :k], rtol=1e-5, atol=1e-5)
    assert (sparse[:, k:] - dense[:, k:]).abs().amax(dim=-1).min().item() > 0


def test_weights_round_trip_in_hf_glm_names(tmp_path: Path) -> None:
    """One name map (trainer.model.adapter): ours -> HF names -> ours exactly; HF's own
    save_pretrained directory loads in the trainer as the same weights and config."""
    m = small_glm()
    model = glm_model(m)
    state = model.state_dict()
    hf_state = to_hf_state(m, state)
    for name in (
        "model.layers.1.self_attn.indexer.wq_b.weight",
        "model.layers.1.self_attn.indexer.wk.weight",
        "model.layers.1.self_attn.indexer.k_norm.weight",
        "model.layers.1.self_attn.indexer.k_norm.bias",
        "model.layers.1.self_attn.indexer.weights_proj.weight",
        "model.layers.2.mlp.gate.e_score_correction_bias",
        "model.layers.0.mlp.gate_proj.weight",
    ):
        assert name in hf_state, name
    back = from_hf_state(m, hf_state)
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k
    d = save_weights_dir(m, state, tmp_path / "w", {"version": 0})
    hf = hf_model(d)
    hf.save_pretrained(str(tmp_path / "hf"))
    m2, loaded = load_weights_dir(tmp_path / "hf")
    assert m2.model_dump(exclude={"max_seq_len"}) == m.model_dump(exclude={"max_seq_len"})
    assert set(loaded) == set(state)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k


def test_trainer_gradients_match_hf_float32(tmp_path: Path) -> None:
    """d(sum of token log-probs)/d(weights) in the trainer equals HF's float32 autograd on the
    same weights, parameter by parameter (HF names through the adapter); the frozen indexer gets
    none on either side (HF runs it under no_grad)."""
    m = small_glm()
    model = glm_model(m)
    d = save_weights_dir(m, model.state_dict(), tmp_path / "w", {"version": 0})
    hf = hf_model(d)
    x = tokens(m, b=2, t=20)
    logp, _ = token_logprobs(model, x)
    logp.sum().backward()
    logits = hf(input_ids=x[:, :-1]).logits.float()
    hf_logp = logits.log_softmax(-1).gather(-1, x[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logp, hf_logp, rtol=0, atol=TOL)
    hf_logp.sum().backward()
    ours = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert not any(".indexer." in k for k in ours)
    assert all(p.grad is None for n, p in hf.named_parameters() if ".indexer." in n)
    mapped = adapter(m).to_hf({k: v for k, v in ours.items()})
    theirs = dict(hf.named_parameters())
    fused = 0
    for k, g in mapped.items():
        if k in theirs:
            ref = theirs[k].grad
        else:  # HF holds the experts fused: gate_up_proj [E, 2I, D], down_proj [E, D, I]
            layer, e, proj = k.split(".")[2], int(k.split(".")[5]), k.split(".")[6]
            pre = f"model.layers.{layer}.mlp.experts."
            i = m.moe_hidden_dim
            if proj == "down_proj":
                ref = theirs[pre + "down_proj"].grad[e]
            else:
                gu = theirs[pre + "gate_up_proj"].grad[e]
                ref = gu[:i] if proj == "gate_proj" else gu[i:]
            fused += 1
        assert ref is not None, k
        if k == "model.embed_tokens.weight":
            # HF's nn.Embedding(padding_idx=pad_token_id) gives the pad row no gradient by design.
            g, ref = g[1:], ref[1:]
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5 * scale, msg=k)
    assert fused > 0


# ------------------------------------------------------------------ engine = trainer


@pytest.mark.parametrize("replay", [True, False])
def test_engine_logprobs_equal_trainer_glm5(tmp_path: Path, replay: bool) -> None:
    """The CPU engine (MLA + DSA + MoE, float32) samples from the trainer's published weights; the
    trainer's log-probs of those samples equal the engine's to 1e-5, with the engine's routes
    replayed or routing on its own (then its every top-k set equals the engine's)."""
    m = small_glm(max_seq_len=64)
    model = glm_model(m, seed=3)
    d = save_weights_dir(m, model.state_dict(), tmp_path / "step_0", {"version": 0})
    samples = engine_samples(d, m)
    (mb,) = micro_batches(samples, 10_000)
    (routes,) = micro_batch_routes(samples, m, False, 10_000)
    with torch.no_grad(), routing(model, routes, replay=replay) as rec:
        logp, _ = token_logprobs(model, mb.tokens)
    mask = mb.loss_mask > 0
    assert mb.tokens.shape[1] > m.index_topk + 8
    torch.testing.assert_close(logp[mask], mb.logp_infer[mask], rtol=0, atol=TOL)
    n = float(sum(len(s.tokens) - 1 for s in samples))
    assert rec.total.tolist() == [n] * len(moe_layer_ids(m))
    assert torch.equal(rec.agree, rec.total)
    assert rec.replayed.tolist() == ([n] if replay else [0.0]) * len(moe_layer_ids(m))


def test_engine_breaks_index_score_ties_as_the_trainer_glm5(tmp_path: Path) -> None:
    """Keys whose index scores tie (every head's ReLU 0: exactly 0, common once an indexer starts to
    learn) go to the earlier key in the engine as in the trainer, so the trainer's log-probs of the
    engine's samples still equal the engine's. Here every score ties: the head weights are 0."""
    m = small_glm(max_seq_len=64)
    model = glm_model(m, seed=3)
    with torch.no_grad():
        for a in glm_attentions(model):
            a.indexer.weights_proj.weight.zero_()
    d = save_weights_dir(m, model.state_dict(), tmp_path / "step_0", {"version": 0})
    samples = engine_samples(d, m)
    (mb,) = micro_batches(samples, 10_000)
    (routes,) = micro_batch_routes(samples, m, False, 10_000)
    with torch.no_grad(), routing(model, routes, replay=True):
        logp, _ = token_logprobs(model, mb.tokens)
    mask = mb.loss_mask > 0
    assert mb.tokens.shape[1] > m.index_topk + 8
    torch.testing.assert_close(logp[mask], mb.logp_infer[mask], rtol=0, atol=TOL)


def test_fp8_engine_equals_fp8_trainer_glm5(tmp_path: Path) -> None:
    """decode.engine.quantization = "fp8" and trainer.fp8 on the same GLM-5 weights: the same
    block-scaled recipe on the same linears (MLA's kv_b_proj high precision on both sides, the
    indexer's projections FP8 on both), so the log-probs agree to float32 rounding."""
    from trainer.fp8 import convert

    m = small_glm(max_seq_len=64)
    model = glm_model(m, seed=3)
    d = save_weights_dir(m, model.state_dict(), tmp_path / "step_0", {"version": 0})
    samples = engine_samples(d, m, quantization="fp8")
    names = convert(model)
    assert "layers.1.attention.indexer.wq_b" in names and "layers.1.attention.wkv_b" not in names
    (mb,) = micro_batches(samples, 10_000)
    (routes,) = micro_batch_routes(samples, m, False, 10_000)
    with torch.no_grad(), routing(model, routes, replay=True):
        logp, _ = token_logprobs(model, mb.tokens)
    mask = mb.loss_mask > 0
    torch.testing.assert_close(logp[mask], mb.logp_infer[mask], rtol=0, atol=TOL)


def test_replay_routes_exactly_as_recorded_glm5() -> None:
    """Recorded ids (random, ignoring the bias) are the ids every MoE layer uses, unrecorded rows
    route by the trainer's own choice, and replay changes the output."""
    m = small_glm()
    model = glm_model(m)
    x = tokens(m, b=2, t=16)
    b, t = x.shape
    routes = random_routes(m, b, t, seed=2)
    routes[1, 3:6] = UNRECORDED
    recorded = (routes >= 0).all(-1)
    with torch.no_grad():
        free = model(x)
    tap = RouterTap(model)
    with torch.no_grad(), routing(model, routes, replay=True):
        out = model(x)
    tap.close()
    assert (out - free).abs().max().item() > 1e-3
    for li, (layer, call) in enumerate(zip(m.moe_layers(), tap.calls, strict=True)):
        own = own_choice(model, layer, call.x, m).view(b, t, -1)  # on the input this layer saw
        want = torch.where(recorded[:, :, li, None], routes[:, :, li], own)
        assert torch.equal(call.ids.view(b, t, -1).sort(-1).values, want.sort(-1).values)


def test_packed_equals_padded_glm5() -> None:
    """Packed micro-batches (positions restart per sample; the indexer selects within a sample)
    give the same replayed log-probs as a padded batch."""
    from trainer.attention import enable_document_attention

    m = small_glm()
    model = enable_document_attention(glm_model(m), "sdpa")
    packed = check_packed_replay_equals_padded(model, m, [13, 9, 16], rtol=0, atol=TOL)
    assert max(packed.seq_lens) > m.index_topk


# ------------------------------------------------------------------ the indexer's training modes


def _grads(model: torch.nn.Module, x: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with indexer_loss(model, scale):
        logp, _ = token_logprobs(model, x)
        logp.sum().backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_frozen_indexer_has_no_gradient_and_kl_trains_only_the_indexer() -> None:
    m = small_glm()
    model = glm_model(m)
    x = tokens(m, b=2, t=20)
    frozen = _grads(model, x, 0.5)
    assert not any(".indexer." in k for k in frozen)
    assert all(not p.requires_grad for a in glm_attentions(model) for p in a.indexer.parameters())
    set_indexer_mode(model, "kl")
    kl = _grads(model, x, 0.5)
    # The rest of the model learns from its loss only (the indexer reads detached inputs).
    assert {k for k in kl if ".indexer." not in k} == set(frozen)
    for k, g in frozen.items():
        assert torch.equal(kl[k], g), k
    # The indexer's gradient is scale * dL_I/dtheta, L_I recomputed here from its definition.
    attn = model.layers["1"].attention
    assert isinstance(attn, GlmAttention)
    inputs: dict[str, torch.Tensor] = {}
    hook = attn.register_forward_pre_hook(lambda _m, a: inputs.update(x=a[0].detach(), fc=a[1]))
    with torch.no_grad():
        model(x[:, :-1])
    hook.remove()
    from torchtitan.models.deepseek_v3.model.model import apply_rotary_emb

    h = inputs["x"]
    bsz, t, _ = h.shape
    with torch.no_grad():
        q_resid = attn.q_norm(attn.wq_a(h))
        q = attn.wq_b(q_resid).view(bsz, t, -1, attn.qk_head_dim)
        qn, qp = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], -1)
        q = torch.cat([qn, apply_rotary_emb(qp, inputs["fc"])], -1).transpose(1, 2)
        kv, kpe = attn.wkv_a(h).split([attn.kv_lora_rank, attn.qk_rope_head_dim], -1)
        kpe = apply_rotary_emb(kpe.unsqueeze(2), inputs["fc"])
        kvb = attn.wkv_b(attn.kv_norm(kv)).view(bsz, t, -1, attn.qk_nope_head_dim + attn.v_head_dim)
        k = torch.cat([kvb[..., : attn.qk_nope_head_dim], kpe.expand(-1, -1, m.n_heads, -1)], -1).transpose(
            1, 2
        )
    scores = attn.indexer.scores(h, q_resid, inputs["fc"], None)
    visible = torch.ones(t, t, dtype=torch.bool).tril()[None]
    selected = attn.indexer.select(scores.detach(), visible)
    assert (selected.sum(-1) <= m.index_topk).all() and (selected.sum(-1)[:, -1] == m.index_topk).all()
    loss = indexer_kl(q, k, attn.softmax_scale, selected, scores)
    assert loss.item() > 0
    params = dict(attn.indexer.named_parameters())
    ref = torch.autograd.grad(loss, list(params.values()))
    for (name, _), r in zip(params.items(), ref, strict=True):
        torch.testing.assert_close(kl[f"layers.1.attention.indexer.{name}"], 0.5 * r, rtol=1e-5, atol=1e-7)


def test_indexer_kl_is_zero_when_the_indexer_matches_attention() -> None:
    """KL(p || softmax(I)) vanishes when I is the log of the head-summed attention: the loss is
    DeepSeek-V3.2's distribution match, not some other functional."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 3, 7, 4, generator=g), torch.randn(1, 3, 7, 4, generator=g)
    visible = torch.ones(7, 7, dtype=torch.bool).tril()[None]
    p = (
        (torch.matmul(q, k.transpose(-1, -2)) * 0.5)
        .masked_fill(~visible[:, None], float("-inf"))
        .softmax(-1)
        .sum(1)
    )
    matched = torch.log(p / 3).masked_fill(~visible, 0.0)
    assert abs(indexer_kl(q, k, 0.5, visible, matched).item()) < 1e-6
    assert indexer_kl(q, k, 0.5, visible, torch.zeros(1, 7, 7)).item() > 1e-3


# ------------------------------------------------------------------ a trainer step, end to end


def engine_groups(d0: Path, m: ModelConfig) -> list[RolloutGroup]:
    from services.engine import LLMEngine

    eng = LLMEngine(d0, EngineConfig(device="cpu", max_batch_size=8, max_seq_len=m.max_seq_len, block_size=4))
    groups = []
    for gi in range(2):
        prompt = [5 + gi, 9, 14, 20, 3, 7, 11, 2]
        params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=10 + gi, n=4)
        (resp,) = eng.generate(
            [GenerateRequest(input_ids=prompt, sampling=params, return_routed_experts=True)]
        )
        samples = [
            choice_sample(f"g{gi}.{i}", prompt, c, reward=float(i % 2), advantage=float(i % 2) - 0.5)
            for i, c in enumerate(resp.choices)
        ]
        groups.append(RolloutGroup(group_id=f"glm-{gi}", env="reverse", seed=gi, samples=samples))
    return groups


def train_glm_step(
    m: ModelConfig, run_dir: Path, d0: Path, redis_url: str, **trainer: object
) -> tuple[TrainerStepMetrics, dict[str, torch.Tensor]]:
    import shutil
    import uuid

    shutil.copytree(d0, step_dir(run_dir, 0))
    tree = RunConfig().model_dump()
    tree["model"] = m.model_dump()
    tree["redis"]["prefix"] = f"glm-{uuid.uuid4().hex[:8]}"
    tree["run"].update(max_steps=1, dir=str(run_dir))
    tree["orchestrator"].update(batch_size=2, group_size=4)
    tree["trainer"].update(lr=1e-2, micro_batch_tokens=64, **trainer)
    return run_one_step(
        RunConfig.model_validate(tree), run_dir, redis_url, engine_groups(d0, m), timeout_s=300
    )


@pytest.mark.parametrize("mode", ["frozen", "kl"])
def test_trainer_step_on_engine_samples_glm5(redis_server: str, tmp_path: Path, mode: str) -> None:
    """trainer.train.run on engine-sampled GLM-5 groups: the engine's log-probs are the trainer's
    own (k3 ~ 0), every route replayed and agreed, the step learns and publishes a step_1 the
    engine loads; the indexer is unchanged when frozen and moves (KL reported) with "kl"."""
    from services.engine import LLMEngine

    m = small_glm(max_seq_len=64)
    d0 = save_weights_dir(m, glm_model(m, seed=5).state_dict(), tmp_path / "step0", {"version": 0})
    run_dir = tmp_path / "run"
    mt, w1 = train_glm_step(m, run_dir, d0, redis_server, dsa_indexer=mode)
    assert mt.routing_replayed_frac == 1.0 and mt.routing_agreement_mean == 1.0
    assert abs(mt.mismatch_kl_k3) < 1e-6

    w0 = read_model_dir(d0)[1]
    assert (
        w1["model.layers.1.self_attn.q_b_proj.weight"] - w0["model.layers.1.self_attn.q_b_proj.weight"]
    ).abs().max() > 0
    moved = [k for k in w0 if ".indexer." in k and not torch.equal(w0[k], w1[k])]
    if mode == "frozen":
        assert moved == [] and mt.dsa_indexer_kl is None
    else:
        assert len(moved) >= 3 * m.n_layers and mt.dsa_indexer_kl is not None and mt.dsa_indexer_kl > 0
    eng = LLMEngine(step_dir(run_dir, 1), EngineConfig(device="cpu", max_batch_size=8, max_seq_len=64))
    assert eng.version == 1 and eng.model_config.arch == "glm_moe_dsa"


@pytest.mark.full  # EP itself: test_two_processes_match_one_deepseek, test_trainer_parallel.py
@pytest.mark.skipif(sys.platform != "linux", reason="torchrun/gloo test runs on Linux")
@pytest.mark.parametrize("mode", ["frozen", "kl"])
def test_fsdp_and_expert_parallel_match_one_process_glm5(
    redis_server: str, tmp_path: Path, mode: str
) -> None:
    """FSDP2 with the routed experts split over 2 EP ranks (torchrun, gloo) trains the GLM-5 step
    as one process does, with the indexer frozen (parameters without gradients in the FSDP units)
    or KL-trained."""
    m = small_glm(max_seq_len=64)
    d0 = save_weights_dir(m, glm_model(m, seed=5).state_dict(), tmp_path / "step0", {"version": 0})
    m1, w1 = train_glm_step(m, tmp_path / "run1", d0, redis_server, dsa_indexer=mode)
    m2, w2 = train_glm_step(m, tmp_path / "run2", d0, redis_server, dsa_indexer=mode, nproc=2, ep=2)
    assert m2.routing_replayed_frac == 1.0 and m2.routing_agreement_mean == 1.0
    for f in ("loss", "grad_norm", "mismatch_kl_k3", "dsa_indexer_kl"):
        if getattr(m1, f) is None:
            assert getattr(m2, f) is None, f
        else:
            assert getattr(m2, f) == pytest.approx(getattr(m1, f), rel=1e-5, abs=1e-7), f
    assert w1.keys() == w2.keys()
    for k in w1:  # 1e-4: 1% of a first Adam step at lr 1e-2 (test_two_processes_match_one_deepseek)
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-4)


# ------------------------------------------------------------------ bf16: what Router Replay removes


def bf16_replay_mismatch_glm5(device: str) -> dict[str, float]:
    """A bf16 engine samples 8 x 96 tokens from a larger random GLM-5 (32 experts top-4, DSA
    choosing 32 of up to 102 keys, 16 indexer heads); the bf16 trainer (autocast) scores them with
    the recorded routes replayed and with its own routing. Returns the k3 mismatch and the routing
    agreement both ways."""
    import tempfile

    from services.engine import LLMEngine

    m = small_glm(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=8,
        head_dim=48,
        hidden_dim=512,
        max_seq_len=256,
        n_routed_experts=32,
        n_experts_per_tok=4,
        moe_hidden_dim=128,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_topk=32,
        index_n_heads=16,
        index_head_dim=32,
    )
    model = glm_model(m, seed=7)
    prompt = [5, 9, 14, 20, 3, 7]
    with tempfile.TemporaryDirectory() as tmp:
        d = save_weights_dir(m, model.state_dict(), Path(tmp) / "w", {"version": 0})
        eng = LLMEngine(d, EngineConfig(device=device, dtype="bfloat16", max_batch_size=16, max_seq_len=256))
        params = SamplingParams(temperature=1.0, max_tokens=96, ignore_eos=True, seed=3, n=8)
        (resp,) = eng.generate(
            [GenerateRequest(input_ids=prompt, sampling=params, return_routed_experts=True)]
        )
    samples = [choice_sample(f"s{i}", prompt, c) for i, c in enumerate(resp.choices)]
    (mb,) = micro_batches(samples, 100_000)
    (routes,) = micro_batch_routes(samples, m, False, 100_000)
    assert routes is not None
    model, mb = model.to(device), mb.to(torch.device(device))
    out: dict[str, float] = {}
    for replay in (True, False):
        with (
            torch.no_grad(),
            torch.autocast(torch.device(device).type, dtype=torch.bfloat16),
            routing(model, routes.to(device), replay=replay) as rec,
        ):
            logp, _ = token_logprobs(model, mb.tokens)
        log_r = (logp.float() - mb.logp_infer.float())[mb.loss_mask > 0]
        out[f"k3_replay_{replay}"] = float((log_r.exp() - 1 - log_r).mean())
        out[f"agreement_{replay}"] = float(rec.agree.sum() / rec.total.sum())
    return out


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))],
)
def test_bf16_replay_removes_routing_mismatch_glm5(device: str) -> None:
    r = bf16_replay_mismatch_glm5(device)
    print(f"bf16 glm_moe_dsa replay on {device}:", r)  # the numbers for the report (pytest -s)
    assert r["agreement_False"] < 1.0  # bf16 flips near-tied expert choices
    # Measured on CPU: k3 8.7e-5 with replay vs 1.0e-2 without (dense attention, index_topk above
    # the length: 8.3e-5 vs 8.6e-3: the sparse selection adds little in bf16).
    assert r["k3_replay_True"] < 0.1 * r["k3_replay_False"]
    assert r["k3_replay_True"] < 1e-3
