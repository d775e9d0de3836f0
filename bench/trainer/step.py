"""Trainer step benchmark on H200: our torchtitan path vs plain HF transformers + PyTorch.

    python3 bench/trainer/step.py --out $OUT/trainer.json                 # one GPU, < 8 min
    torchrun --standalone --nproc_per_node=2 bench/trainer/step.py ...    # see multi.sh

One RL step = forward -> per-token log-probs -> loss -> backward -> clip -> optimizer step, on
random weights of a Qwen3-0.6B / Qwen3-4B shape (vocabulary 151936, tied embeddings).

(a) baseline: HF transformers Qwen3ForCausalLM, bf16 weights, fused AdamW, SDPA, full logits
    + log_softmax in float32, gradient checkpointing for 4B (a plain HF
    training step, the reference MFU).
(b) ours: the functions trainer/train.py's train_step uses (trainer.parallel.parallelize:
    FSDP2 mixed precision bf16 / float32 master weights and reductions, AC, compile, attention
    kernel; trainer.attention micro_batch_attention + packed_logprobs with the chunked log-prob
    head; trainer.loss.ratio_loss; clip_grad_norm_; AdamW as the trainer builds it).
    One process runs in a 1-rank NCCL group. Variants without `+nofsdp`
    keep FSDP2 on it (trainer.fsdp = "always", what they measured); `+nofsdp` variants use the
    trainer's default "auto": no FSDP at world 1, float32 parameters under torch.autocast(bf16),
    which is what the trainer runs on one GPU (trainer.parallel.use_fsdp).

First a correctness check on a tiny shape: our bf16 path (sdpa / flex / varlen, packed documents)
against a float32 reference (no FSDP, dense document mask): loss and gradient norm must agree.

MFU = (6 * N * T + 6 * L * H * Q * sum_docs t^2) / step_s / 989e12 per GPU (N = parameters,
tied embedding once; the attention term is causal attention within each document; recompute
not counted), as the notes' baseline. Reported per variant: tokens/s, MFU, peak memory, step
times; and the time to publish 4B weights (gather blocking + background write).

Every variant is in try/except: a failure (OOM, a kernel missing) is recorded, the rest runs.
A time budget (--budget-s) skips what would not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _ensure_wheels() -> None:
    """The GPU machine lacks torchtitan/pydantic: install the carried .whl/ into /tmp/site once."""
    try:
        import pydantic  # noqa: F401
        import torchtitan  # noqa: F401
    except ImportError:
        whl = REPO / ".whl"
        site = Path("/tmp/site")
        if not site.exists():
            wheels = [str(p) for p in whl.glob("*.whl")]
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--target",
                str(site),
            ]
            subprocess.run([*cmd, *wheels], check=True)
        sys.path.insert(0, str(site))
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


_ensure_wheels()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.results import write_result  # noqa: E402
from bench.shapes import SHAPES, VOCAB  # noqa: E402
from services.common.config import ModelConfig, TrainerSection  # noqa: E402
from services.common.schemas import Sample  # noqa: E402
from trainer import parallel  # noqa: E402
from trainer.attention import micro_batch_attention, packed_logprobs  # noqa: E402
from trainer.batch import loss_token_count  # noqa: E402
from trainer.chunked import enable_chunked_output  # noqa: E402
from trainer.loss import ratio_loss  # noqa: E402
from trainer.master_weights import optimizer_params, sync_params  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.packing import PackedMicroBatch, pack  # noqa: E402
from trainer.parallel import Degrees, clip_grad_norm, cp_micro_batch, parallelize  # noqa: E402
from trainer.publish import Publisher  # noqa: E402

PEAK = 989e12  # H200 dense bf16 TFLOP/s
# name -> trainer knobs (+ "pack": packed mixed-length documents instead of one sequence)
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": dict(),
    "bf16+sac": dict(activation_checkpoint="selective"),
    "bf16+full_ac": dict(activation_checkpoint="full"),
    "bf16+compile": dict(compile=True),
    "bf16+sac+compile": dict(activation_checkpoint="selective", compile=True),
    "packed+sdpa(dense mask)": dict(pack=True),
    "packed+varlen": dict(pack=True, attention="varlen"),
    "packed+flex": dict(pack=True, attention="flex"),
    "packed+varlen+sac": dict(pack=True, attention="varlen", activation_checkpoint="selective"),
    "packed+varlen+sac+compile": dict(
        pack=True, attention="varlen", activation_checkpoint="selective", compile=True
    ),
    "packed+varlen+full_ac": dict(pack=True, attention="varlen", activation_checkpoint="full"),
    # MoE: trainer.moe_grouped_mm "off" = the per-expert loop (a host sync per layer),
    # "on" = torch._grouped_mm experts ("auto", the default, is "on" for bf16 on CUDA: a plain
    # "bf16+sac" is grouped). moe_sac_extra=False: SAC with torchtitan's Qwen3 save list only,
    # without trainer.parallel.MOE_SAC_SAVE_OPS (all-to-all, grouped GEMMs), to see what they buy.
    "bf16+sac+loop": dict(activation_checkpoint="selective", moe_grouped_mm="off"),
    "bf16+sac+grouped_mm": dict(activation_checkpoint="selective", moe_grouped_mm="on"),
    "bf16+sac_ttlist+grouped_mm": dict(
        activation_checkpoint="selective", moe_grouped_mm="on", moe_sac_extra=False
    ),
    "bf16+grouped_mm": dict(moe_grouped_mm="on"),
    "bf16+grouped_mm+fused_adam": dict(moe_grouped_mm="on", optimizer="fused"),
    "bf16+sac+grouped_mm+compile": dict(activation_checkpoint="selective", moe_grouped_mm="on", compile=True),
    "bf16+grouped_mm+compile+fused_adam": dict(moe_grouped_mm="on", compile=True, optimizer="fused"),
    # MFU: the SDPA kernel (trainer.sdpa_backend / sdpa_expand_kv), the chunked
    # log-prob head's compiled softmax math alone (compile_head: what trainer.compile adds to
    # the head on CUDA) and fused AdamW (optimizer="fused"; the trainer builds foreach).
    "bf16+cudnn": dict(sdpa_backend="cudnn"),
    "bf16+flash": dict(sdpa_backend="flash"),
    "bf16+cudnn+expand_kv": dict(sdpa_backend="cudnn", sdpa_expand_kv=True),
    "bf16+compile_head": dict(compile_head=True),
    "bf16+fused_adam": dict(optimizer="fused"),
    "bf16+compile+fused_adam": dict(compile=True, optimizer="fused"),
    "bf16+compile+cudnn+fused_adam": dict(compile=True, sdpa_backend="cudnn", optimizer="fused"),
    "bf16+compile+cudnn+expand_kv+fused_adam": dict(
        compile=True, sdpa_backend="cudnn", sdpa_expand_kv=True, optimizer="fused"
    ),
    "bf16+sac+compile+cudnn+fused_adam": dict(
        compile=True, activation_checkpoint="selective", sdpa_backend="cudnn", optimizer="fused"
    ),
    # World 1: trainer.fsdp = "auto" (the trainer's default) applies no FSDP on one rank:
    # float32 parameters, bf16 through autocast, no all-gather / reduce-scatter copies. Compare with
    # "bf16+compile" (FSDP2 on the 1-rank group, reshard_after_forward=False as apply_fsdp sets
    # for one rank). fused_adam: the AdamW the trainer builds on CUDA.
    "bf16+nofsdp": dict(fsdp="auto"),
    "bf16+compile+nofsdp": dict(compile=True, fsdp="auto"),
    "bf16+compile+nofsdp+fused_adam": dict(compile=True, fsdp="auto", optimizer="fused"),
    "bf16+compile+fused_adam+fsdp": dict(compile=True, optimizer="fused"),
    # trainer.fp8 (no compile: refused with fp8), against the same without compile.
    "bf16+fused_adam+fsdp": dict(optimizer="fused"),
    "fp8+fused_adam+fsdp": dict(fp8=True, optimizer="fused"),
    "fp8+fp8_backward+fused_adam+fsdp": dict(fp8=True, fp8_backward=True, optimizer="fused"),
    "fp8+compile+fused_adam+fsdp": dict(fp8=True, compile=True, optimizer="fused"),
    "bf16+sac+compile+fused_adam+fsdp": dict(
        activation_checkpoint="selective", compile=True, optimizer="fused"
    ),
    "fp8+sac+compile+fused_adam+fsdp": dict(
        fp8=True, activation_checkpoint="selective", compile=True, optimizer="fused"
    ),
    "bf16+grouped_mm+fused_adam+fsdp": dict(moe_grouped_mm="on", optimizer="fused"),
    "fp8+grouped_mm+fused_adam+fsdp": dict(fp8=True, moe_grouped_mm="on", optimizer="fused"),
    # trainer.fp8_backward off: every backward in bf16 (dense through the dequantised operands,
    # MoE experts recomputed, straight-through), against the default FP8 dgrads above.
    "fp8+grouped_mm+fused_adam+fsdp+bf16_backward": dict(
        fp8=True, fp8_backward=False, moe_grouped_mm="on", optimizer="fused"
    ),
    # World 1, trainer.fsdp = "master": bf16 parameters (no FSDP copies, no autocast casts), a
    # float32 master per parameter for AdamW, bf16 gradients accumulated into float32 main grads
    # (trainer/master_weights.py). Compare with bf16+compile+fused_adam+fsdp.
    "bf16+master": dict(fsdp="master"),
    "bf16+compile+master+fused_adam": dict(compile=True, fsdp="master", optimizer="fused"),
    # The LM head's logits rounded to bf16 (trainer.logits_fp32 = false):
    # what float32 logits (docs/replay.md) cost in step time.
    "bf16+compile+fused_adam+fsdp+bf16_logits": dict(compile=True, optimizer="fused", logits_fp32=False),
    # The chunked head recomputing its logits in the backward (trainer.head_cache_gib = 0, the
    # pre-issue-9 head); the variants without it keep the forward's probabilities (default 12 GiB).
    "bf16+compile+fused_adam+fsdp+head_recompute": dict(compile=True, optimizer="fused", head_cache_gib=0.0),
}
# Variants without an "fsdp" knob keep FSDP2 on a 1-rank group (what they always measured).
BENCH_FSDP_DEFAULT = "always"
BENCH_ONLY_KNOBS = ("pack", "moe_sac_extra", "compile_head", "optimizer")
DEFAULT_VARIANTS = {
    "0.6b": ["bf16", "bf16+sac", "bf16+compile", "packed+sdpa(dense mask)", "packed+varlen", "packed+flex"],
    "4b": ["bf16+sac", "bf16+full_ac", "bf16+sac+compile", "packed+varlen+sac"],
    "30b-a3b": ["bf16+sac+loop", "bf16+sac+grouped_mm"],
}
CHUNK = 4096  # trainer.logprob_chunk_tokens: 4096 x 151936 float32 logits = 2.5 GB per chunk


# ------------------------------------------------------------------ setup


class Ctx:
    def __init__(self, device: str) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.cuda = device == "cuda"
        self.device = torch.device("cuda", local) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        if "RANK" not in os.environ:  # one process: a 1-rank group, so FSDP2 (our bf16 path) applies
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if self.cuda:
            dist.init_process_group("nccl", device_id=self.device)
        else:  # --device cpu: a smoke run of this script's logic (tiny shape, sdpa only)
            dist.init_process_group("gloo")
        self.t0 = time.monotonic()

    @property
    def main(self) -> bool:
        return self.rank == 0


def model_config(shape: str, max_len: int) -> ModelConfig:
    kw: dict[str, Any] = {"tie_embeddings": True, **SHAPES[shape]}
    vocab = 512 if shape.startswith("tiny") else VOCAB
    return ModelConfig(vocab_size=vocab, max_seq_len=max_len, rope_theta=1e6, **kw)


def n_params(m: ModelConfig) -> int:
    """Parameters a token passes through (MoE: the router and its top-k experts only)."""
    ffn = (
        m.dim * m.n_routed_experts + m.n_experts_per_tok * 3 * m.dim * m.moe_hidden_dim
        if m.is_moe
        else 3 * m.dim * m.hidden_dim
    )
    per_layer = (
        m.dim * m.n_heads * m.head_dim * 2  # wq, wo
        + m.dim * m.n_kv_heads * m.head_dim * 2  # wk, wv
        + ffn
        + 2 * m.dim
        + 2 * m.head_dim
    )
    embed = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2)
    return embed + m.n_layers * per_layer + m.dim


def step_flops(m: ModelConfig, doc_lens: list[int]) -> float:
    t = sum(doc_lens)
    return 6.0 * n_params(m) * t + 6.0 * m.n_layers * m.n_heads * m.head_dim * sum(x * x for x in doc_lens)


def make_samples(lens: list[int], vocab: int, seed: int, jitter: float = 0.0) -> list[Sample]:
    """Samples whose packed inputs have exactly `lens` tokens each (len(tokens) = l + 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lens):
        toks = torch.randint(0, vocab, (n + 1,), generator=g).tolist()
        prompt = max(1, n // 10)  # prompt tokens: no loss
        out.append(
            Sample(
                rollout_id=f"s{seed}-{i}",
                tokens=toks,
                loss_mask=[0] * prompt + [1] * (n + 1 - prompt),
                # near the random model's own, so ratios are ~1 (exp(+-jitter))
                logprobs=(-math.log(vocab) + jitter * (2 * torch.rand(n + 1, generator=g) - 1)).tolist(),
                versions=[0] * (n + 1),
                reward=0.0,
                advantage=1.0 if i % 2 else -1.0,
            )
        )
    return out


def mixed_lengths(total: int, seed: int, lo: int = 256, hi: int = 4096) -> list[int]:
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(min(rng.randint(lo, hi), total - sum(lens)))
    return lens


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ------------------------------------------------------------------ our path


def build_ours(
    m: ModelConfig,
    knobs: dict[str, Any],
    ctx: Ctx,
    dtype: str = "bfloat16",
    cp: int = 1,
    ep: int = 1,
    tp: int = 1,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Degrees, dict[str, Any]]:
    trainer_knobs = {
        "fsdp": BENCH_FSDP_DEFAULT,
        **{k: v for k, v in knobs.items() if k not in BENCH_ONLY_KNOBS},
    }
    tc = TrainerSection(
        nproc=ctx.world,
        device="cuda" if ctx.cuda else "cpu",
        dtype=dtype,  # type: ignore[arg-type]
        cp=cp,
        ep=ep,
        tp=tp,
        logprob_chunk_tokens=CHUNK,
        packing=True,
        **trainer_knobs,
    )
    # The head's knobs as trainer/train.py passes them (logits_fp32 included).
    model = enable_chunked_output(
        build_model(m, seed=0, device=ctx.device, init_std=0.02), tc.logits_fp32, tc.head_cache_gib
    )
    if tc.fp8:  # as trainer/train.py: before parallelisation
        from trainer.fp8 import Fp8BlockwiseConverter

        Fp8BlockwiseConverter(fp8_dgrad=tc.fp8_backward, fp8_wgrad=tc.fp8_backward).convert(model)
    extra = set(parallel.MOE_SAC_SAVE_OPS)
    if knobs.get("moe_sac_extra") is False:
        parallel.MOE_SAC_SAVE_OPS.clear()  # read by parallelize's AC step; restored below
    try:
        model, deg, meshes = parallelize(model, tc, ctx.world, ctx.device, distributed=True)
    finally:
        parallel.MOE_SAC_SAVE_OPS.update(extra)
    if knobs.get("compile_head"):
        model.output.fused = True  # type: ignore[union-attr]
    # foreach (torch's default on CUDA, what these variants always measured) or fused AdamW
    # (optimizer="fused": what trainer/train.py builds on CUDA now).
    fused = {"fused": True} if knobs.get("optimizer") == "fused" else {}
    opt = torch.optim.AdamW(  # fsdp="master": the float32 masters, as train.py
        optimizer_params(model), lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay, **fused
    )
    # train_step's autocast (bf16 without FSDP), carried with the meshes to our_step.
    meshes = {**meshes, "amp": parallel.autocast_context(tc, ctx.device, deg.fsdp)}
    return model, opt, deg, meshes


def our_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    mbs: list[PackedMicroBatch],
    total_loss_tokens: int,
    deg: Degrees,
    meshes: dict[str, Any],
    device: torch.device,
) -> tuple[float, float]:
    """trainer/train.py train_step's compute, for pre-built micro-batches. Returns (loss, grad norm)."""
    scale = float(deg.dp * deg.cp)
    amp = meshes.get("amp") or contextlib.nullcontext()  # as train_step: forward under autocast
    opt.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    for mb in mbs:
        mb = mb.to(device)
        if deg.cp > 1:
            mb = cp_micro_batch(mb, meshes["cp"], deg.cp)
        with micro_batch_attention(model, mb):
            with amp:
                logp, ent = packed_logprobs(model, mb, CHUNK)
            loss, _ = ratio_loss(
                logp,
                mb.logp_infer,
                mb.advantages,
                mb.loss_mask,
                ratio_low=1e-30,  # nothing masked: every token's gradient is computed
                ratio_high=1e30,
                total_loss_tokens=total_loss_tokens,
            )
            (loss * scale).backward()
        loss_sum += loss.detach()
    norm = clip_grad_norm(model, 1e9, deg)  # as train_step (EP-aware; the masters' gradients)
    opt.step()
    sync_params(model)  # as train_step: master weights into the bf16 parameters
    full = getattr(norm, "full_tensor", None)
    gn = float((full() if callable(full) else norm).item())
    if dist.get_world_size() > 1:
        dist.all_reduce(loss_sum)
    return float(loss_sum.item()) / deg.tp, gn  # a tp group's ranks computed the same loss


def rank_data(
    lens_per_rank: list[list[int]], vocab: int, deg: Degrees, rank: int, seed: int
) -> tuple[list[Sample], int]:
    """Every data-parallel rank its own samples (cp ranks share theirs, as train_step splits);
    the normaliser is the loss-token count over all of them."""
    by_dp = [make_samples(lens, vocab, seed + i) for i, lens in enumerate(lens_per_rank)]
    return by_dp[deg.data_rank(rank)], sum(loss_token_count(s) for s in by_dp)


# ------------------------------------------------------------------ baseline (HF transformers)


def build_hf(
    m: ModelConfig, device: torch.device, ac: bool, fused: bool
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=m.vocab_size,
        hidden_size=m.dim,
        intermediate_size=m.hidden_dim,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_seq_len,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    if ac:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused)
    return model, opt


def hf_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, n_loss: int) -> float:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(input_ids=inputs, use_cache=False).logits
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - (-math.log(model.config.vocab_size)))
    loss = -(ratio).sum() / n_loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


# ------------------------------------------------------------------ timing


def timed(fn: Any, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        sync()
        dist.barrier()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return out


def summarise(times: list[float], flops: float, tokens: int, world: int) -> dict[str, Any]:
    warm = sorted(times[2:] if len(times) > 3 else times[-1:])
    med = warm[len(warm) // 2] if len(warm) % 2 else 0.5 * (warm[len(warm) // 2 - 1] + warm[len(warm) // 2])
    return {
        "step_s": med,
        "step_times_s": [round(t, 4) for t in times],
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / med,
        "tokens_per_s_per_gpu": tokens / med / world,
        "mfu": flops / med / (PEAK * world),
        "peak_mem_gib": peak_gib(),
    }


# ------------------------------------------------------------------ sections


def correctness(ctx: Ctx) -> dict[str, Any]:
    """Tiny shape, packed documents: our bf16 path (each kernel) vs a float32 dense-mask reference."""
    m = model_config("tiny", 1024)
    lens = [100, 37, 260, 120, 3, 211, 293]  # 1024 tokens in 7 documents
    samples = make_samples(lens, m.vocab_size, seed=7, jitter=0.3)  # a spread of ratios
    n = loss_token_count(samples)
    mb = pack(samples)
    # The reference: float32, no FSDP, the dense block-causal mask (DocumentSDPA).
    ref = enable_chunked_output(build_model(m, seed=0, device=ctx.device, init_std=0.02))
    ref_model, ref_deg, _ = parallelize(ref, TrainerSection(), 1, ctx.device, distributed=False)
    ref_opt = torch.optim.AdamW(ref_model.parameters())
    ref_loss, ref_gn = our_step(ref_model, ref_opt, [mb], n, ref_deg, {}, ctx.device)
    out: dict[str, Any] = {"reference_fp32": {"loss": ref_loss, "grad_norm": ref_gn}}
    # The same pack through each kernel, and the MFU knobs (forced cuDNN first with expanded
    # kv, the compiled log-prob head); "one_doc": a one-sample pack, the plain causal SDPA path.
    one = pack(make_samples([1023], m.vocab_size, seed=8, jitter=0.3))
    n_one = loss_token_count(make_samples([1023], m.vocab_size, seed=8, jitter=0.3))
    ref1 = enable_chunked_output(build_model(m, seed=0, device=ctx.device, init_std=0.02))
    ref1_model, _, _ = parallelize(ref1, TrainerSection(), 1, ctx.device, distributed=False)
    ref1_loss, ref1_gn = our_step(
        ref1_model, torch.optim.AdamW(ref1_model.parameters()), [one], n_one, ref_deg, {}, ctx.device
    )
    out["reference_fp32_one_doc"] = {"loss": ref1_loss, "grad_norm": ref1_gn}
    del ref1, ref1_model
    # (compile_head on the GPU only: the CPU smoke run would spend minutes in the C++ compiler)
    issue9 = {"sdpa_backend": "cudnn", "sdpa_expand_kv": True, "compile_head": ctx.cuda}
    checks: dict[str, tuple[dict[str, Any], PackedMicroBatch, int, float, float]] = {
        "bf16_sdpa": ({"attention": "sdpa"}, mb, n, ref_loss, ref_gn),
        "bf16_sdpa_nofsdp": ({"attention": "sdpa", "fsdp": "auto"}, mb, n, ref_loss, ref_gn),
        "bf16_sdpa_one_doc_cudnn_expand_kv_compile_head": (issue9, one, n_one, ref1_loss, ref1_gn),
    }
    if ctx.cuda:
        checks.update(
            bf16_flex=({"attention": "flex"}, mb, n, ref_loss, ref_gn),
            bf16_varlen=({"attention": "varlen"}, mb, n, ref_loss, ref_gn),
            bf16_sdpa_cudnn_expand_kv_compile_head=(issue9, mb, n, ref_loss, ref_gn),
            bf16_sdpa_one_doc_auto=({}, one, n_one, ref1_loss, ref1_gn),
        )
    for key, (knobs, batch, count, r_loss, r_gn) in checks.items():
        try:
            model, opt, deg, meshes = build_ours(m, knobs, ctx)
            loss, gn = our_step(model, opt, [batch], count, deg, meshes, ctx.device)
            ok = abs(loss - r_loss) <= 2e-2 * abs(r_loss) + 1e-3 and abs(gn - r_gn) <= 5e-2 * r_gn
            out[key] = {"knobs": knobs, "loss": loss, "grad_norm": gn, "agrees": ok}
            del model, opt
        except Exception as e:  # recorded, the benchmark goes on
            out[key] = {"knobs": knobs, "error": repr(e), "trace": traceback.format_exc()[-2000:]}
        free()
    return out


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """float32 parameters by wrapper-free name (compile adds `_orig_mod.`); FSDP2 shards gathered."""
    from trainer.param_names import clean_name

    out = {}
    for k, p in model.named_parameters():
        full = getattr(p, "full_tensor", None)
        out[clean_name(k)] = (full() if callable(full) else p).detach().float()
    return out


def _dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(((a[k] - b[k]).double() ** 2).sum()) for k in a))


# (dtype, lr or None = TrainerSection's default): each runs eager and compiled in lockstep
COMPILE_CHECK_RUNS: list[tuple[str, float | None]] = [
    ("bfloat16", None),  # the benchmark's setting, where step 3 differed 16x on the H200
    ("float32", None),
    ("float32", 1e-6),  # the mechanism: must agree step after step
    ("bfloat16", 1e-6),
]


def _lockstep(
    ctx: Ctx,
    m: ModelConfig,
    dtype: str,
    lr: float | None,
    mbs: list[PackedMicroBatch],
    total: int,
    steps: int,
) -> dict[str, Any]:
    """An eager and a compiled model, `steps` optimizer steps side by side (see compile_steps).
    A function of its own so both models are freed when it returns."""
    lr_knob = {} if lr is None else {"lr": lr}
    pairs = [build_ours(m, {"compile": c, **lr_knob}, ctx, dtype=dtype) for c in (False, True)]
    run: dict[str, Any] = {"eager": [], "compiled": [], "gap": [], "gap_over_update": []}
    before = {k: v.clone() for k, v in _full_params(pairs[0][0]).items()}
    for _ in range(steps):
        for name, (model, opt, deg, meshes) in zip(("eager", "compiled"), pairs, strict=True):
            run[name].append(our_step(model, opt, mbs, total, deg, meshes, ctx.device)[0])
        pe, pc = _full_params(pairs[0][0]), _full_params(pairs[1][0])
        gap, update = _dist(pc, pe), _dist(pe, before)
        run["gap"].append(gap)
        run["gap_over_update"].append(gap / update if update > 0 else float("inf"))
        before = {k: v.clone() for k, v in pe.items()}
    run["loss_rel_diff"] = [abs(c - e) / abs(e) for e, c in zip(run["eager"], run["compiled"], strict=True)]
    return run


def compile_steps(ctx: Ctx, shape: str, tokens: int, steps: int) -> dict[str, Any]:
    """Is torch.compile right over several optimizer steps, or do bf16 roundings diverge?

    For each (dtype, lr) of COMPILE_CHECK_RUNS an eager and a compiled model (the benchmark's
    `bf16` / `bf16+compile` path, same init, same data every step as run_ours) take `steps`
    optimizer steps in lockstep. Per step: both losses, the parameter gap ||compiled - eager|| and
    it over the norm of that step's eager update (`gap_over_update`). A compiled graph that used
    stale parameters (or tensors the optimizer does not update) falls behind eager by a whole
    update from step 2 on, in the loss or the parameters, whatever the lr and dtype; float32
    rounding gives relative differences <= ~1e-4 (`mechanism_agrees`, at lr 1e-6). In bf16 AdamW
    turns rounding noise in near-zero gradient elements into ~lr-sized moves, so even step 1's
    gap_over_update is ~0.1 (tiny CPU shape) without any bug. `eager_bf16_vs_fp32` compares the
    two eager runs at the default lr: if eager alone, moved only by bf16 rounding, ends as far
    apart as eager vs compiled, the dynamics amplify rounding and compile is not the cause."""
    if ctx.world != 1:
        raise ValueError("the compile check runs in one process (no torchrun)")
    m = model_config(shape, max(tokens, 4096))
    mine, total = rank_data([[tokens]], m.vocab_size, Degrees(1, 1, 1, 1, 1), 0, seed=11)
    mbs = [pack(mine)]
    out: dict[str, Any] = {"shape": shape, "tokens": tokens, "steps": steps, "runs": {}}
    for dtype, lr in COMPILE_CHECK_RUNS:
        key = f"{dtype}/lr={lr if lr is not None else TrainerSection().lr:g}"
        try:
            out["runs"][key] = _lockstep(ctx, m, dtype, lr, mbs, total, steps)
        except Exception as e:  # recorded, the rest goes on
            out["runs"][key] = {"error": repr(e), "trace": traceback.format_exc()[-2000:]}
        free()
    runs = out["runs"]
    default = f"{TrainerSection().lr:g}"
    b16, f32 = runs.get(f"bfloat16/lr={default}", {}), runs.get(f"float32/lr={default}", {})
    if "eager" in b16 and "eager" in f32:
        out["eager_bf16_vs_fp32"] = [
            abs(b - f) / abs(f) for b, f in zip(b16["eager"], f32["eager"], strict=True)
        ]
    mech = runs.get("float32/lr=1e-06", {})
    if "loss_rel_diff" in mech:
        # float32, an lr where nothing is amplified: compile must reproduce eager step by step.
        out["mechanism_agrees"] = max(mech["loss_rel_diff"]) < 1e-4 and max(mech["gap_over_update"]) < 1e-2
    return out


class Prepared:
    """One variant ready to step: `one()` runs a step; what the report needs to count it."""

    def __init__(
        self,
        one: Any,
        m: ModelConfig,
        docs: list[int],
        tokens: int,
        info: dict[str, Any],
        model: torch.nn.Module,
    ) -> None:
        self.one, self.m, self.docs, self.tokens, self.info, self.model = one, m, docs, tokens, info, model
        self.losses: list[float] = []

    @property
    def flops(self) -> float:
        return step_flops(self.m, self.docs)


def prepare_ours(
    ctx: Ctx, shape: str, variant: str, tokens: int, cp: int = 1, ep: int = 1, tp: int = 1
) -> Prepared:
    """Build our model for `variant` and its batch (also bench/trainer/profile_step.py's)."""
    knobs = VARIANTS[variant]
    m = model_config(shape, max(tokens, 4096))
    model, opt, deg, meshes = build_ours(m, knobs, ctx, cp=cp, ep=ep, tp=tp)
    if knobs.get("pack"):
        lens_per_rank = [mixed_lengths(tokens, seed=r) for r in range(deg.dp)]
    else:
        lens_per_rank = [[tokens] for _ in range(deg.dp)]
    mine, total = rank_data(lens_per_rank, m.vocab_size, deg, ctx.rank, seed=11)
    mbs = [pack(mine)]
    assert mbs[0].inputs.shape[1] == tokens

    def one() -> None:
        prep.losses.append(our_step(model, opt, mbs, total, deg, meshes, ctx.device)[0])

    docs = [x for lens in lens_per_rank for x in lens]
    info = dict(variant=variant, knobs=knobs, docs_per_rank=len(lens_per_rank[0]), degrees=vars(deg))
    prep = Prepared(one, m, docs, sum(sum(x) for x in lens_per_rank), info, model)
    return prep


def run_ours(
    ctx: Ctx, shape: str, variant: str, tokens: int, steps: int, cp: int, ep: int, publish: bool, tp: int = 1
) -> dict[str, Any]:
    prep = prepare_ours(ctx, shape, variant, tokens, cp, ep, tp)
    times = timed(prep.one, steps)
    res = summarise(times, prep.flops, prep.tokens, ctx.world)
    res.update(prep.info, losses=prep.losses[:3])
    if publish:
        res["publish"] = publish_time(prep.model, prep.m, ctx, prep.one)
    return res  # model and optimizer go with this frame


def publish_time(model: torch.nn.Module, m: ModelConfig, ctx: Ctx, step: Any) -> dict[str, Any]:
    """Publish twice (the first allocates the pinned buffers): blocked seconds, background write
    seconds, and one training step run while the write is in flight."""
    root = Path(tempfile.mkdtemp(prefix="relay-publish-", dir=os.environ.get("PUBLISH_DIR", "/tmp")))
    # what a bf16 engine fleet loads; every rank its share, in one temporary directory per version
    pub = Publisher(m, ctx.rank, ctx.world, torch.bfloat16, token="bench")
    out: dict[str, Any] = {"dir": str(root)}
    try:
        for i in (1, 2):
            blocked = pub.publish(model, i, root / "weights" / f"step_{i}")
            if i == 2:
                sync()
                t = time.perf_counter()
                step()
                sync()
                out["step_during_write_s"] = time.perf_counter() - t
            pub.wait()
            last = pub.last
            out[f"publish_{i}"] = {
                "blocked_s": blocked,
                "wait_s": last.wait_s if last else None,
                "gather_s": last.gather_s if last else None,
                "write_s": last.write_s if last else None,
                "done_s": last.done_s if last else None,
                "bytes": last.bytes if last else None,
            }
            if i == 1:  # keep one copy on disk (4B float32 is 16 GB)
                shutil.rmtree(root / "weights" / "step_1", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def prepare_hf(ctx: Ctx, shape: str, tokens: int) -> Prepared:
    m = model_config(shape, max(tokens, 4096))
    model, opt = build_hf(m, ctx.device, ac=shape != "0.6b", fused=ctx.cuda)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, m.vocab_size, (1, tokens + 1), generator=g).to(ctx.device)

    def one() -> None:
        prep.losses.append(hf_step(model, opt, toks, tokens))

    info = dict(variant="hf_transformers", gradient_checkpointing=shape != "0.6b")
    prep = Prepared(one, m, [tokens], tokens, info, model)
    return prep


def run_baseline(ctx: Ctx, shape: str, tokens: int, steps: int) -> dict[str, Any]:
    prep = prepare_hf(ctx, shape, tokens)
    times = timed(prep.one, steps)
    res = summarise(times, prep.flops, tokens, 1)
    res.update(prep.info)
    return res


def machine() -> dict[str, Any]:
    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception as e:
            return repr(e)

    versions: dict[str, str] = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "transformers", "torchtitan", "pydantic"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as e:
            versions[mod] = repr(e)
    return {
        "nvidia_smi": sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"]),
        "hostname": platform.node(),
        "versions": versions,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "trainer.json"))
    p.add_argument("--shapes", default="0.6b,4b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant; median of the 3rd..")
    p.add_argument("--variants", default="", help="comma list (default: per shape, see DEFAULT_VARIANTS)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (torchrun)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (torchrun, MoE shape)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (torchrun, dense shapes)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-publish", action="store_true")
    p.add_argument("--publish-shape", default="4b", help="time publishing after its first variant")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a logic smoke run")
    p.add_argument("--budget-s", type=float, default=450.0, help="skip variants once this is spent")
    p.add_argument(
        "--compile-check",
        default="",
        help="shape (e.g. 0.6b): eager vs compiled over --compile-check-steps optimizer steps (compile_steps)",
    )
    p.add_argument("--compile-check-steps", type=int, default=5)
    p.add_argument("--compile-check-tokens", type=int, default=0, help="0: --tokens")
    args = p.parse_args()

    ctx = Ctx(args.device)
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "world": ctx.world,
        "machine": machine(),
        "method": "MFU = (6*N*T + 6*L*H*Q*sum(doc_len^2)) / step_s / (989e12 * gpus); median of steps 3..",
        "results": {},
    }

    def save() -> None:
        if ctx.main:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            write_result(args.out, report)

    def attempt(key: str, fn: Any) -> None:
        if time.monotonic() - ctx.t0 > args.budget_s:
            report["results"][key] = {"skipped": f"time budget {args.budget_s}s spent"}
            return
        t = time.monotonic()
        try:
            report["results"][key] = fn()
        except Exception as e:
            report["results"][key] = {"error": repr(e), "trace": traceback.format_exc()[-3000:]}
        report["results"][key]["wall_s"] = time.monotonic() - t
        free()
        save()
        if ctx.main:
            r = report["results"][key]
            brief = {
                k: r[k]
                for k in ("tokens_per_s", "mfu", "peak_mem_gib", "error", "mechanism_agrees")
                if k in r
            }
            print(f"[{time.monotonic() - ctx.t0:6.0f}s] {key}: {brief}", flush=True)

    if not args.no_check:
        attempt("check_tiny_vs_fp32", lambda: correctness(ctx))
    if args.compile_check:
        check_tokens = args.compile_check_tokens or args.tokens
        attempt(
            f"check_compile_steps/{args.compile_check}",
            lambda: compile_steps(ctx, args.compile_check, check_tokens, args.compile_check_steps),
        )
    for shape in [s for s in args.shapes.split(",") if s]:  # --shapes "": only the checks
        if not args.no_baseline and ctx.world == 1:
            attempt(f"{shape}/baseline_hf", lambda s=shape: run_baseline(ctx, s, args.tokens, args.steps))
        names = args.variants.split(",") if args.variants else DEFAULT_VARIANTS[shape]
        for i, v in enumerate(names):
            pub = shape == args.publish_shape and i == 0 and not args.no_publish
            attempt(
                f"{shape}/ours/{v}",
                lambda s=shape, v=v, pub=pub: run_ours(
                    ctx, s, v, args.tokens, args.steps, args.cp, args.ep, pub, args.tp
                ),
            )
    report["total_s"] = time.monotonic() - ctx.t0
    save()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
