"""Publishing a policy version and applying it in an engine: the costs per step.

    python bench/weights/publish_apply.py --out results/x.json                  # GPU: 4b, 30b-a3b
    python bench/weights/publish_apply.py --device cpu --shapes tiny,tiny-moe --out /tmp/w.json

For each shape and precision (bf16, fp8 = E4M3 with 128x128 scales, what an FP8 engine serves):
- publish (trainer.publish.Publisher, one rank, float32 master weights on the device): the seconds
  the training loop is blocked (gather: cast/quantise on the device, copy to pinned host memory),
  the background write (this rank's safetensors file, fsync, rename; then the directory), and its
  bytes/s. Twice: the first publish allocates the pinned buffers, the second is the steady state.
- apply (LLMEngine.load_weights on the published directory, the engine in the same precision):
  the read (index, memory maps, the bytes read once into the page cache, off the engine loop) and
  the apply (copies into the parameters, the loop held), warm (the files just written, as on the
  trainer's node) and cold (the files' pages evicted first: posix_fadvise DONTNEED; then the read
  comes from the local disk, not a cluster's shared filesystem), with bytes/s.
- baselines in the same process: bf16, how weights were applied before (every file read into
  memory with safetensors.load_file, then each parameter copied from pageable memory);
  fp8, the bf16 directory applied to the same FP8 engine (quantised at load).

Shapes (bench/shapes.py): Qwen3-4B; Qwen3-30B-A3B's layer shapes with 12 of its 48 layers
(per-layer costs scale; the full model's layers are 4x these); tiny dense / MoE shapes for a CPU
check. The trainer's
weights are random (their values do not change the bytes moved). Every rank of a multi-rank
trainer writes its share of each version in parallel: per-rank bytes/s here is one rank's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.machine import machine  # noqa: E402
from bench.results import write_result
from bench.shapes import SHAPES, VOCAB  # noqa: E402
from services.common.config import EngineConfig, ModelConfig  # noqa: E402
from services.common.weights_dir import read_model_dir  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from trainer.publish import Publisher  # noqa: E402


def model_config(shape: str) -> ModelConfig:
    """bench/shapes.py's shape (tied embeddings unless it says otherwise, as bench/trainer/step.py)."""
    vocab = 512 if shape.startswith("tiny") else VOCAB
    kw = {"tie_embeddings": True, **SHAPES[shape]}
    return ModelConfig(vocab_size=vocab, max_seq_len=4096, rope_theta=1e6, **kw)


# ------------------------------------------------------------------ the trainer's weights


class MasterWeights(nn.Module):
    """Float32 weights in torchtitan's layout (grouped experts [E, out, in] as w1/w3/w2), as a
    trainer holds them: what Publisher gathers. Names are HF's, the experts' aside."""

    def __init__(self, m: ModelConfig, device: torch.device):
        super().__init__()
        self.tensors: dict[str, torch.Tensor] = {}
        g = torch.Generator(device=device).manual_seed(0)

        def add(name: str, *shape: int) -> None:
            self.tensors[name] = torch.randn(*shape, generator=g, device=device) * 0.02

        q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        add("model.embed_tokens.weight", m.vocab_size, m.dim)
        for i in range(m.n_layers):
            p = f"model.layers.{i}."
            add(p + "self_attn.q_proj.weight", q, m.dim)
            add(p + "self_attn.k_proj.weight", kv, m.dim)
            add(p + "self_attn.v_proj.weight", kv, m.dim)
            add(p + "self_attn.o_proj.weight", m.dim, q)
            for n in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                self.tensors[p + n] = torch.ones(m.head_dim, device=device)
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                self.tensors[p + n] = torch.ones(m.dim, device=device)
            if m.is_moe:
                e, inter = m.n_routed_experts, m.moe_hidden_dim
                add(p + "mlp.gate.weight", e, m.dim)
                add(p + "mlp.experts.w1", e, inter, m.dim)
                add(p + "mlp.experts.w3", e, inter, m.dim)
                add(p + "mlp.experts.w2", e, m.dim, inter)
            else:
                add(p + "mlp.gate_proj.weight", m.hidden_dim, m.dim)
                add(p + "mlp.up_proj.weight", m.hidden_dim, m.dim)
                add(p + "mlp.down_proj.weight", m.dim, m.hidden_dim)
        self.tensors["model.norm.weight"] = torch.ones(m.dim, device=device)
        if not m.tie_embeddings:
            add("lm_head.weight", m.vocab_size, m.dim)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return dict(self.tensors)


EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's adapter for these names: grouped experts split into per-expert views."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        head, _, leaf = k.rpartition(".")
        if head.endswith(".mlp.experts") and leaf in EXPERT_NAMES:
            out.update({f"{head}.{e}.{EXPERT_NAMES[leaf]}.weight": v[e] for e in range(v.shape[0])})
        else:
            out[k] = v
    return out


def free(device: torch.device) -> None:
    """Give back the device memory and the pinned host buffers a phase cached."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):  # by torch version
            if hasattr(torch._C, name):
                getattr(torch._C, name)()
                break


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def gbps(nbytes: int, s: float) -> float:
    return round(nbytes / max(s, 1e-9) / 1e9, 2)


# ------------------------------------------------------------------ publish


def publish(
    m: ModelConfig, quant: str, device: torch.device, root: Path, versions: tuple[int, ...]
) -> dict[str, Any]:
    masters = MasterWeights(m, device)
    params = sum(t.numel() for t in masters.tensors.values())
    pub = Publisher(m, dtype=torch.bfloat16, quantization=quant, to_hf=to_hf)  # type: ignore[arg-type]
    runs = []
    for v in versions:
        sync(device)
        blocked = pub.publish(masters, v, root / "weights" / f"step_{v}")
        pub.wait()
        last = pub.last
        assert last is not None
        runs.append(
            {
                "version": v,
                "blocked_s": round(blocked, 4),
                "gather_s": round(last.gather_s, 4),
                "write_s": round(last.write_s, 3),
                "done_s": round(last.done_s, 3),
                "bytes": last.bytes,
                "gather_gb_s": gbps(last.bytes, last.gather_s),
                "write_gb_s": gbps(last.bytes, last.write_s),
            }
        )
    del pub, masters
    free(device)
    return {"params": params, "runs": runs}


# ------------------------------------------------------------------ apply


def evict(d: Path) -> bool:
    """Drop the directory's file pages from the page cache (clean pages: no root needed)."""
    ok = True
    for f in d.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def timed_apply(eng: LLMEngine, d: Path, version: int, cold: bool) -> dict[str, Any]:
    """LLMEngine.load_weights: read (off the loop in a service) + apply (the loop held)."""
    evicted = evict(d) if cold else None
    s = eng.stats
    before = s.weight_bytes_read_total
    t0 = time.perf_counter()
    eng.load_weights(d, version)
    out: dict[str, Any] = {
        "read_s": round(s.weight_read_seconds_last, 3),
        "apply_s": round(s.weight_apply_seconds_last, 3),
        "total_s": round(time.perf_counter() - t0, 3),
        "bytes": s.weight_bytes_read_total - before,
    }
    out["read_gb_s"] = gbps(out["bytes"], out["read_s"])
    out["apply_gb_s"] = gbps(out["bytes"], out["apply_s"])
    if cold:
        out["evicted"] = evicted
    return out


def _old_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


@torch.no_grad()
def baseline_apply(eng: LLMEngine, d: Path) -> dict[str, Any]:
    """Before: every file read whole into memory (safetensors.load_file), then each parameter
    copied from that pageable memory (`p.copy_(src.to(device))`, as load_hf_state did)."""
    from safetensors.torch import load_file

    from services.engine.layers import moe as engine_moe
    from services.engine.models import causal_lm as engine_model

    evict(d)
    t0 = time.perf_counter()
    state: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        state.update(load_file(str(f)))
    t1 = time.perf_counter()
    staged = engine_model.copy_weight, engine_moe.copy_weight
    engine_model.copy_weight = engine_moe.copy_weight = _old_copy  # type: ignore[assignment]
    try:
        eng.model.load_hf_state(state)  # type: ignore[operator]
    finally:
        engine_model.copy_weight, engine_moe.copy_weight = staged  # type: ignore[assignment]
    sync(eng.device)
    t2 = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return {
        "read_s": round(t1 - t0, 3),
        "apply_s": round(t2 - t1, 3),
        "total_s": round(t2 - t0, 3),
        "bytes": nbytes,
        "read_gb_s": gbps(nbytes, t1 - t0),
        "apply_gb_s": gbps(nbytes, t2 - t1),
    }


def engine(d: Path, quant: str, device: torch.device) -> LLMEngine:
    cfg = EngineConfig(
        device=device.type,  # type: ignore[arg-type]
        dtype="bfloat16",
        quantization=quant,  # type: ignore[arg-type]
        max_batch_size=8,
        max_seq_len=256,
        num_kv_blocks=64,
        cuda_graphs=False,
    )
    return LLMEngine(d, cfg)


def run_shape(
    shape: str, device: torch.device, root: Path, quants: list[str], done: Any = lambda _o: None
) -> dict[str, Any]:
    m = model_config(shape)
    out: dict[str, Any] = {
        "model": {k: v for k, v in m.model_dump().items() if k in SHAPES[shape] or k == "vocab_size"}
    }
    bf16_dir = root / "bf16-kept"
    for quant in quants:
        tag = "bf16" if quant == "none" else "fp8"
        rec: dict[str, Any] = {}
        t0 = time.perf_counter()
        rec["publish"] = publish(m, quant, device, root / tag, (1, 2))
        d1, d2 = root / tag / "weights" / "step_1", root / tag / "weights" / "step_2"
        rec["dir_bytes"] = sum(f.stat().st_size for f in d2.iterdir())
        shutil.rmtree(d1)  # one version on disk at a time
        eng = engine(d2, quant, device)
        rec["apply_warm"] = timed_apply(eng, d2, 3, cold=False)
        rec["apply_cold"] = timed_apply(eng, d2, 4, cold=True)
        if quant == "none":
            rec["baseline_apply_before"] = baseline_apply(eng, d2)
            shutil.move(str(d2), str(bf16_dir))  # kept for the fp8 baseline
        else:
            # Check the engine holds the file's bits (copied, no re-quantisation).
            _, st = read_model_dir(d2)
            name = "model.layers.0.self_attn.q_proj"
            buf = eng.model.get_submodule(name).weight_fp8
            rec["engine_holds_file_bits"] = bool(
                torch.equal(buf.view(torch.uint8).cpu(), st[name + ".weight"].view(torch.uint8))
            )
            if bf16_dir.exists():
                rec["baseline_apply_bf16_dir_quantised_at_load"] = timed_apply(eng, bf16_dir, 5, cold=True)
            shutil.rmtree(d2)
        del eng
        free(device)
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        out[tag] = rec
        print(json.dumps({shape: {tag: rec}}), flush=True)
        done(out)  # partial results survive a time limit
    shutil.rmtree(bf16_dir, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4b,30b-a3b")
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default=os.environ.get("WEIGHTS_BENCH_DIR", tempfile.gettempdir()))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    quants = ["none" if p == "bf16" else p for p in args.precisions.split(",")]
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": str(device),
        "shapes": {},
    }
    root = Path(tempfile.mkdtemp(prefix="relay-weights-", dir=args.dir))
    try:
        for shape in args.shapes.split(","):

            def done(part: dict[str, Any], shape: str = shape) -> None:
                result["shapes"][shape] = part
                write_result(args.out, result)

            run_shape(shape, device, root / shape, quants, done)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
