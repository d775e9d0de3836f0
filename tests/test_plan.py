"""The capacity plan (sbatch/plan.py): its arithmetic by hand-computed numbers, its rates read from
their result files, and the `make plan` command on the shipped configs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sbatch import plan as P
from services.common.config import load_config

REPO = Path(__file__).resolve().parent.parent


def _rate(tmp: Path, name: str, value: float) -> dict:
    (tmp / f"{name}.json").write_text(json.dumps({"v": value}))
    return {"unit": "u", "machine": "m", "file": f"{name}.json", "key": "v"}


@pytest.fixture
def rates(tmp_path: Path) -> P.Rates:
    """Round numbers, so every expected value below is computed by hand."""
    table = {
        "copy_bytes_per_s_h100": _rate(tmp_path, "bw100", 2e12),
        "copy_bytes_per_s_h200": _rate(tmp_path, "bw200", 4e12),
        "decode_hbm_fraction": _rate(tmp_path, "dec", 0.5),
        "prefill_mfu": _rate(tmp_path, "pre", 0.5),
        "train_mfu_dense": _rate(tmp_path, "mfu", 0.4),
        "train_mfu_moe": _rate(tmp_path, "mfu_moe", 0.25),
        "publish_bytes_per_s": _rate(tmp_path, "pub", 1e10),
        "apply_bytes_per_s": _rate(tmp_path, "apply", 5e9),
        "cpu_decode_step_s": _rate(tmp_path, "cpu_dec", 0.05),
        "cpu_train_s_per_token": _rate(tmp_path, "cpu_tr", 1e-4),
        "cpu_orchestrator_s_per_rollout": _rate(tmp_path, "cpu_orch", 1e-3),
        "cpu_sandbox_s_per_rollout": _rate(tmp_path, "cpu_sb", 1e-3),
        "all_to_all_bytes_per_s": _rate(tmp_path, "a2a", 1e6),
    }
    path = tmp_path / "rates.toml"
    lines = []
    for name, entry in table.items():
        lines.append(f"[{name}]")
        lines += [f'{k} = "{v}"' for k, v in entry.items()]
    path.write_text("\n".join(lines) + "\n")
    return P.load_rates(path, root=tmp_path)


def _small_gpu_cfg(**over: str):
    # A dense model whose parameter count is easy to write down: no norms on q/k, untied
    # embeddings; 2 trainer nodes, 1 decode node, no prefill nodes, 1 GPU per node.
    args = [
        "--slurm.launcher=slurm",
        "--decode.engine.device=cuda",
        "--decode.engine.dtype=bfloat16",
        "--decode.engine.max_batch_size=4",
        "--model.vocab_size=1000",
        "--model.dim=100",
        "--model.n_layers=2",
        "--model.n_heads=2",
        "--model.n_kv_heads=1",
        "--model.head_dim=50",
        "--model.hidden_dim=400",
        "--model.max_seq_len=1000",
        "--model.qk_norm=false",
        "--model.tie_embeddings=false",
        "--orchestrator.batch_size=2",
        "--orchestrator.group_size=4",
        "--slurm.trainer.nodes=2",
        "--slurm.trainer.gpus_per_node=1",
        "--slurm.decode.nodes=1",
        "--slurm.decode.gpus_per_node=1",
        "--plan.gpu=h100",
        "--plan.rollout_tokens=200",
        "--plan.generated_tokens=100",
        "--plan.tail_factor=3",
        "--trainer.micro_batch_tokens=1000",
    ] + [f"--{k}={v}" for k, v in over.items()]
    return load_config("debug", args)


def test_rates_are_read_from_their_files(rates: P.Rates) -> None:
    assert rates.decode_hbm_fraction.value == 0.5
    assert rates.publish_bytes_per_s.value == 1e10


def test_rate_with_divisor_and_missing_key(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text(json.dumps({"a": {"bytes": 100.0, "s": 4.0}}))
    r = P.Rate(unit="u", machine="m", file="r.json", key="a.bytes", per="a.s", scale=0.5)
    assert r.from_file(tmp_path) == 12.5
    bad = tmp_path / "bad.toml"
    bad.write_text('[prefill_mfu]\nunit = "u"\nmachine = "m"\nfile = "r.json"\nkey = "a.missing"\n')
    with pytest.raises(ValueError, match="rate prefill_mfu: cannot read a.missing from r.json"):
        P.load_rates(bad, root=tmp_path)


def test_shipped_rates_read_from_bench_results() -> None:
    assert P.RATES_FILE == REPO / "configs" / "plan" / "rates.toml"
    rates = P.load_rates()
    for name, rate in rates:
        if rate is None:
            continue
        assert (REPO / rate.file).is_file(), f"{name}: {rate.file}"
        assert rate.value > 0, name


def test_dense_gpu_arithmetic_by_hand(rates: P.Rates) -> None:
    cfg = _small_gpu_cfg()
    m = cfg.model
    # attention: q 100x100, k and v 100x50 each, o 100x100 = 30,000; FFN 3 x 100 x 400 = 120,000;
    # norms 2 x 100; per layer 150,200; embeddings 2 x 1000 x 100 + final norm 100 = 200,100.
    p = m.param_counts()
    assert p["total"] == 2 * 150_200 + 200_100 == 500_500
    # Decode reads every weight but the input embedding: 500,500 - 100,000 = 400,500 params, bf16.
    weights = 400_500 * 2
    # KV: K and V, 1 head x 50 dims, bf16, 2 layers = 400 bytes a token; mean context 200 / 2 = 100.
    assert P.kv_bytes_per_token(m) == 400
    step_bytes = weights + 4 * 100 * 400
    assert P.decode_step_bytes(m, 4, 100, 2.0) == step_bytes
    t_step = step_bytes / (0.5 * 2e12 * 1)
    split = P.Split(trainer_nodes=2, decode_nodes=1, prefill_nodes=0)
    dev = P.device_for(cfg, rates)
    t = P.step_times_gpu(cfg, split, dev, rates)
    # 8 rollouts x 100 generated tokens over one engine of batch 4.
    assert t.decode_s == pytest.approx(800 / 4 * t_step)
    # Tail: 3 x 100 = 300 tokens, under the context cap 1000 x 100 / 200 = 500.
    assert t.tail_s == pytest.approx(300 * t_step)
    # Prefill colocated on the decode GPU: 8 x 100 new prompt tokens, each 2 x 500,500 FLOPs plus
    # attention over a mean 50 keys: 2 x 50 x (2 heads x 100) x 2 layers = 40,000.
    pre = 800 * (2 * 500_500 + 40_000)
    assert t.prefill_s == pytest.approx(pre / (0.5 * 989e12 * 1))
    assert t.rollout_s == pytest.approx(t.decode_s + t.prefill_s)
    # Train: 1,600 tokens x (6 x 500,500 + 3 x attention at context 100 = 3 x 80,000), over 2 GPUs.
    train = 1600 * (6 * 500_500 + 3 * 80_000)
    assert t.train_s == pytest.approx(train / (0.4 * 989e12 * 2))
    # Publish: 500,500 x 2 bytes over 2 ranks at 1e10 B/s; apply: all of it on the one GPU at 5e9.
    assert t.publish_blocked_s == pytest.approx(500_500 * 2 / 2 / 1e10)
    assert t.apply_s == pytest.approx(500_500 * 2 / 5e9)
    infer, trainer = t.rollout_s + t.apply_s, t.train_s + t.publish_blocked_s
    assert t.step_async_s == pytest.approx(max(infer, trainer))
    assert t.step_sync_s == pytest.approx(max(t.rollout_s, t.tail_s) + t.apply_s + trainer)
    assert t.trainer_wait_s == pytest.approx(t.step_async_s - trainer)
    assert t.inference_wait_s == pytest.approx(t.step_async_s - infer)


def _small_moe_cfg(**over: str):
    # debug-moe (2 MoE layers, dim 64, top-2 of 8) on GPUs: one decode engine of 2 ranks
    # (data-parallel attention, EP 2), prefill on the decode GPUs, the trainer EP 2 over 2 GPUs.
    args = [
        "--slurm.launcher=slurm",
        "--decode.engine.device=cuda",
        "--decode.engine.dtype=bfloat16",
        "--decode.engine.max_batch_size=4",
        "--decode.parallel.dp_attention=2",
        "--decode.parallel.ep=2",
        "--orchestrator.batch_size=2",
        "--orchestrator.group_size=4",
        "--slurm.trainer.nodes=1",
        "--slurm.trainer.gpus_per_node=2",
        "--slurm.decode.nodes=1",
        "--slurm.decode.gpus_per_node=2",
        "--trainer.nproc=2",
        "--trainer.ep=2",
        "--trainer.dtype=bfloat16",
        "--plan.gpu=h100",
        "--plan.rollout_tokens=200",
        "--plan.generated_tokens=100",
        "--plan.nic_gb_per_s=0.0001",
    ] + [f"--{k}={v}" for k, v in over.items()]
    return load_config("debug-moe", args)


def test_all_to_all_by_hand(rates: P.Rates) -> None:
    """Every MoE layer's dispatch and combine: a rank sends tokens x top-2 rows of 64 bf16 values,
    half of them to the other rank of its EP 2 group; within a node at the measured 1e6 B/s,
    across nodes at plan.nic_gb_per_s (1e5 B/s)."""
    cfg = _small_moe_cfg()
    m = cfg.model
    assert (len(m.moe_layers()), m.n_experts_per_tok, m.dim) == (2, 2, 64)
    dev = P.device_for(cfg, rates)
    split = P.Split(trainer_nodes=1, decode_nodes=1, prefill_nodes=0)
    t = P.step_times_gpu(cfg, split, dev, rates)
    # Decode: batch 4 over 2 ranks = 2 tokens a rank; 2 x 2 x 64 x 2 = 512 bytes of rows, 256
    # leave; 2 layers x 2 exchanges x 256 B / 1e6 B/s a step, over 8 x 100 / 4 = 200 steps.
    a2a_step = 2 * 2 * 256 / 1e6
    assert t.all_to_all_decode_s == pytest.approx(200 * a2a_step)
    step_bytes = P.decode_step_bytes_per_rank(m, cfg.decode.parallel, 4, 100, 2.0)
    assert t.decode_s == pytest.approx(200 * (step_bytes / (0.5 * 2e12) + a2a_step))
    assert t.tail_s == pytest.approx(P.tail_generated(cfg) * (step_bytes / (0.5 * 2e12) + a2a_step))
    # Prefill on the decode GPUs: 8 x 100 prompt tokens over 2 ranks = 400 a rank; 400 x 2 x 64 x 2
    # = 102,400 bytes, half leave, 2 layers x 2 exchanges.
    assert t.all_to_all_prefill_s == pytest.approx(2 * 2 * 51_200 / 1e6)
    # Trainer: 1,600 tokens over 2 GPUs = 800 a rank, 102,400 bytes leave an exchange; forward
    # dispatch + combine and their backward: 4 a layer.
    assert t.all_to_all_train_s == pytest.approx(2 * 4 * 102_400 / 1e6)
    full = P.step_times_gpu(_small_moe_cfg(**{"trainer.activation_checkpoint": "full"}), split, dev, rates)
    assert full.all_to_all_train_s == pytest.approx(2 * 6 * 102_400 / 1e6)  # the recompute's forward
    # One GPU a node: the one decode engine's 2 ranks on 2 nodes, every leaving row over the network.
    two = _small_moe_cfg(**{"slurm.decode.gpus_per_node": "1", "slurm.decode.nodes": "2"})
    t2 = P.step_times_gpu(two, P.Split(trainer_nodes=1, decode_nodes=2, prefill_nodes=0), dev, rates)
    assert t2.all_to_all_decode_s == pytest.approx(200 * 2 * 2 * 256 / 1e5)
    # Without a measured rate, NVLink's datasheet rate within a node, said as an assumption.
    bare = rates.model_copy(update={"all_to_all_bytes_per_s": None})
    t3 = P.step_times_gpu(cfg, split, dev, bare)
    assert t3.all_to_all_train_s == pytest.approx(2 * 4 * 102_400 / 450e9)
    plan = P.build_plan(cfg, bare, split, balance=False)
    assert plan.rates_used["all_to_all_bytes_per_s"].startswith("NOT MEASURED")
    assert "450 GB/s" in plan.assumptions["all_to_all_intra_node"]
    assert "not measured" in plan.assumptions["all_to_all_inter_node"]
    assert "expert-parallel all-to-all" in P.render(plan)
    # A measured rate is cited with its file.
    plan = P.build_plan(cfg, rates, split, balance=False)
    assert plan.rates_used["all_to_all_bytes_per_s"].endswith("a2a.json)")
    assert "all_to_all_intra_node" not in plan.assumptions
    # No expert parallelism anywhere: no all-to-all.
    dense_ep = _small_moe_cfg(
        **{
            "decode.parallel.dp_attention": "1",
            "decode.parallel.ep": "1",
            "decode.replicas": "2",
            "trainer.ep": "1",
        }
    )
    t4 = P.step_times_gpu(dense_ep, split, dev, rates)
    assert t4.all_to_all_decode_s == t4.all_to_all_prefill_s == t4.all_to_all_train_s == 0


def test_memory_by_hand(rates: P.Rates) -> None:
    cfg = _small_gpu_cfg()
    dev = P.device_for(cfg, rates)
    mem = P.memory(cfg, P.Split(trainer_nodes=2, decode_nodes=1, prefill_nodes=0), dev)
    assert mem.trainer_state_gb == pytest.approx(500_500 * 16 / 2 / 1e9)
    # 1,000 tokens x 100 dims x 2 bytes x 2 layers saved, + 1,000 x 100 x 34 recompute.
    assert mem.trainer_activations_gb == pytest.approx((1000 * 100 * 2 * 2 + 1000 * 100 * 34) / 1e9)
    assert mem.inference_weights_gb == pytest.approx(500_500 * 2 / 1e9)
    assert mem.inference_kv_gb == pytest.approx(4 * 100 * 400 / 1e9)
    assert mem.trainer_fits and mem.inference_fits


def test_moe_experts_touched() -> None:
    cfg = load_config("debug-moe")
    m = cfg.model
    k, e = m.n_experts_per_tok, m.n_routed_experts
    assert P.experts_touched(m, 1) == pytest.approx(k)
    assert P.experts_touched(m, 3) == pytest.approx(e * (1 - (1 - k / e) ** 3))
    assert P.experts_touched(m, 10_000) == pytest.approx(e)


def test_mla_dsa_kv_reads() -> None:
    m = load_config("glm5").model
    # Latent 512 + rope key 64 in bf16, + the indexer's 128-byte fp8 key, per layer.
    assert P.kv_bytes_per_token(m) == (512 + 64) * 2 * 78 + 128 * 78
    # At 100k context a token reads its top-2048 latents and every indexer key.
    assert P.kv_bytes_read_per_token(m, 100_000) == (2048 * (512 + 64) * 2 + 100_000 * 128) * 78


def test_cpu_plan_by_hand(rates: P.Rates) -> None:
    cfg = load_config(
        "debug", ["--plan.rollout_tokens=40", "--plan.generated_tokens=10", "--plan.tail_factor=1.5"]
    )
    t = P.step_times_cpu(cfg, rates, cores=8)
    # 512 rollouts in one wave (max_batch_size 512), one engine step per generated token; the
    # wave lasts as long as its longest rollout: 1.5 x 10 generated tokens.
    assert t.decode_s == pytest.approx(15 * 0.05)
    assert t.train_s == pytest.approx(512 * 40 * 1e-4)
    # 8 cores: the CPU-seconds (0.75 + 2.048 + 512 x 2e-3) / 8 = 0.478 s fit beside the sides
    assert t.step_async_s == pytest.approx(max(t.decode_s, t.train_s)) and t.bound_by == "train"
    # One core: every process shares it, and the step takes their CPU-seconds (3.822 s).
    t = P.step_times_cpu(cfg, rates, cores=1)
    assert t.step_async_s == pytest.approx(0.75 + 2.048 + 1.024) and t.bound_by == "cpu"
    assert t.trainer_wait_s == pytest.approx(t.step_async_s - 2.048)
    # Three waves (max_batch_size 200): 30 engine steps, more than the longest rollout's 15.
    t = P.step_times_cpu(
        load_config(
            "debug",
            [
                "--decode.engine.max_batch_size=200",
                "--plan.rollout_tokens=40",
                "--plan.generated_tokens=10",
                "--plan.tail_factor=1.5",
            ],
        ),
        rates,
    )
    assert t.decode_s == pytest.approx(30 * 0.05)


def test_balance_moves_nodes_to_the_slow_side(rates: P.Rates) -> None:
    # Generation-heavy: long rollouts, most of them generated; the balanced split gives decode
    # more nodes than the config's one of three, and never a split that is slower.
    cfg = _small_gpu_cfg(
        **{"plan.rollout_tokens": "1000", "plan.generated_tokens": "900", "slurm.trainer.nodes": "2"}
    )
    dev = P.device_for(cfg, rates)
    split = P.Split(trainer_nodes=2, decode_nodes=1, prefill_nodes=0)
    best, times = P.balance_split(cfg, rates, dev, split)
    assert best is not None and times is not None
    assert best.decode_nodes >= 2
    assert times.step_async_s <= P.step_times_gpu(cfg, split, dev, rates).step_async_s


def test_tail_is_capped_by_the_context() -> None:
    cfg = load_config("glm5")
    w = cfg.plan
    assert P.tail_generated(cfg) == min(
        w.generated_tokens * w.tail_factor, 131072 * w.generated_tokens / w.rollout_tokens
    )


def test_plan_generated_over_rollout_is_an_error_naming_the_key() -> None:
    with pytest.raises(Exception, match="plan.generated_tokens"):
        load_config("debug", ["--plan.generated_tokens=100", "--plan.rollout_tokens=10"])


def test_plan_counts_the_state_slots(rates: P.Rates) -> None:
    """nemotron3: every decode GPU holds max_batch_size Mamba-2 state slots and the padding slot
    (the engine's StateCache) beside its KV, and the KV room is what is left after weights and
    slots."""
    cfg = load_config("nemotron3")
    dev = P.device_for(cfg, rates)
    lay = P.engine_layout(cfg, "decode", dev)
    states = (64 + 1) * P.recurrent_state_bytes(cfg.model)
    assert states == pytest.approx(65 * 49e6, rel=0.02)  # ~49 MB a sequence, 23 Mamba-2 layers
    assert lay.state_gb == pytest.approx(states / 1e9)
    assert lay.kv_gb == pytest.approx(64 * 24000 * P.kv_bytes_per_token(cfg.model) / 1e9)
    room = (dev.hbm_bytes * P.HBM_USABLE - lay.weights_gb * 1e9 - states) / P.kv_bytes_per_token(cfg.model)
    assert lay.kv_room_tokens == int(room)
    plan = P.build_plan(cfg, rates, balance=False)
    mm = plan.memory
    assert mm.inference_state_gb == pytest.approx(states / 1e9)
    assert mm.inference_total_gb == pytest.approx(mm.inference_weights_gb + mm.inference_kv_gb + states / 1e9)
    assert f"Mamba-2 states {states / 1e9:.1f}" in P.render(plan)
    assert " + Mamba-2 states " in P.render_layout(lay, 8)[2]
    # Over tp 2 a rank holds half of each slot (its Mamba-2 heads' states).
    split = load_config("nemotron3", ["--decode.replicas=8", "--decode.parallel.tp=2"])
    assert P.engine_layout(split, "decode", dev).state_gb == pytest.approx(states / 2 / 1e9)
    # A model without Mamba-2 layers prints no state term.
    dense = P.build_plan(load_config("glm5"), rates, balance=False)
    assert dense.memory.inference_state_gb == 0 and "Mamba-2" not in P.render(dense)


@pytest.mark.parametrize("model", ["glm5", "debug"])
def test_make_plan_command(model: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sbatch.plan", model], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "asynchronous step" in out.stdout and "measured rates used:" in out.stdout
    for line in out.stdout.split("measured rates used:")[1].split("assumptions:")[0].strip().splitlines():
        assert "bench/" in line or "NOT MEASURED" in line, line
    if model == "glm5":
        assert "target 300 s" in out.stdout


def test_make_plan_nodes_and_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sbatch.plan", "glm5", "--nodes", "14", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    s = d["split"]
    assert s["trainer_nodes"] + s["decode_nodes"] + s["prefill_nodes"] == 14
    assert math.isfinite(d["times"]["step_async_s"])


def test_local_gpu_config_counts_the_processes(rates: P.Rates) -> None:
    """A local launcher on GPUs has no Slurm nodes: one GPU per trainer process and per engine rank."""
    cfg = load_config(
        "debug",
        ["--decode.engine.device=cuda", "--trainer.nproc=2", "--decode.replicas=3", "--prefill.replicas=1"],
    )
    split = P.Split(trainer_nodes=1, decode_nodes=1, prefill_nodes=0)
    assert P.gpu_counts(cfg, split) == (2, 3, 1)
    plan = P.build_plan(cfg, rates)
    assert plan.balanced is None and not plan.searched
    assert plan.times.train_s > 0 and plan.times.decode_s > 0


def test_weights_traffic_by_hand() -> None:
    """One version through the shared filesystem: written once, read by every engine. bf16: 2
    bytes a parameter; FP8: 1 byte a linear weight + a float32 scale per 128x128 tile, 2 bytes for
    the embedding, LM head and norms (the dense model of _small_gpu_cfg: 500,500 parameters, of
    which 2 x 100,000 embedding/head and 2 x 2 x 100 + 100 norms)."""
    cfg = _small_gpu_cfg(**{"plan.step_target_s": "200", "slurm.prefill.gpus_per_node": "1"})
    m = cfg.model
    assert P.version_bytes(m, "none") == 500_500 * 2
    high = 200_000 + 500
    assert P.version_bytes(m, "fp8") == pytest.approx((500_500 - high) * (1 + 4 / 16384) + 2 * high)
    split = P.Split(trainer_nodes=2, decode_nodes=1, prefill_nodes=1)
    w = P.weights_traffic(cfg, split)
    v = 500_500 * 2
    assert w.version_gb == pytest.approx(v / 1e9) and w.engines == 2  # one decode + one prefill engine
    assert w.trainer_rank_gb == pytest.approx(v / 2 / 1e9) and w.inference_rank_gb == pytest.approx(v / 1e9)
    assert w.write_gb == pytest.approx(v / 1e9) and w.read_gb == pytest.approx(2 * v / 1e9)
    # 10% of 200 s = 20 s for 3 x v bytes; then the write takes v / bw, each engine reads v in 2 v / bw.
    assert w.budget_s == 20 and w.fs_gb_per_s == pytest.approx(3 * v / 20 / 1e9)
    bw = 3 * v / 20
    assert w.trainer_node_gb_per_s == pytest.approx(v / 2 / (v / bw) / 1e9)
    assert w.inference_node_gb_per_s == pytest.approx(v / (2 * v / bw) / 1e9)


def test_glm5_weights_traffic() -> None:
    """configs/glm5.toml: an FP8 version of ~747 GB (the bf16 embedding, head, routers and MLA's
    kv_b_proj ~6 GB of it), 128 trainer GPUs writing ~5.8 GB each; 8-GPU engines (EP 8, attention
    data-parallel) whose GPUs read 1/8 of the experts and every dense weight, ~110 GB each; 12
    engines: ~9 TB through the filesystem a step, ~324 GB/s to fit 30 s."""
    cfg = load_config("glm5")
    split = P.Split(trainer_nodes=16, decode_nodes=8, prefill_nodes=4)
    w = P.weights_traffic(cfg, split)
    total = cfg.model.param_counts()["total"]
    assert total < w.version_gb * 1e9 < total * 1.01
    assert w.trainer_rank_gb == pytest.approx(w.version_gb / 128) and w.engines == 12
    par = cfg.decode.parallel
    assert (par.ep, par.tp) == (8, 1)
    routed = P.routed_expert_params(cfg.model)
    per_param = w.version_gb * 1e9 / total
    assert w.inference_rank_gb == pytest.approx((total - routed + routed / 8) * per_param / 1e9)
    assert 100 < w.inference_rank_gb < 120
    assert w.read_gb == pytest.approx(12 * w.version_gb) and w.budget_s == 30
    assert 300 < w.fs_gb_per_s < 350
    plan = P.build_plan(cfg, P.load_rates(), split, balance=False)
    assert plan.weights == w
    assert "weights per step (shared filesystem)" in P.render(plan)
