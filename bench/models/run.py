"""GLM-5 and Nemotron-3 on one GPU: engine/trainer mismatch with and without Router Replay, a
trainer step's MFU, and W1-style decode against the memory roofline, in one process, one JSON.

    bash bench/models/run_gpu.sh                                   # device: one H100, ~6-8 min
    python3 bench/models/run.py --out $OUT/models.json             # the same, without the wrapper
    .venv/bin/python bench/models/run.py --smoke --out /tmp/m.json # CPU, tiny shapes, ~1 min

Shapes: full width, reduced depth (bench/r3/replay.py glm5_reduced, nemotron3_reduced):
  - GLM-5 (configs/models/glm5.toml: MLA, DSA indexer keeping 2048 keys, sigmoid-routed MoE
    with a correction bias and a shared expert, vocabulary 154880): one dense layer, then MoE
    layers with --experts of the 256 routed experts (top-8 kept; default 32, what one GPU of an
    EP=8 group holds: the same tokens per expert as the full model there; the MFU phase's own
    shape: --mfu-layers 2, --mfu-experts 16, EP=16's share, what fits float32 AdamW);
  - Nemotron-3 Nano (configs/models/nemotron3.toml: Mamba-2, attention, all 128 squared-ReLU
    experts top-6 + a shared one, vocabulary 131072), layers --pattern (default "MEM*EM").

Phases (each in its own try/except; the JSON is rewritten after every one; a phase that the
memory arithmetic says would not fit is refused with the numbers, not run):
  mismatch/<shape>  bench/r3/replay.py phase_bf16: the trainer's model (transformers' init,
                    float32) published as version 0, our bf16 engine samples --new-tokens per
                    prompt at T=1 with routed experts recorded, the one-GPU trainer (float32
                    weights under autocast bf16) scores the samples with Router Replay off (the
                    baseline) and on: k3 KL over the sampled tokens. GLM-5's prompts are longer
                    than index_topk, so every sampled token's attention is sparse on both sides.
  decode/<shape>    on the same loaded engine: W1 (bench/engine/w1.py: 256 prompts of 100-1024
                    tokens, 512 new tokens each, EOS ignored, T=1) output tokens/s against the
                    memory roofline: every decode step reads the weights once (the routed experts
                    a step's batch touches, expected under uniform routing; the input embedding
                    only by row, so not counted), every running sequence's KV pages (the
                    engine's layout, KVCache.bytes_per_block_for) and, for Mamba-2 layers, its
                    state read and written back (StateCache.slot_bytes), at the device copy
                    bandwidth measured in this process.
  mfu/glm5          one trainer step (bench/trainer/step.py build_ours/our_step: forward, log-probs,
                    ratio loss, backward, clip, fused AdamW; trainer.fsdp "auto" = the one-GPU
                    trainer, float32 master weights under autocast bf16) on --mfu-rows rows of 2048
                    tokens (at most index_topk: attention is dense MLA; longer rows take the
                    trainer's CPU-reference sparse path), micro-batches of --mfu-mb-rows rows.
                    MFU = model FLOPs (6 x matmul parameters a token passes through x tokens +
                    causal attention, no recompute) / median step time / the card's dense bf16
                    peak (PEAK_BF16 by device name).
  fp32_sanity/<shape>  float32 engine and trainer on configs/models/debug-<arch>: replay on must
                    agree on every expert set and leave only float32 rounding (KL < 1e-6).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.engine import w1  # noqa: E402
from bench.machine import machine  # noqa: E402
from bench.r3 import replay as r3  # noqa: E402  (installs the carried wheels when missing)
from bench.results import write_result  # noqa: E402
from services.common.config import ModelConfig  # noqa: E402
from services.engine.kv_cache import KVCache  # noqa: E402
from services.engine.state_cache import StateCache  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_trainer_step", REPO / "bench" / "trainer" / "step.py")
assert _spec is not None and _spec.loader is not None
step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step)

GOALS = {"mismatch_kl_max": 1e-3, "replay_ratio_min": 5.0, "mfu_min": 0.35, "roofline_fraction_min": 0.5}
# Dense bf16 tensor-core peak FLOP/s by device name (no sparsity); the first match wins.
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12)]
# The MFU shape's routed experts: one GPU's share of GLM-5's 256 under EP=16. With T tokens a GPU,
# each expert of an EP group of G GPUs receives G*T*8/256 picks on average, as each of 256/G experts
# does from a top-8 router on one GPU alone: the same grouped-GEMM shapes. (32, EP=8's share, plans 71.6 GiB with 2-row
# micro-batches, at the 92% line of an 80 GB card; 66.9 GiB with --mfu-mb-rows 1.)
MFU_EXPERTS = 16
MEM_HEADROOM = 0.92  # of the card's memory a phase may plan to use (allocator slack, CUDA context)
GIB = 2**30


def peak_bf16(name: str) -> float | None:
    return next((flops for key, flops in PEAK_BF16 if key in name), None)


# ------------------------------------------------------------------ memory arithmetic


def check_fits(need: dict[str, float], total: float | None) -> dict[str, Any]:
    """The plan's bytes against the card's; raises (the phase is refused) if over MEM_HEADROOM."""
    planned = sum(need.values())
    out: dict[str, Any] = {k: round(v / GIB, 2) for k, v in need.items()}
    out["planned_gib"] = round(planned / GIB, 2)
    if total is not None:
        out["device_gib"] = round(total / GIB, 2)
        if planned > MEM_HEADROOM * total:
            raise MemoryError(
                f"refused: planned {planned / GIB:.1f} GiB > {MEM_HEADROOM:.0%} of the card's "
                f"{total / GIB:.1f} GiB ({json.dumps(out)}); lower --layers/--experts (or --mfu-mb-rows)"
            )
    return out


def mismatch_memory(
    m: ModelConfig, args: argparse.Namespace, r3_args: argparse.Namespace
) -> dict[str, float]:
    """Bytes the mismatch + decode phase holds at its peak: the trainer's float32 model stays on the
    card while the bf16 engine runs, and under autocast the scoring keeps bf16 copies of the
    weights (the engine is gone by then; its 2 bytes per parameter are the same size)."""
    p = m.param_counts()["total"]
    seqs = max(r3_args.prompts, args.w1_prompts)
    ctx = max(r3_args.prompt_max + r3_args.new_tokens + 16, args.w1_max_prompt + args.w1_new_tokens)
    bf16 = torch.bfloat16
    kv = KVCache.bytes_per_block_for(m, 1, bf16) * seqs * ctx + StateCache.bytes_for(m, seqs, bf16)
    chunk = r3_args.chunk or r3_args.micro_batch_tokens
    sampling_ctx = r3_args.prompt_max + r3_args.new_tokens
    return {
        "trainer_fp32_weights": 4.0 * p,
        "engine_bf16_weights_or_autocast_copies": 2.0 * p,
        "engine_kv_and_state": float(kv),
        # float32 logits and log-softmax of one scoring chunk, and an activation allowance
        "activations": 2.0 * chunk * m.vocab_size * 4 + 4 * GIB,
        "engine_mla_sampling_transient": mla_decode_transient(
            m, r3_args.prompts, sampling_ctx, args.mla_backend_used
        ),
    }


def mfu_memory(m: ModelConfig, mb_tokens: int, chunk: int, head_cache_gib: float) -> dict[str, float]:
    """Bytes of one GPU's training step: float32 weights, gradients and AdamW's two moments for
    every trained parameter (the frozen DSA indexer has weights only), autocast's bf16 weight
    copies saved for backward, one micro-batch's saved activations (no activation checkpointing;
    per token and layer, bf16, x1.5 for what is not itemised) and the chunked LM head: one
    chunk's float32 logits and probabilities, the probabilities of the micro-batch's other chunks
    kept for backward up to head_cache_gib."""
    total = m.param_counts()["total"]
    d, h = m.dim, m.n_heads
    indexer = (m.q_lora_rank or d) * m.index_n_heads * m.index_head_dim + d * (
        m.index_head_dim + m.index_n_heads
    )
    frozen = m.n_layers * indexer if m.index_topk else 0
    attn = (
        d
        + m.q_lora_rank
        + m.kv_lora_rank
        + m.qk_rope_head_dim
        + h * (2 * m.head_dim + m.qk_nope_head_dim + 3 * m.v_head_dim)
    )
    moe = m.n_experts_per_tok * (d + 3 * m.moe_hidden_dim) + m.n_shared_experts * (d + 3 * m.moe_hidden_dim)
    dense = d + 3 * m.hidden_dim
    per_token = sum(attn + 4 * d + (dense if i < m.first_k_dense else moe) for i in range(m.n_layers))
    live = min(chunk, mb_tokens)
    head = 2.0 * live * m.vocab_size * 4 + min(head_cache_gib * GIB, (mb_tokens - live) * m.vocab_size * 4.0)
    return {
        "weights_grads_adamw_fp32": 16.0 * (total - frozen) + 4.0 * frozen,
        "autocast_bf16_weight_copies": 2.0 * total,
        "activations_one_micro_batch": 1.5 * 2 * per_token * mb_tokens,
        "head_logits_and_cache": head,
    }


# ------------------------------------------------------------------ FLOPs


def glm5_step_flops(m: ModelConfig, rows: list[int]) -> dict[str, float]:
    """Model FLOPs of one training step over `rows` (tokens per row, each its own sequence): 6 x
    (matmul parameters a token passes through: attention, the dense FFN or the router, top-k and
    shared experts, the LM head; not the input embedding, the norms, nor the DSA indexer, which
    does not run while a row is at most index_topk long) x tokens, plus causal attention
    3 x layers x heads x (qk + v head dims) x sum(row^2). Recomputation is not counted."""
    if any(t > m.index_topk for t in rows):
        raise ValueError(f"rows must be <= index_topk ({m.index_topk}): the dense-attention path")
    d, n = m.dim, m.n_layers
    indexer = (m.q_lora_rank or d) * m.index_n_heads * m.index_head_dim + d * (
        m.index_head_dim + m.index_n_heads
    )
    norms = n * (2 * d + m.q_lora_rank + m.kv_lora_rank) + d
    matmul = m.param_counts()["active"] - m.vocab_size * d - norms - n * indexer
    tokens = sum(rows)
    linear = 6.0 * matmul * tokens
    attention = 3.0 * n * m.n_heads * (m.head_dim + m.v_head_dim) * sum(t * t for t in rows)
    head = 6.0 * m.vocab_size * d * tokens
    return {
        "matmul_params_per_token": float(matmul),
        "linear_flops": linear,
        "attention_flops": attention,
        "total_flops": linear + attention,
        "lm_head_share": head / (linear + attention),
    }


# ------------------------------------------------------------------ decode (W1 on a loaded engine)


def roofline_bytes(m: ModelConfig, batch: int) -> dict[str, Any]:
    """Bytes one decode step of `batch` sequences reads, by the bf16 weights' shapes: every
    weight but the input embedding, the routed experts only as many as `batch` sequences touch
    under uniform routing (E (1 - (1 - k/E)^batch) per MoE layer; 1 when batch*k >> E)."""
    pc = m.param_counts()
    per_expert = (2 if m.is_hybrid else 3) * m.dim * m.moe_hidden_dim
    moe_layers = len(m.moe_layers())
    routed = moe_layers * m.n_routed_experts * per_expert
    touched = 1.0 - (1.0 - m.n_experts_per_tok / m.n_routed_experts) ** batch if m.is_moe else 0.0
    item = 2  # bf16
    weight = (pc["total"] - m.vocab_size * m.dim - routed + touched * routed) * item
    return {
        "weight_bytes": int(weight),
        "routed_expert_bytes": routed * item,
        "experts_touched_fraction": round(touched, 6),
        "kv_bytes_per_token": KVCache.bytes_per_block_for(m, 1, torch.bfloat16),
        # a Mamba-2 state is read and written back every step
        "state_bytes_per_seq": 2 * StateCache.slot_bytes(m, torch.bfloat16),
    }


def mla_decode_transient(m: ModelConfig, batch: int, ctx: int, backend: str = "torch") -> float:
    """Bytes the engine's MLA decode step holds for one layer beyond its caches. The torch path
    (services/engine/layers/mla.py) runs SDPA over the gathered latents with one key head shared by
    all heads and a mask, which PyTorch's math kernel computes by expanding keys [c | k_pe] and
    values c to every head; plus the gathered context. The Triton path (kernels/mla_decode.py)
    reads the pool in place: the absorbed queries and outputs, the split partials, and with DSA
    the indexer's float32 scores and their int64 sort keys over the table width."""
    if not m.is_mla:
        return 0.0
    latent = m.kv_lora_rank + m.qk_rope_head_dim
    if backend == "triton":
        per_row = m.n_heads * (2 * latent + 3 * 4 * m.kv_lora_rank)  # q, out (bf16); partials (f32)
        return float(batch * per_row + (12.0 * batch * ctx if m.index_topk else 0.0))
    return 2.0 * batch * ctx * (m.n_heads * (latent + m.kv_lora_rank) + latent)


def decode_batch(m: ModelConfig, args: argparse.Namespace, resident: float, total: float | None) -> int:
    """The engine's batch for the W1 run: --w1-batch, else every prompt at once where the memory
    plan allows it, else the largest power of two that fits (the MLA decode's transient grows with
    the batch)."""
    if args.w1_batch:
        return args.w1_batch
    ctx = args.w1_max_prompt + args.w1_new_tokens
    b = args.w1_prompts
    backend = args.mla_backend_used
    while (
        total is not None
        and b > 1
        and resident + mla_decode_transient(m, b, ctx, backend) > MEM_HEADROOM * total
    ):
        b = 1 << ((b - 1).bit_length() - 1)  # the power of two below
    return b


def wave_roofline(
    m: ModelConfig, prompts: list[list[int]], new_tokens: int, batch: int, bw: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """w1.roofline over the prompts run `batch` at a time (in order, each wave decoding together:
    with fewer sequences a step, the weights are read for fewer tokens). Returns (roofline, the
    first wave's byte accounting)."""
    waves = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    time_s, accts = 0.0, []
    for wave in waves:
        acct = roofline_bytes(m, len(wave))
        r = w1.roofline(
            wave,
            new_tokens,
            acct["weight_bytes"],
            acct["kv_bytes_per_token"],
            bw,
            acct["state_bytes_per_seq"],
        )
        time_s += len(wave) * new_tokens / r["tok_s"]  # (decode_time_s is rounded to ms)
        accts.append(acct)
    out = {
        "bandwidth_bytes_s": bw,
        "batch": batch,
        "waves": len(waves),
        "weight_bytes": accts[0]["weight_bytes"],
        "kv_bytes_per_token": accts[0]["kv_bytes_per_token"],
        "state_bytes_per_seq": accts[0]["state_bytes_per_seq"],
        "decode_time_s": round(time_s, 6),
        "tok_s": round(len(prompts) * new_tokens / time_s, 1),
    }
    return out, accts[0]


def decode_w1(
    eng: Any, m: ModelConfig, args: argparse.Namespace, bw: float, bw_source: str, batch: int
) -> dict[str, Any]:
    """W1 on the loaded engine (at most `batch` sequences at once): warm-up, then every prompt to
    completion (w1.drive)."""
    prompts = w1.w1_prompts(
        args.w1_prompts, args.w1_min_prompt, args.w1_max_prompt, min(10000, m.vocab_size - 1)
    )
    eng.generate(w1.requests([p[:300] for p in prompts[: min(40, len(prompts))]], 8, 1.0))
    w1.sync()
    run = w1.drive(eng, w1.requests(prompts, args.w1_new_tokens, 1.0), args.w1_cap_s)
    roof, acct = wave_roofline(m, prompts, args.w1_new_tokens, batch, bw)
    roof["bandwidth_source"] = bw_source
    tps = run["output_tok_s"]
    return {
        "workload": {
            "prompts": len(prompts),
            "prompt_tokens": [args.w1_min_prompt, args.w1_max_prompt],
            "new_tokens": args.w1_new_tokens,
            "temperature": 1.0,
            "engine_batch": batch,
        },
        "engine": {"attention_backend": eng.attention_backend, "cuda_graphs": eng.graphs is not None},
        "w1": run,
        "bytes": acct,
        "roofline": roof,
        "fraction_of_roofline": round(tps / roof["tok_s"], 4) if roof["tok_s"] else None,
        "complete": not run["truncated_at_time_cap"],
    }


# ------------------------------------------------------------------ phases


def r3_args(args: argparse.Namespace, shape: str) -> argparse.Namespace:
    """bench/r3/replay.py's arguments for one shape (its defaults for it, then ours)."""
    argv = ["--out", os.devnull, "--device", args.device, "--shape", shape, "--no-fsdp"]
    if args.smoke:
        argv.append("--smoke")
    if shape == "glm5":
        argv += ["--layers", str(args.layers), "--experts", str(args.experts)]
    if shape == "nemotron3":
        argv += ["--pattern", args.pattern]
    # a chunked LM head in scoring: 154880 / 131072-entry vocabularies in float32
    argv += ["--chunk", str(args.chunk), "--seed", str(args.seed)]
    # the directory in bf16, as trainer/train.py publishes for bf16 engines
    argv += ["--publish-dtype", "engine"]
    if args.prompts is not None:
        argv += ["--prompts", str(args.prompts)]
    if args.new_tokens is not None:
        argv += ["--new-tokens", str(args.new_tokens)]
    return r3.parse_args(argv)


def phase_mismatch(
    args: argparse.Namespace,
    shape: str,
    device: torch.device,
    workdir: Path,
    env: dict[str, Any],
    on_decode: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """replay.phase_bf16 with decode_w1 on its loaded engine; the decode row (or its error) goes to
    `on_decode` as soon as it is measured, before the trainer scores."""
    ra = r3_args(args, shape)
    m = r3.bf16_shape(ra)
    plan = mismatch_memory(m, args, ra)
    memory = check_fits(plan, env.get("memory_bytes"))
    hook: Callable[[Any], dict[str, Any]] | None = None
    update: dict[str, Any] | None = None
    if args.decode:
        bw, source = env["bandwidth_bytes_s"], env["bandwidth_source"]
        # the W1 run's transient replaces the replay sampling's
        resident = sum(plan.values()) - plan["engine_mla_sampling_transient"]
        batch = decode_batch(m, args, resident, env.get("memory_bytes"))
        memory["decode_batch"] = batch
        memory["decode_mla_transient_gib"] = round(
            mla_decode_transient(m, batch, args.w1_max_prompt + args.w1_new_tokens, args.mla_backend_used)
            / GIB,
            2,
        )

        def hook(eng: Any) -> dict[str, Any]:
            t0 = time.monotonic()
            try:
                row = decode_w1(eng, m, args, bw, source, batch)
            except Exception:  # noqa: BLE001 - recorded; the mismatch phase goes on
                row = {"error": traceback.format_exc()}
            row["phase_s"] = round(time.monotonic() - t0, 1)
            on_decode(row)
            return {"recorded_as": f"decode phase of {shape}"}

        update = {
            "max_batch_size": max(ra.prompts, batch),
            "max_seq_len": max(ra.prompt_max + ra.new_tokens + 16, args.w1_max_prompt + args.w1_new_tokens),
        }
    if m.is_mla:  # (a fallback to torch after a failed mla_check concerns MLA only)
        update = {**(update or {}), "attention_backend": args.mla_backend}
    init = ra.inits.split(",")[0]
    row = r3.phase_bf16(ra, init, device, workdir, with_engine=hook, engine_update=update)
    row["memory_plan"] = memory
    row["params"] = m.param_counts()
    row["prompt_tokens_range"] = [ra.prompt_min, ra.prompt_max]
    row["new_tokens_per_prompt"] = ra.new_tokens
    return row


def phase_mla_check() -> dict[str, Any]:
    """bench/models/mla_check.py: the paged MLA kernels at GLM-5's width and the engine's Triton
    MLA backend (eager and graphs) against torch, compiled on this card."""
    from bench.models import mla_check

    with tempfile.TemporaryDirectory(prefix="mla-check-") as tmp:
        return mla_check.run_checks(Path(tmp), torch.device("cuda"))


def phase_mfu(args: argparse.Namespace, device: torch.device, env: dict[str, Any]) -> dict[str, Any]:
    """One-GPU trainer steps on the reduced GLM-5 shape (module docstring, mfu/glm5)."""
    from trainer.batch import loss_token_count, micro_batches

    if args.smoke:  # CPU: the GLM-5 structure at smoke size, rows at its index_topk
        m = r3.reshaped(
            r3.bf16_shape(r3_args(args, "smoke-glm5")), n_layers=2, first_k_dense=1, max_seq_len=256
        )
    else:
        m = r3.glm5_reduced(args.mfu_layers, args.mfu_experts)
    row_len = min(2048, m.index_topk)
    mb_tokens = args.mfu_mb_rows * row_len
    memory = check_fits(mfu_memory(m, mb_tokens, step.CHUNK, 12.0), env.get("memory_bytes"))
    ctx = step.Ctx(device.type)  # a 1-rank process group, as the trainer under torchrun has
    knobs: dict[str, Any] = {"fsdp": "auto"}  # no FSDP at world 1: the one-GPU trainer
    if device.type == "cuda":
        knobs["optimizer"] = "fused"  # the AdamW trainer/train.py builds on CUDA
    model, opt, deg, meshes = step.build_ours(m, knobs, ctx)
    samples = step.make_samples([row_len] * args.mfu_rows, m.vocab_size, seed=11)
    total = loss_token_count(samples)
    # rows of row_len + 1 tokens (inputs row_len): micro-batches of mfu_mb_rows padded rows
    mbs = micro_batches(samples, args.mfu_mb_rows * (row_len + 1))
    losses: list[float] = []

    def one() -> None:
        losses.append(step.our_step(model, opt, mbs, total, deg, meshes, ctx.device)[0])

    times = step.timed(one, args.mfu_steps)
    warm = sorted(times[2:] if len(times) > 3 else times[-1:])
    med = warm[len(warm) // 2]
    flops = glm5_step_flops(m, [row_len] * args.mfu_rows)
    peak = env.get("peak_bf16_flops")
    tokens = row_len * args.mfu_rows
    return {
        "model": m.model_dump(include=r3.SHAPE_FIELDS),
        "params": m.param_counts(),
        "memory_plan": memory,
        "knobs": knobs,
        "rows": args.mfu_rows,
        "row_tokens": row_len,
        "micro_batches": len(mbs),
        "tokens_per_step": tokens,
        "step_s": med,
        "step_times_s": [round(t, 4) for t in times],
        "tokens_per_s": tokens / med,
        "flops": flops,
        "achieved_flops_s": flops["total_flops"] / med,
        "peak_bf16_flops": peak,
        "mfu": flops["total_flops"] / med / peak if peak else None,
        "losses": losses[:3],
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / GIB, 2) if device.type == "cuda" else None,
    }


def environment(device: torch.device, smoke: bool) -> dict[str, Any]:
    """The card, its peak and the copy bandwidth the roofline uses, measured here."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = props.name
        bw, source = w1.measure_bandwidth(device), "measured device copy (bytes read + written) / s"
        return {
            "device_name": name,
            "memory_bytes": props.total_memory,
            "peak_bf16_flops": peak_bf16(name),
            "peak_source": "dense bf16 tensor-core peak of the named card (PEAK_BF16)",
            "bandwidth_bytes_s": bw,
            "bandwidth_source": source,
        }
    return {
        "device_name": "cpu",
        "memory_bytes": None,
        "peak_bf16_flops": None,
        "peak_source": "none on CPU: MFU not computed",
        "bandwidth_bytes_s": w1.NOMINAL_BW,
        "bandwidth_source": "nominal H200 copy bandwidth (CPU run: the fraction means nothing)",
    }


def summary(phases: dict[str, Any]) -> dict[str, Any]:
    """The acceptance numbers per shape, each beside its goal."""
    out: dict[str, Any] = {}
    for shape in ("glm5", "nemotron3"):
        row: dict[str, Any] = {}
        mm = phases.get(f"mismatch/{shape}", {}).get("autocast", {})
        if "replay_on" in mm:
            off, on = mm["replay_off"]["mismatch_kl_k3"], mm["replay_on"]["mismatch_kl_k3"]
            row.update(
                kl_replay_off=off,
                kl_replay_on=on,
                kl_ratio_off_on=mm["kl_ratio_off_on"],
                routing_agreement_off=mm["replay_off"]["routing_agreement_mean"],
                train_entropy_mean=mm["replay_off"]["train_entropy_mean"],
                kl_on_below_goal=on < GOALS["mismatch_kl_max"],
                kl_off_below_goal=off < GOALS["mismatch_kl_max"],
                replay_ratio_goal_met=mm["kl_ratio_off_on"] >= GOALS["replay_ratio_min"],
            )
        dec = phases.get(f"decode/{shape}", {})
        if "fraction_of_roofline" in dec:
            row.update(
                decode_tok_s=dec["w1"]["output_tok_s"],
                roofline_tok_s=dec["roofline"]["tok_s"],
                fraction_of_roofline=dec["fraction_of_roofline"],
                roofline_goal_met=(dec["fraction_of_roofline"] or 0) >= GOALS["roofline_fraction_min"],
            )
        san = phases.get(f"fp32_sanity/{shape}", {})
        if "sanity_ok" in san:
            row["fp32_sanity_ok"] = san["sanity_ok"]
        if row:
            out[shape] = row
    mfu = phases.get("mfu/glm5", {})
    if "step_s" in mfu:
        out.setdefault("glm5", {}).update(
            mfu=mfu["mfu"],
            mfu_goal_met=mfu["mfu"] >= GOALS["mfu_min"] if mfu["mfu"] is not None else None,
            train_tokens_per_s=mfu["tokens_per_s"],
        )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "models.json"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script end to end")
    ap.add_argument(
        "--only",
        default="",
        help="comma list of phase prefixes: mismatch (with its decode run), mfu, fp32_sanity",
    )
    ap.add_argument("--budget-s", type=float, default=450.0, help="phases not started once this is spent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=3, help="GLM-5 mismatch/decode: layers (1 dense + MoE)")
    ap.add_argument(
        "--experts", type=int, default=r3.GLM5_EXPERTS, help="GLM-5: routed experts per MoE layer"
    )
    ap.add_argument("--pattern", default=r3.NEMOTRON3_PATTERN, help="Nemotron-3: its layers (M, E, *)")
    ap.add_argument(
        "--prompts", type=int, default=None, help="mismatch prompts (replay.py's default per shape)"
    )
    ap.add_argument("--new-tokens", type=int, default=None, help="mismatch: sampled tokens per prompt")
    ap.add_argument("--chunk", type=int, default=2048, help="trainer.logprob_chunk_tokens when scoring")
    ap.add_argument("--no-decode", dest="decode", action="store_false", help="skip the W1 decode runs")
    ap.add_argument("--w1-prompts", type=int, default=None, help="default 256 (smoke 8)")
    ap.add_argument("--w1-min-prompt", type=int, default=None, help="default 100 (smoke 8)")
    ap.add_argument("--w1-max-prompt", type=int, default=None, help="default 1024 (smoke 24)")
    ap.add_argument("--w1-new-tokens", type=int, default=None, help="default 512 (smoke 8)")
    ap.add_argument("--w1-cap-s", type=float, default=60.0, help="cap on one W1 run")
    ap.add_argument(
        "--w1-batch",
        type=int,
        default=0,
        help="the engine's batch in the W1 run (0: every prompt, or what the memory plan allows)",
    )
    ap.add_argument(
        "--attention-backend",
        dest="mla_backend",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="the engine's attention backend (auto on CUDA: the Triton paged kernels, MLA's included,"
        " with CUDA graphs); auto falls back to torch for MLA if the mla_check phase fails",
    )
    ap.add_argument("--mfu-layers", type=int, default=2, help="GLM-5 MFU shape: layers (1 dense + MoE)")
    ap.add_argument(
        "--mfu-experts",
        type=int,
        default=MFU_EXPERTS,
        help="GLM-5 MFU shape: routed experts (16: one GPU's share under EP=16)",
    )
    ap.add_argument("--mfu-rows", type=int, default=None, help="rows per step (default 8; smoke 4)")
    ap.add_argument("--mfu-mb-rows", type=int, default=2, help="rows per micro-batch")
    ap.add_argument(
        "--mfu-steps", type=int, default=None, help="timed steps, median of the 3rd on (default 8)"
    )
    args = ap.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    # The MLA engines' backend as run (main: "triton" on CUDA unless asked or mla_check failed).
    args.mla_backend_used = "torch"
    defaults = (
        dict(w1_prompts=8, w1_min_prompt=8, w1_max_prompt=24, w1_new_tokens=8, mfu_rows=4, mfu_steps=3)
        if args.smoke
        else dict(
            w1_prompts=256, w1_min_prompt=100, w1_max_prompt=1024, w1_new_tokens=512, mfu_rows=8, mfu_steps=8
        )
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.w1_max_prompt < args.w1_min_prompt or min(args.w1_prompts, args.w1_new_tokens, args.mfu_rows) < 1:
        ap.error("--w1-*: prompts, new tokens >= 1 and max >= min prompt; --mfu-rows >= 1")
    if args.mfu_steps < 1 or args.mfu_mb_rows < 1:
        ap.error("--mfu-steps and --mfu-mb-rows must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = r3.bench_device(args.device)
    t_all = time.monotonic()
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *(sys.argv if argv is None else [__file__, *argv])]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "device": str(device),
        "args": vars(args),
        "goals": GOALS,
        "baselines": {
            "mismatch": "Router Replay off, same samples, same trainer process",
            "mfu": "environment.peak_bf16_flops of the card named in environment.device_name",
            "decode": "each decode row's roofline: bytes counted under bytes, at environment.bandwidth_bytes_s",
        },
        "phases": {},
    }

    def save() -> None:
        result["summary"] = summary(result["phases"])
        result["total_s"] = round(time.monotonic() - t_all, 1)
        write_result(args.out, result, default=str)

    def run(name: str, fn: Callable[[], Any]) -> Any:
        if args.only and not any(name.startswith(p) for p in args.only.split(",")):
            return None
        if time.monotonic() - t_all > args.budget_s:
            result["phases"][name] = {"skipped": f"time budget {args.budget_s}s spent"}
            save()
            return None
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception:  # noqa: BLE001 - one failed phase must not lose the others
            out = {"error": traceback.format_exc()}
        if isinstance(out, dict):
            out["phase_s"] = round(time.monotonic() - t0, 1)
            result["phases"][name] = out
        r3.free()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        save()
        print(f"[{time.monotonic() - t_all:6.0f}s] {name}: {json.dumps(out, default=str)[:800]}", flush=True)
        return out

    env = run("environment", lambda: environment(device, args.smoke)) or {}
    # The MLA decode kernels checked compiled before any phase times them (bench/models/mla_check.py);
    # if they fail, "auto" runs the MLA engines on the torch path and says so.
    args.mla_backend_used = "triton" if device.type == "cuda" and args.mla_backend != "torch" else "torch"
    if device.type == "cuda" and args.mla_backend != "torch":
        check = run("mla_check", phase_mla_check)
        if check is not None and not check.get("ok") and args.mla_backend == "auto":
            args.mla_backend = args.mla_backend_used = "torch"
            result["mla_backend_fallback"] = "mla_check failed: the MLA engines run attention_backend torch"
    result["mla_backend_used"] = args.mla_backend_used
    shapes = ("smoke-glm5", "smoke-nemotron") if args.smoke else ("glm5", "nemotron3")
    # The short MFU phase first: a budget the long mismatch phases overrun still leaves it measured.
    run("mfu/glm5", lambda: phase_mfu(args, device, env))
    with tempfile.TemporaryDirectory(prefix="models-") as tmp:
        for shape in shapes:
            key = "nemotron3" if "nemotron" in shape else "glm5"

            def decoded(row: dict[str, Any], shape: str = shape, key: str = key) -> None:
                row["shape"] = shape
                result["phases"][f"decode/{key}"] = row
                save()  # before the trainer scores: a cut-short run keeps it

            def mismatch(shape: str = shape, decoded: Callable[..., None] = decoded) -> dict[str, Any]:
                return phase_mismatch(args, shape, device, Path(tmp), env, decoded)

            run(f"mismatch/{key}", mismatch)
            for d in Path(tmp).iterdir():  # each model directory is GBs at full width
                shutil.rmtree(d, ignore_errors=True)
        for shape in shapes:
            key = "nemotron3" if "nemotron" in shape else "glm5"
            run(
                f"fp32_sanity/{key}",
                lambda shape=shape: r3.phase_fp32_sanity(r3_args(args, shape), device, Path(tmp)),
            )
    save()
    print("summary", json.dumps(result["summary"], indent=1, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
