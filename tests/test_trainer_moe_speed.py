"""The MoE trainer step's fast path on CPU: trainer.moe_grouped_mm and the overheads removed.

- torch._grouped_mm experts (trainer/moe_routing.py RoutedExperts) give the per-expert loop's
  log-probs and gradients: float32 to rounding, bf16 (autocast, torchtitan's bf16 GEMMs) closely;
  for qwen3_moe and deepseek_v3, without AC and with selective AC (whose MoE save list keeps
  the grouped GEMMs and the all-to-alls);
- Router Replay: the recorded ids drive the grouped GEMMs exactly as they drive the loop;
- expert parallel (ep = 2, 2 gloo processes): grouped GEMMs after torchtitan's all-to-all dispatch
  (padded, permuted token groups) give the loop's losses and gradients;
- the per-expert token counts are bincount's without its host sync; the knob resolves and validates;
- under trainer.compile the routers stay eager (Router Replay finds them; the reorderer traces
  with fullgraph=True).
The GPU speed is measured by bench/trainer/step.py (docs/trainer.md, "MoE experts").
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from helpers.moe import random_routes, small_ds, small_moe, tokens
from pydantic import ValidationError

from services.common.config import ModelConfig, TrainerSection
from trainer.model import CountingReorderer, build_model, moe_layer_ids
from trainer.moe_routing import RoutedExperts, count_per_expert, grouped_mm_enabled
from trainer.parallel import MOE_SAC_SAVE_OPS, apply_compile, parallelize, sac_save_list
from trainer.replay import ReplayRouter, moe_routers, routing


def decisive(model: torch.nn.Module, m: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """Random weights with decisive routing (torchtitan inits the gate tiny): experts matter, and
    recorded ids that differ from the trainer's own choice change the output."""
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for r in moe_routers(model):
            r.gate.weight.copy_(torch.randn(r.gate.weight.shape, generator=g))
        for layer in moe_layer_ids(m):
            experts = model.layers[str(layer)].moe.experts
            for w in (experts.w1, experts.w2, experts.w3):
                w.copy_(0.3 * torch.randn(w.shape, generator=g))
    return model


def build(m: ModelConfig, grouped: str, ac: str = "none", dtype: str = "float32") -> torch.nn.Module:
    """The trainer's model (build_model, then parallelize as train.py does) in one plain process."""
    model = decisive(build_model(m, seed=0), m)
    tc = TrainerSection(moe_grouped_mm=grouped, activation_checkpoint=ac, dtype=dtype)  # type: ignore[arg-type]
    model, _, _ = parallelize(model, tc, 1, torch.device("cpu"), distributed=False)
    return model


def experts_of(model: torch.nn.Module, m: ModelConfig) -> list[RoutedExperts]:
    return [model.layers[str(i)].moe.experts for i in moe_layer_ids(m)]


def loss_and_grads(
    model: torch.nn.Module, x: torch.Tensor, routes: torch.Tensor | None = None, autocast: bool = False
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token log-probs (detached), their mean as the loss, and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with routing(model, routes, replay=True) as rec, amp:
        logits = model(x[:, :-1]).float()
        logp = logits.log_softmax(-1).gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -logp.mean()
        loss.backward()
    assert routes is None or float(rec.replayed.sum()) == routes.shape[0] * routes.shape[1] * routes.shape[2]
    grads = {
        k.replace("_checkpoint_wrapped_module.", ""): p.grad.detach().clone()  # AC-wrapped names
        for k, p in model.named_parameters()
        if p.grad is not None
    }
    return logp.detach(), loss.detach(), grads


def assert_same(a: Any, b: Any, rtol: float, atol: float) -> None:
    (la, loss_a, ga), (lb, loss_b, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=atol)
    assert ga.keys() == gb.keys() and any("experts.w1" in k for k in ga)
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=rtol, atol=atol, msg=k)


# ------------------------------------------------------------------ knob, counts


def test_knob_resolves_and_validates_with_the_key_named() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert grouped_mm_enabled("auto", cuda, "bfloat16")
    assert not grouped_mm_enabled("auto", cuda, "float32")  # float32: the loop stays the reference
    assert not grouped_mm_enabled("auto", cpu, "bfloat16")
    assert grouped_mm_enabled("on", cpu, "float32") and not grouped_mm_enabled("off", cuda, "bfloat16")
    assert TrainerSection().moe_grouped_mm == "auto"
    with pytest.raises(ValidationError, match="moe_grouped_mm"):
        TrainerSection(moe_grouped_mm="fast")  # type: ignore[arg-type]
    m = small_moe()
    for setting, on in (("auto", False), ("on", True), ("off", False)):
        experts = experts_of(build(m, setting), m)
        assert experts and all(isinstance(e, RoutedExperts) and e.use_grouped_mm is on for e in experts)


def test_counts_per_expert_equal_bincount() -> None:
    ids = torch.randint(0, 16, (300, 4), generator=torch.Generator().manual_seed(0))
    ids[0, 0] = 15  # the last expert is counted; experts nobody chose get 0
    counts = count_per_expert(ids, 20)
    assert counts.dtype == torch.int64 and counts.shape == (20,)
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=20))
    assert int(counts[16:].sum()) == 0 and int(counts.sum()) == ids.numel()


# ------------------------------------------------------------------ grouped GEMMs == loop


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("ac", ["none", "selective"])
def test_grouped_mm_gives_the_loops_logprobs_and_gradients(arch: str, ac: str) -> None:
    m = small_moe() if arch == "qwen3_moe" else small_ds()
    x = tokens(m, b=2, t=24)
    loop = loss_and_grads(build(m, "off"), x)
    grouped = loss_and_grads(build(m, "on", ac=ac), x)
    assert_same(grouped, loop, rtol=1e-5, atol=1e-6)


def test_router_replay_drives_the_grouped_gemms() -> None:
    """Recorded ids (far from the trainer's own choice) replayed on both paths: the same output and
    gradients, gate included; and replay changed the output (the ids really drove the GEMMs)."""
    m = small_moe()
    x = tokens(m, b=2, t=24)
    routes = random_routes(m, b=2, t=23)
    grouped_model = build(m, "on", ac="selective")
    replayed = loss_and_grads(grouped_model, x, routes)
    assert_same(replayed, loss_and_grads(build(m, "off"), x, routes), rtol=1e-5, atol=1e-6)
    gate = next(k for k in replayed[2] if k.endswith("router.gate.weight"))
    assert replayed[2][gate].abs().sum() > 0  # the gate learns through its scores at the replayed ids
    own = loss_and_grads(grouped_model, x)
    assert (own[0] - replayed[0]).abs().max() > 1e-2


def test_grouped_mm_bf16_autocast_close_to_the_loop() -> None:
    """bf16 (autocast, as a single bf16 process runs): torchtitan's bf16 grouped GEMMs vs the loop's
    bf16 matmuls; both round differently, so close, not equal."""
    m = small_moe()
    x = tokens(m, b=2, t=24)
    loop = loss_and_grads(build(m, "off", dtype="bfloat16"), x, autocast=True)
    grouped = loss_and_grads(build(m, "on", dtype="bfloat16"), x, autocast=True)
    torch.testing.assert_close(grouped[1], loop[1], rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(grouped[0], loop[0], rtol=5e-2, atol=5e-2)
    for k in loop[2]:
        if "experts" in k:  # the routed experts' own gradients: the GEMMs that changed
            rel = (grouped[2][k] - loop[2][k]).norm() / loop[2][k].norm()
            assert rel < 5e-2, (k, float(rel))


# ------------------------------------------------------------------ expert parallel (2 processes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ep_worker(rank: int, port: int, out: dict[str, Any]) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist

    from trainer.parallel import clip_grad_norm

    dist.init_process_group("gloo")
    try:
        m = small_moe(n_routed_experts=4)
        x = tokens(m, b=2, t=20, seed=10 + rank)  # each EP rank trains its own tokens
        routes = random_routes(m, b=2, t=19, seed=20 + rank)
        res: dict[str, Any] = {}
        for name, grouped, ac, route in (
            ("loop", "off", "none", None),
            ("grouped_sac", "on", "selective", None),
            ("loop_replay", "off", "none", routes),
            ("grouped_sac_replay", "on", "selective", routes),
        ):
            model = decisive(build_model(m, seed=0), m)
            tc = TrainerSection(nproc=2, ep=2, moe_grouped_mm=grouped, activation_checkpoint=ac)  # type: ignore[arg-type]
            model, deg, _ = parallelize(model, tc, 2, torch.device("cpu"), distributed=True)
            with routing(model, route, replay=True):
                logits = model(x[:, :-1]).float()
                loss = -logits.log_softmax(-1).gather(-1, x[:, 1:].unsqueeze(-1)).mean()
                loss.backward()
            norm = clip_grad_norm(model, 1e9, deg)
            full = getattr(norm, "full_tensor", None)
            w1 = model.layers["1"].moe.experts.w1
            res[name] = {
                "loss": float(loss),
                "grad_norm": float(full() if callable(full) else norm),
                "w1_grad": w1.grad.full_tensor().clone(),
                "mesh": list(w1.device_mesh.mesh_dim_names or ()),
                "grouped": model.layers["1"].moe.experts.use_grouped_mm,
            }
        out[rank] = res
    finally:
        dist.destroy_process_group()


# ~10 s (35 s on a loaded machine): two spawned gloo processes (fork hung once after other tests
# had used the parent's threads), four models each.
def test_expert_parallel_grouped_mm_matches_the_loop() -> None:
    """ep = 2 on 2 gloo processes: tokens reach the other rank's experts by all-to-all and arrive
    as torchtitan's padded, expert-major groups; the grouped GEMMs (with selective AC, whose MoE save
    list keeps the all-to-alls and grouped GEMMs) give the loop's losses and gradients, with and
    without replayed routes."""
    out = mp.Manager().dict()
    mp.start_processes(_ep_worker, args=(_free_port(), out), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        r = out[rank]
        assert "ep" in r["grouped_sac"]["mesh"] and r["grouped_sac"]["grouped"] and not r["loop"]["grouped"]
        for loop, grouped in (("loop", "grouped_sac"), ("loop_replay", "grouped_sac_replay")):
            a, b = r[grouped], r[loop]
            torch.testing.assert_close(a["loss"], b["loss"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a["grad_norm"], b["grad_norm"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a["w1_grad"], b["w1_grad"], rtol=1e-5, atol=1e-6)
        assert abs(r["loop_replay"]["loss"] - r["loop"]["loss"]) > 1e-4  # the replayed ids mattered


# ------------------------------------------------------------------ SAC save list, compile


def test_moe_sac_keeps_all_to_all_and_grouped_gemms() -> None:
    m = small_moe()
    moe_list = sac_save_list(build_model(m, seed=0))
    assert MOE_SAC_SAVE_OPS <= moe_list
    assert torch.ops.aten.mm.default in moe_list  # torchtitan's Qwen3 list is still all there
    dense = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64)
    assert not MOE_SAC_SAVE_OPS & sac_save_list(build_model(dense, seed=0))


def test_compile_keeps_routers_eager_and_the_reorderer_traces() -> None:
    m = small_moe()
    tc = TrainerSection(compile=True, activation_checkpoint="selective", moe_grouped_mm="on")
    model, _, _ = parallelize(decisive(build_model(m, seed=0), m), tc, 1, torch.device("cpu"), False)
    routers = moe_routers(model)
    assert routers and all(type(r) is ReplayRouter for r in routers)  # routing() can find them
    with routing(model, random_routes(m, b=1, t=4), replay=True):  # finds them: no TypeError
        assert all(r.replay_ids is not None for r in routers)
    # The reorderer (compiled by torchtitan's apply_compile with fullgraph=True) must trace: the
    # counts have a static shape now (bincount's depended on the data).
    reorderer = CountingReorderer(8, 2)
    ids = torch.randint(0, 8, (40, 2), generator=torch.Generator().manual_seed(1))
    scores = torch.rand(40, 2)
    compiled = torch.compile(reorderer, backend="eager", fullgraph=True)
    for got, want in zip(compiled(scores, ids), reorderer(scores, ids), strict=True):
        assert torch.equal(got, want)


def test_compiled_moe_blocks_with_replay_match_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.compile's per-block compile (fullgraph=True: attention, norms, reorderer; the
    grouped GEMMs as torchtitan compiles them), traced by dynamo + AOT autograd ("aot_eager": no
    inductor build), under selective AC with replayed routes: eager's log-probs and gradients."""
    import torchtitan.models.moe.moe as tt_moe

    # torchtitan's apply_compile swaps this module function for a compiled one, process-wide.
    monkeypatch.setattr(tt_moe, "_run_experts_grouped_mm", tt_moe._run_experts_grouped_mm)
    m = small_moe()
    x, routes = tokens(m, b=2, t=24), random_routes(m, b=2, t=23)

    def make(compiled: bool) -> torch.nn.Module:
        model = build(m, "on", ac="selective")
        if compiled:
            apply_compile(model, ep=False, backend="aot_eager")
        return model

    eager = loss_and_grads(make(False), x, routes)
    # config.patch, not monkeypatch: monkeypatch's undo deletes the attribute from dynamo's config
    # module (it reads as absent from the instance), and every later compile in the process fails.
    with torch._dynamo.config.patch(capture_scalar_outputs=False):
        logp, loss, grads = loss_and_grads(make(True), x, routes)
    assert_same((logp, loss, {k.replace("_orig_mod.", ""): g for k, g in grads.items()}), eager, 1e-5, 1e-6)
