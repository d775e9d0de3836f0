"""Apply the trainer's performance configuration to a model: one code path, 1 CPU process to N GPUs.

Order (torchtitan's parallelize_qwen3, with torchtitan's functions where they fit):
  1. attention kernel   DocumentAttention of trainer.attention in every block (trainer.attention)
  1b. tensor parallel   apply_tensor_parallel (tp > 1, dense models): Megatron-style column/row
                        sharding of every block's projections and MLP, no sequence parallel
  2. expert parallel    torchtitan's apply_moe_ep_tp (EP only): routed experts split over the ep
                        ranks, all-to-all token dispatch/combine (ep > 1, MoE models)
  3. context parallel   torchtitan's apply_cp_to_attention_module on the cp mesh (cp > 1)
  4. activation ckpt    torchtitan's apply_ac: "selective" = per-op SAC with torchtitan's save list
  5. torch.compile      torchtitan's per-block apply_compile (after AC, before FSDP)
  6. FSDP2              each block its own unit (with EP, the routed experts a unit on the efsdp
                        mesh), the root holding embeddings/norm/output (tied embedding and output
                        weight stay one parameter); MixedPrecisionPolicy bf16 params/compute,
                        float32 reduction; the sharded float32 parameters are the master weights.

FSDP needs a process group and, with trainer.fsdp = "auto" (the default), more than one rank
(`use_fsdp`): as torchtitan, which applies no FSDP when dp_shard == 1. On one rank FSDP2 would only
copy (all-gather copy-in/out of every parameter, reduce-scatter copies of every gradient, casts:
~355 device copies, ~9 ms of a 0.6B step on an H200). Without FSDP `bfloat16` means float32
parameters under torch.autocast, torchtitan's single-device choice (`autocast_context`);
trainer.fsdp = "always" keeps FSDP on a 1-rank group.
trainer.fsdp = "master" is "auto" with, at world 1 and bfloat16, bf16 parameters and float32
master weights instead of autocast (trainer/master_weights.py): neither FSDP's copies nor
autocast's per-forward casts of every weight.

Parallel degrees come from trainer.tp / cp / ep and the process count, checked with torchtitan's
ParallelDims rules (dp = world / (tp * cp); ep divides world). Not wired, refused with a clear
error: tp with cp or with ep (MoE).

Tensor parallel keeps the embedding, the norms and the LM head replicated (Replicate DTensors on
the tp mesh; the residual stream stays a local tensor): the chunked log-prob head then needs no vocabulary-parallel
log-softmax, and a tied embedding stays one parameter. The blocks' q/k/v and w1/w3 are column-
sharded (each rank computes its heads and its slice of the MLP), wo and w2 row-sharded (an
all-reduce each), and q_norm/k_norm take their heads as a Shard(2) DTensor (torchtitan's Qwen3
plan) so their weights' gradients are summed over the tp ranks. The replicated weights' gradients
are identical on every tp rank (their inputs and the gradients reaching them are), so nothing
reduces them over tp. FSDP then shards everything over the dp ranks (2D DTensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.common.config import TrainerSection
from trainer.attention import enable_document_attention
from trainer.batch import MicroBatch
from trainer.master_weights import attach as attach_master_weights
from trainer.master_weights import masters_of
from trainer.packing import PackedMicroBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Degrees:
    world: int
    dp: int
    tp: int
    cp: int
    ep: int
    fsdp: bool = False  # whether parallelize wrapped the model in FSDP2 (use_fsdp)
    master: bool = False  # bf16 parameters + float32 masters (use_master_weights)

    def data_rank(self, rank: int) -> int:
        """Which data-parallel shard of the batch `rank` trains: ranks of one cp x tp group
        share their samples (torchtitan's mesh order: batch, cp, tp; tp fastest)."""
        return rank // (self.cp * self.tp)


def degrees(tc: TrainerSection, world: int) -> Degrees:
    """Validate trainer.tp/cp/ep against the actual process count; a clear error if they don't fit."""
    if world % (tc.tp * tc.cp):
        raise ValueError(
            f"{world} trainer processes is not a multiple of trainer.tp * trainer.cp = {tc.tp} * {tc.cp}"
            f" (trainer.nproc = {tc.nproc}; dp = nproc / (tp * cp))"
        )
    if world % tc.ep:
        raise ValueError(f"trainer.ep = {tc.ep} does not divide the {world} trainer processes")
    if tc.tp > 1 and (tc.cp > 1 or tc.ep > 1):
        raise NotImplementedError(
            "trainer.tp > 1 with trainer.cp or trainer.ep > 1 is not wired (use one of them)"
        )
    from torchtitan.distributed import ParallelDims

    # torchtitan's own consistency rules (dp * cp * tp * pp == world, ep vs etp), no mesh yet.
    dims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=tc.cp, tp=tc.tp, pp=1, ep=tc.ep, etp=1, world_size=world
    )
    return Degrees(world=world, dp=dims.dp_shard, tp=tc.tp, cp=tc.cp, ep=tc.ep)


def use_fsdp(tc: TrainerSection, world: int, distributed: bool) -> bool:
    """FSDP2 needs a process group; "auto" applies it only when there is something to shard over
    (world / tp > 1: dp, cp or ep ranks), "always" on any group. One rank without FSDP is a plain
    model, so its checkpoints and published weights are the same full state dicts."""
    return distributed and (tc.fsdp == "always" or world // tc.tp > 1)


def use_master_weights(tc: TrainerSection, fsdp: bool) -> bool:
    """trainer.fsdp = "master" where FSDP does not apply (one rank) and the dtype is bf16: bf16
    parameters, float32 masters (trainer/master_weights.py). float32 needs no masters."""
    return tc.fsdp == "master" and not fsdp and tc.dtype == "bfloat16"


def _device_type(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def build_meshes(deg: Degrees, device: torch.device) -> dict[str, Any]:
    """{"fsdp": mesh of the dp * cp ranks FSDP shards over, "cp": the cp mesh or None}.

    The layout is torchtitan's (batch outer, cp inner, as ParallelDims' dataloading/dense meshes),
    built directly: ParallelDims.build_mesh assumes CUDA when no accelerator is present and gives
    degree-1 dims a fake backend, so it cannot serve the CPU/gloo path or a 1-process group."""
    from torch.distributed.device_mesh import init_device_mesh

    dt = _device_type(device)
    out: dict[str, Any] = {"cp": None, "ep": None, "efsdp": None, "tp": None}
    if deg.tp > 1:  # (cp == 1, ep == 1: degrees()) tp fastest, as Degrees.data_rank
        mesh = init_device_mesh(dt, (deg.world // deg.tp, deg.tp), mesh_dim_names=("fsdp", "tp"))
        out.update(fsdp=mesh["fsdp"], tp=mesh["tp"])
    elif deg.cp == 1:
        out["fsdp"] = init_device_mesh(dt, (deg.world,), mesh_dim_names=("fsdp",))
    else:
        mesh = init_device_mesh(dt, (deg.dp, deg.cp), mesh_dim_names=("dp", "cp"))
        out.update(fsdp=mesh["dp", "cp"]._flatten("fsdp"), cp=mesh["cp"])
    if deg.ep > 1:
        # torchtitan's sparse mesh: routed experts split over ep (inner, so an EP group is
        # consecutive ranks) and FSDP-sharded over the efsdp = world / ep ranks holding the same
        # experts. One root mesh, so FSDP can stack its sharding on the EP DTensors.
        sparse = init_device_mesh(dt, (deg.world // deg.ep, deg.ep), mesh_dim_names=("efsdp", "ep"))
        out.update(ep=sparse["ep"], efsdp=sparse["efsdp"])
    return out


def _sac_ignores_profiler_ranges() -> None:
    """Per-op SAC replays the forward's op sequence in the recompute. With EP the routed experts
    are their own FSDP unit INSIDE the checkpointed block, and FSDP2 brackets its hooks with
    profiler record_function ops, which run a different number of times in the recompute
    (RuntimeError "..._record_function_enter_new... not found in storage"). They are profiler
    annotations, not computation: let SAC pass them through, as it does detach."""
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        for overload in packet.overloads() if packet is not None else []:
            SAC_IGNORED_OPS.add(getattr(packet, overload))


# MoE models' SAC keeps these too (on top of torchtitan's Qwen3 list). all_to_all_single: as
# torchtitan's own MoE models (llama4, deepseek_v3) do, so the recompute inside backward does not
# run the EP token dispatch/combine (and their split-count exchange) a second time. _grouped_mm:
# the expert GEMMs are most of an MoE layer's FLOPs; keeping their outputs (~3 x [tokens * top_k,
# moe_hidden or dim] per layer) skips recomputing them. A module-level set so a benchmark can
# compare without it.
MOE_SAC_SAVE_OPS: set[Any] = {
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops.aten._grouped_mm.default,
}


def sac_save_list(model: nn.Module) -> set[Any]:
    from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list

    # The FP8 linear (trainer/fp8.py) is one opaque op, not aten.mm, so selective AC recomputes it
    # in the backward. Measured on the H200 (4B, docs/fp8.md): recomputed, 0.97x bf16's speed at 81%
    # of its memory; saved, 1.00x at 138% (the op's outputs are more than an mm's, and torchtitan
    # saves only every other mm). Recomputing keeps what selective AC is for.
    return set(_op_sac_save_list) | (MOE_SAC_SAVE_OPS if _moe_blocks(model) else set())


def apply_activation_checkpoint(model: nn.Module, mode: str, compiled: bool) -> None:
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac

    if mode == "selective":
        _sac_ignores_profiler_ranges()
    cfg = ActivationCheckpoint(mode=mode, selective_ac_option="op")
    apply_ac(model, cfg, model_compile_enabled=compiled, op_sac_save_list=sac_save_list(model))


def apply_compile(model: nn.Module, ep: bool, backend: str = "inductor") -> None:
    """torchtitan's per-block torch.compile (identical blocks: one compile serves all); MoE
    blocks get their submodules compiled around the experts (data-dependent token counts).
    `backend`: tests trace with "aot_eager" (dynamo + autograd, no inductor C++ build)."""
    from torchtitan.config.job_config import Compile
    from torchtitan.models.llama4.infra.parallelize import apply_compile as tt_apply_compile

    tt_apply_compile(model, Compile(enable=True, components=["model"], backend=backend), ep)
    # MoE routers stay eager: a ReplayRouter takes per-call recorded ids and counts its agreement
    # with a host-side check (not traceable with fullgraph=True), and trainer.replay.routing finds
    # the routers by type. It is a [tokens, dim] x [dim, experts] GEMM plus a top-k: little to fuse.
    for block in _moe_blocks(model):
        router = block.moe.router
        block.moe.router = getattr(router, "_orig_mod", router)


def _moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [b for b in model.layers.values() if getattr(b, "moe_enabled", False)]  # type: ignore[union-attr]


def _permute_indices_on_cpu() -> None:
    """torchtitan's EP token permutation calls its Triton kernel unless told use_cpu; route CPU
    tensors (the gloo path) to its CPU implementation. Idempotent."""
    import torchtitan.models.moe.utils as moe_utils

    orig = moe_utils.generate_permute_indices
    if getattr(orig, "relay_cpu_aware", False):
        return

    def generate_permute_indices(tokens_per_expert_group: torch.Tensor, *args: Any, **kw: Any) -> Any:
        if tokens_per_expert_group.device.type == "cpu":
            kw["use_cpu"] = True
        return orig(tokens_per_expert_group, *args, **kw)

    generate_permute_indices.relay_cpu_aware = True  # type: ignore[attr-defined]
    moe_utils.generate_permute_indices = generate_permute_indices


def apply_expert_parallel(model: nn.Module, ep_mesh: Any, device: torch.device) -> None:
    """torchtitan's apply_moe_ep_tp with EP only: each MoE layer's routed experts are split over
    the ep ranks (Shard(0) on the expert dim) with all-to-all token dispatch / combine."""
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp

    if device.type == "cpu":
        _permute_indices_on_cpu()
    apply_moe_ep_tp(model, tp_mesh=None, ep_mesh=ep_mesh, etp_mesh=None, ep_etp_mesh=None)


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    """Shard every block over the tp mesh; embedding, norms and head replicated (module docstring)."""
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torchtitan.distributed import NoParallel

    tp = tp_mesh.size()
    cfg = model.model_args  # type: ignore[union-attr]
    for name, n in (
        ("n_heads", cfg.n_heads),
        ("n_kv_heads", cfg.n_kv_heads or cfg.n_heads),
        ("hidden_dim", cfg.hidden_dim),
    ):
        if n % tp:
            raise ValueError(f"trainer.tp = {tp} does not divide the model's {name} = {n}")
    tied = model.output.weight is model.tok_embeddings.weight  # type: ignore[union-attr]
    # The embedding takes its tokens as a Replicate DTensor and returns local activations; the
    # norms' weights are only replicated (no hooks: RelayRMSNorm reads the local copy).
    parallelize_module(model, tp_mesh, {"tok_embeddings": NoParallel()})  # type: ignore[arg-type]
    distribute_module(model.norm, tp_mesh)  # type: ignore[arg-type]
    # The head is called with local activations and runs its own autograd function: its weight is
    # a Replicate DTensor that ChunkedOutput reads through to_local().
    if tied:
        model.output.weight = model.tok_embeddings.weight  # type: ignore[union-attr]
    else:  # its parameter replicated, its input left local (no input/output hooks)
        distribute_module(model.output, tp_mesh)  # type: ignore[arg-type]
    for block in model.layers.values():  # type: ignore[union-attr]
        distribute_module(block.attention_norm, tp_mesh)
        distribute_module(block.ffn_norm, tp_mesh)
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
        if getattr(block.attention, "q_norm", None) is not None:
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]


def apply_fsdp(model: nn.Module, mesh: Any, dtype: torch.dtype, efsdp_mesh: Any = None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    # Reductions in float32 whatever the compute dtype: summing bf16 gradients over ranks and
    # micro-batches loses the small per-token policy-gradient contributions.
    # ModelConfig.fp32_residual (trainer.model.residual_stream_like_engine): blocks take the float32
    # residual stream as it is; FSDP's default would cast every block's input to bf16.
    cast = not getattr(model, "fp32_residual", False)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=cast)
    # One rank: nothing to free by resharding after forward, and backward would re-cast every
    # parameter; several ranks: reshard (the memory is the point of FSDP).
    reshard = mesh.size() > 1
    for block in model.layers.values():  # type: ignore[union-attr]
        if efsdp_mesh is not None and getattr(block, "moe_enabled", False):
            experts = block.moe.experts
            ep = experts.w1.device_mesh.size()
            # More expert shards than experts: shard FSDP on dim 1 instead (torchtitan's rule).
            placement = (lambda _p: Shard(1)) if efsdp_mesh.size() * ep > experts.num_experts else None
            fully_shard(
                experts,
                mesh=efsdp_mesh,
                mp_policy=mp,
                reshard_after_forward=reshard,
                shard_placement_fn=placement,
            )
            # Gradient scale: the loss is multiplied by dp * cp (= the dense FSDP mesh size, whose
            # average then gives the global sum). An expert's gradient already sums its EP group's
            # tokens, and its replicas are only the efsdp ranks: divide by the same dp * cp.
            experts.set_gradient_divide_factor(float(mesh.size()))
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)


def parallelize(
    model: nn.Module, tc: TrainerSection, world: int, device: torch.device, distributed: bool
) -> tuple[nn.Module, Degrees, dict[str, Any]]:
    """Apply trainer.{attention, cp, activation_checkpoint, compile, dtype} and FSDP2 (`use_fsdp`)
    to `model` (already on `device`, float32). Returns the model, the parallel degrees (`fsdp`:
    whether FSDP2 wraps it) and the meshes (empty without a process group)."""
    fsdp = use_fsdp(tc, world, distributed)
    deg = dataclasses.replace(degrees(tc, world), fsdp=fsdp, master=use_master_weights(tc, fsdp))
    if deg.master:
        # Before compile traces anything: the masters copy the float32 weights as loaded, then
        # the parameters become bf16 in place (trainer.master_weights.masters_of finds them).
        attach_master_weights(model, DTYPES[tc.dtype])
    if tc.attention != "sdpa" and device.type != "cuda":
        raise ValueError(f"trainer.attention {tc.attention!r} needs CUDA, the trainer runs on {device}")
    enable_document_attention(model, tc.attention, tc.sdpa_backend, tc.sdpa_expand_kv)
    if _moe_blocks(model):  # routed experts: per-expert loop or grouped GEMMs (trainer/moe_routing.py)
        from trainer.moe_routing import grouped_mm_enabled, set_grouped_mm

        set_grouped_mm(model, grouped_mm_enabled(tc.moe_grouped_mm, device, tc.dtype))
    meshes: dict[str, Any] = build_meshes(deg, device) if distributed else {}
    if deg.tp > 1:
        if _moe_blocks(model):
            raise NotImplementedError("trainer.tp > 1 for MoE models is not wired (use trainer.ep)")
        if not distributed:
            raise ValueError("trainer.tp > 1 needs torchrun with trainer.nproc processes")
        apply_tensor_parallel(model, meshes["tp"])
    if deg.ep > 1:
        if not _moe_blocks(model):
            raise ValueError("trainer.ep > 1 needs a MoE model (model.arch qwen3_moe)")
        if not distributed:
            raise ValueError("trainer.ep > 1 needs torchrun with trainer.nproc processes")
        apply_expert_parallel(model, meshes["ep"], device)
    if deg.cp > 1:
        from trainer.glm5 import glm_attentions

        if glm_attentions(model):
            # A CP shard sees part of the sequence: the indexer's top-k over all keys is not wired.
            raise NotImplementedError(
                "trainer.cp > 1 for glm_moe_dsa (DSA top-k across CP shards) is not wired"
            )
        if any(hasattr(b, "mamba") for b in model.layers.values()):  # type: ignore[union-attr]
            # A Mamba-2 state would have to pass from each CP shard to the next.
            raise NotImplementedError(
                "trainer.cp > 1 for nemotron_h (Mamba-2 state across CP shards) is not wired"
            )
        if meshes.get("cp") is None:
            raise ValueError("trainer.cp > 1 needs torchrun with nproc = dp * cp")
        from torchtitan.distributed.context_parallel import apply_cp_to_attention_module

        apply_cp_to_attention_module(
            [layer.attention.inner_attention for layer in model.layers.values()],  # type: ignore[union-attr]
            meshes["cp"],
            "sdpa",
        )
    if tc.activation_checkpoint != "none":
        apply_activation_checkpoint(model, tc.activation_checkpoint, tc.compile)
    if tc.compile:
        if any(hasattr(b, "mamba") for b in model.layers.values()):  # type: ignore[union-attr]
            # Packed rows split each Mamba-2 layer by sample on the host (trainer/nemotron.py).
            raise NotImplementedError("trainer.compile for nemotron_h is not wired")
        apply_compile(model, deg.ep > 1)
    head = getattr(model, "output", None)
    if device.type == "cuda" and hasattr(head, "fused"):
        head.fused = True  # the chunked log-prob head's softmax math in Triton (trainer/head_kernel.py)
    if deg.fsdp:
        apply_fsdp(model, meshes["fsdp"], DTYPES[tc.dtype], meshes.get("efsdp"))
    return model, deg, meshes


def clip_grad_norm(model: nn.Module, max_norm: float, deg: Degrees) -> torch.Tensor:
    """clip_grad_norm_ over every parameter; with EP, torchtitan's version, which combines the
    norms of the expert (sparse mesh) and dense parameters (torch's cannot mix meshes). With
    master weights: the masters' float32 gradients (the parameters' bf16 ones are freed)."""
    masters = masters_of(model)
    if masters is not None:
        return torch.nn.utils.clip_grad_norm_(masters.masters, max_norm)
    if deg.ep > 1:
        from torchtitan.distributed.utils import clip_grad_norm_

        return clip_grad_norm_(list(model.parameters()), max_norm, ep_enabled=True)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def autocast_context(tc: TrainerSection, device: torch.device, fsdp: bool) -> Any:
    """bf16 without FSDP (`Degrees.fsdp` False: one rank): autocast, float32 weights. With FSDP
    the MixedPrecisionPolicy already casts, so nothing to do.

    Numerics against FSDP's MixedPrecisionPolicy(bf16, reduce float32): the same GEMMs and
    attention (bf16 inputs; autocast casts each float32 weight to bf16 once per forward, as FSDP's
    all-gather does) and the same gradient policy (each micro-batch's weight gradient comes out of
    a bf16 GEMM and is accumulated in float32 on the float32 parameter, where FSDP casts it to
    float32 for its reduce-scatter and accumulates in the float32 shard). Plain autocast would
    keep a float32 residual stream (float32 embedding output) and float32 norm weights; the model
    rounds those to bf16 as FSDP does (trainer.model.residual_stream_like_engine, RelayRMSNorm).
    What stays different: elementwise ops autocast does not list (RoPE, SiLU * up, the norms'
    arithmetic) run in float32 on bf16-rounded inputs where FSDP runs some in bf16, so autocast
    rounds less often (tests/test_trainer_world1.py bounds the gap)."""
    if tc.dtype == "float32" or fsdp or use_master_weights(tc, fsdp):
        return contextlib.nullcontext()  # bf16 parameters (FSDP's or master_weights'): no casts
    return torch.autocast(_device_type(device), dtype=torch.bfloat16)


# ------------------------------------------------------------------ context parallel inputs


def _cp_pad(x: torch.Tensor, multiple: int, value: float) -> torch.Tensor:
    pad = -x.shape[1] % multiple
    return torch.nn.functional.pad(x, (0, pad), value=value) if pad else x


def cp_micro_batch(mb: MicroBatch | PackedMicroBatch, cp_mesh: Any, cp: int) -> PackedMicroBatch:
    """This rank's sequence shard of a micro-batch, for trainer.cp > 1.

    torchtitan's CP runs causal SDPA as ring attention over the cp ranks, so a micro-batch must be
    causal as a whole: padded rows, or a pack of ONE sample (document masking across a CP split is
    not supported). Every per-token tensor is padded at the end to a multiple of 2 * cp (padding
    is causal-invisible and has loss mask 0) and sharded with the head-tail load balancer, the
    same permutation for all of them, so targets, masks and RoPE positions stay aligned."""
    from torchtitan.distributed.context_parallel import cp_shard

    if isinstance(mb, PackedMicroBatch):
        if len(mb.seq_lens) > 1:
            raise ValueError(
                "trainer.cp > 1 needs one sample per micro-batch: set trainer.packing = false or"
                " trainer.micro_batch_tokens below twice the shortest sample"
            )
        inputs, targets, positions = mb.inputs, mb.targets, mb.positions
        loss_mask, logp_infer, adv = mb.loss_mask, mb.logp_infer, mb.advantages
    else:
        inputs, targets = mb.inputs, mb.targets
        b, t = inputs.shape
        positions = torch.arange(t, device=inputs.device).expand(b, t)
        loss_mask, logp_infer = mb.loss_mask, mb.logp_infer
        adv = mb.advantages.to(torch.float32)
    m = 2 * cp
    bufs = (
        _cp_pad(inputs, m, 0),
        _cp_pad(targets, m, 0),
        _cp_pad(positions, m, 0),
        _cp_pad(loss_mask, m, 0.0),
        _cp_pad(logp_infer, m, 0.0),
        _cp_pad(adv.contiguous(), m, 0.0),
    )
    (inp, tgt, pos, mask, logp, a), _ = cp_shard(cp_mesh, bufs, None, "headtail")
    return PackedMicroBatch(
        inputs=inp,
        targets=tgt,
        positions=pos,
        loss_mask=mask,
        logp_infer=logp,
        advantages=a,
        seq_lens=[int(inp.shape[1])],  # one causal row for packed_logprobs
        n_tokens=mb.n_tokens,
    )


def cp_dummy_inputs(cp_mesh: Any, cp: int, device: torch.device) -> torch.Tensor:
    """A zero-weight micro-batch's inputs under CP: a sequence every cp rank can hold a shard of."""
    from torchtitan.distributed.context_parallel import cp_shard

    (x,), _ = cp_shard(
        cp_mesh, (torch.zeros((1, 2 * cp), dtype=torch.long, device=device),), None, "headtail"
    )
    return x  # type: ignore[no-any-return]
