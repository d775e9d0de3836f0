"""One GPU check of Nemotron-H's decode on CUDA graphs, and of GLM-5's DSA top-k (one JSON out).

    python3 bench/engine/nemotron_gpu.py --out $OUT/nemotron_gpu.json            # one H100
    python3 bench/engine/nemotron_gpu.py --only graph_step,fp8 --out $OUT/x.json  # some sections
    python3 bench/engine/nemotron_gpu.py --smoke --out /tmp/nemotron_gpu.json     # CPU, ~1 min

A Nemotron-3-Nano-shaped model at full width and reduced depth (configs/models/nemotron3.toml,
layers "MEM*EM": 3 Mamba-2, 2 MoE of 128 squared-ReLU experts top-6, 1 attention; the trainer's
random init with logits of std ~4, bf16), nothing downloaded; the JSON is rewritten after each
section. Sections (each recorded, a failure does not stop the next):

- `graph_step`: one decode step of n running sequences (5 and 37: padded to the graphs' 8 and 64)
  three ways from the same states: the captured graph's replay, the same static batch run eagerly
  (cuda_graphs.DecodeGraphs.body), and the eager paged batch. ok: replay == static eager exactly
  (logits and states: the same kernels on the same buffers); replay against the eager batch the
  same greedy token on every row whose top-2 log-prob gap is over GAP and log-probs within
  LOGPROB_TOL (bf16 GEMMs of other row counts); the step's slots advanced like the eager step's
  (within STATE_TOL) and every other slot bitwise untouched (the padding rows' slot is the
  cache's padding slot).
- `generate`: 16 greedy requests x 32 tokens through an engine with CUDA graphs and one without:
  sequences equal (ok: at least 90%: a bf16 near-tie may part two ways) and log-prob difference.
- `throughput`: decode tok/s eager vs CUDA graphs at batch 1, 8 and 64 (32-token prompts, 128
  new tokens, greedy, EOS ignored; the timed run after a warm-up run, both engines in this process).
- `fp8`: quantization = "fp8" against bf16, both with CUDA graphs: teacher-forced logits of 4 x 64
  tokens (ok: relative error < 0.1 and top-1 agreement > 0.8, the FP8 engine tests' bounds; KL
  reported) and decode tok/s at batch 64.
- `dsa_topk`: ops/topk.topk_first (GLM-5's indexer selection) against the stable sort it replaces
  (scores with exact ties at the k-th value, a causal -inf tail): the same selection (ok), and
  the time of each and of plain torch.topk, 64 queries x context 4k/16k/64k, k = 2048.

--smoke: a tiny model on CPU in float32, the paged kernels under Triton's interpreter and the
graphs' static batches run eagerly (no capture: that needs CUDA); it checks this script.
Exits non-zero if a section fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before triton is imported: the paged kernels run under the interpreter on CPU
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.engine.w1 import _time_ms, environment, free_gpu, sync  # noqa: E402
from bench.results import write_result  # noqa: E402

LOGPROB_TOL = 0.1  # bf16: the graph's padded GEMMs against the eager batch's (logits std ~4)
STATE_TOL = 0.05  # float32 SSM states after one bf16 step, max abs
GAP = 0.1  # rows whose eager top-2 log-prob gap is below this may pick either token
PATTERN = "MEM*EM"


def model_config(smoke: bool) -> Any:
    from services.common.config import ModelConfig, load_config

    if smoke:
        return ModelConfig(
            arch="nemotron_h", vocab_size=64, dim=32, n_layers=6, hybrid_pattern=PATTERN, n_heads=4,
            n_kv_heads=2, head_dim=16, hidden_dim=48, max_seq_len=256, qk_norm=False,
            tie_embeddings=False, norm_eps=1e-5, mamba_n_heads=4, mamba_head_dim=8, ssm_state_size=8,
            mamba_n_groups=2, mamba_chunk_size=8, n_routed_experts=8, n_experts_per_tok=2,
            moe_hidden_dim=16, n_shared_experts=1, shared_expert_hidden_dim=24,
            routed_scaling_factor=2.5, router_score="sigmoid", norm_topk_prob=True, expert_bias=True,
        )  # fmt: skip
    m = load_config("nemotron3").model
    return m.model_copy(update={"n_layers": len(PATTERN), "hybrid_pattern": PATTERN, "max_seq_len": 2048})


def publish(m: Any, dest: Path, device: torch.device, dtype: torch.dtype) -> Path:
    """Random weights (the trainer's init) as an HF directory."""
    from trainer.model import build_model, save_weights_dir

    # The output matrix redrawn so that logits have a std of ~4 (the final norm's output has RMS
    # 1): next-token distributions neither flat nor one-hot, so agreement checks mean something.
    model = build_model(m, seed=0, device=device, init_std=4 / m.dim**0.5)
    state = {k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()}
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return save_weights_dir(m, state, dest / "step_0", {"version": 0})


class Setup:
    def __init__(self, smoke: bool, path: Path, m: Any):
        self.smoke, self.path, self.m = smoke, path, m
        self.device = torch.device("cpu" if smoke else "cuda")
        self.max_batch = 8 if smoke else 64
        self.cache: dict[tuple[Any, ...], Any] = {}  # idle engines the sections share

    def shared(self, graphs: bool, quantization: str = "none") -> Any:
        """An idle engine of this kind, built once (a weight load and a graph capture each)."""
        key = (graphs, quantization)
        if key not in self.cache:
            self.cache[key] = self.engine(graphs, quantization=quantization)
        return self.cache[key]

    def engine(self, graphs: bool, **kw: Any) -> Any:
        from services.common.config import EngineConfig
        from services.engine import LLMEngine
        from services.engine.cuda_graphs import DecodeGraphs

        cfg = EngineConfig(
            device=self.device.type,
            dtype="float32" if self.smoke else "bfloat16",
            max_batch_size=self.max_batch,
            max_seq_len=min(1024, self.m.max_seq_len),
            block_size=16,
            attention_backend="triton",
            cuda_graphs=graphs,
            cuda_graph_max_batch_size=self.max_batch,
            **kw,
        )
        eng = LLMEngine(self.path, cfg)
        if graphs and self.smoke:  # no capture on CPU: the graphs' static batches, run eagerly
            eng.graphs = DecodeGraphs(eng.model, eng.kv, self.max_batch, eng.num_sms, eng.device)
        if graphs and eng.graphs is None:
            raise RuntimeError("CUDA graph capture failed (the engine log names the error)")
        if not graphs:
            assert eng.graphs is None
        return eng

    def prompts(self, n: int, length: int, seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        hi = self.m.vocab_size
        return [torch.randint(3, hi, (length + (i * 7) % 13,), generator=g).tolist() for i in range(n)]


def graph_step(s: Setup) -> dict[str, Any]:
    from services.common.schemas import GenerateRequest, SamplingParams
    from services.engine.batch import HostBatch, Span, StateMeta

    out: dict[str, Any] = {"tolerances": {"logprob": LOGPROB_TOL, "state": STATE_TOL, "gap": GAP}}
    ok = True
    for n in (5, 37) if not s.smoke else (3, 5):
        eng = s.engine(True, overlap_schedule=False)
        graphs, states = eng.graphs, eng.kv.states
        for i, p in enumerate(s.prompts(n, 40, seed=n)):
            eng.add_request(GenerateRequest(input_ids=p, sampling=SamplingParams(seed=i, max_tokens=64)))
        while eng.num_waiting or any(q.num_cached < len(q.prompt) for q in eng.scheduler.running):
            eng.step()
        plan = eng.scheduler.schedule()
        spans = [
            Span(q.block_table, q.num_cached, q.uncached_tokens()[:k], q.state_slot) for q, k in plan.compute
        ]
        hb = HostBatch.build(spans, eng.kv.block_size, eng.block_tables)
        if not (hb.decode_only and len(spans) == n):
            raise RuntimeError(f"expected a decode step of {n} rows, got {len(spans)} spans")
        used = sorted(hb.state_slots.tolist())
        other = [i for i in range(states.slots) if i not in used]
        real = list(range(states.slots))
        g = torch.Generator(device=s.device).manual_seed(0)
        # Distinct states in every slot the step does not hold: a stray write shows.
        states.conv[:, other] = torch.randn(states.conv[:, other].shape, generator=g, device=s.device).to(
            states.conv.dtype
        )
        states.ssm[:, other] = torch.randn(states.ssm[:, other].shape, generator=g, device=s.device)
        snap = states.conv.clone(), states.ssm.clone()

        def restore(states: Any = states, snap: tuple[torch.Tensor, torch.Tensor] = snap) -> None:
            states.conv.copy_(snap[0])
            states.ssm.copy_(snap[1])

        with torch.inference_mode():
            batch = hb.to_forward_batch(eng.device, s.m.n_kv_heads, eng.num_sms)
            batch.state = StateMeta.build(spans, eng.device)
            eager = eng.model.logits(eng.model(batch, eng.kv)[batch.last_index]).float()
            eager_states = states.conv.clone(), states.ssm.clone()
            restore()
            replay = graphs.run(hb).float().clone()
            replay_states = states.conv.clone(), states.ssm.clone()
            restore()
            static = graphs.body(*graphs.last_key)[:n].float()
            static_states = states.conv.clone(), states.ssm.clone()
        lp_e, lp_r = eager.log_softmax(-1), replay.log_softmax(-1)
        top2 = lp_e.topk(2, -1).values
        decisive = (top2[:, 0] - top2[:, 1]) > GAP
        tok_e, tok_r = lp_e.argmax(-1), lp_r.argmax(-1)
        picked = lp_r.gather(1, tok_e[:, None])[:, 0] - lp_e.gather(1, tok_e[:, None])[:, 0]
        r: dict[str, Any] = {
            "rows": n,
            "graph_size": int(graphs.last_key[0]),
            "ragged_work_list": bool(graphs.last_key[1]),
            # Every slot but the padding one (padding rows read no KV: their values are arbitrary).
            "replay_equals_static_eager": bool(
                torch.equal(replay, static)
                and all(
                    torch.equal(a[:, real], b[:, real])
                    for a, b in zip(replay_states, static_states, strict=True)
                )
            ),
            "tokens_equal_eager": f"{int((tok_e == tok_r).sum())}/{n}",
            "decisive_rows_equal": bool((tok_e == tok_r)[decisive].all()),
            "logprob_max_abs_diff": float(picked.abs().max()),
            "state_max_abs_diff": max(
                float((a[:, used].float() - b[:, used].float()).abs().max())
                for a, b in zip(replay_states, eager_states, strict=True)
            ),  # fmt: skip
            "other_slots_untouched": all(
                torch.equal(a[:, other], b[:, other]) for a, b in zip(replay_states, snap, strict=True)
            ),
        }
        r["ok"] = (
            r["replay_equals_static_eager"]
            and r["decisive_rows_equal"]
            and r["logprob_max_abs_diff"] < LOGPROB_TOL
            and r["state_max_abs_diff"] < STATE_TOL
            and r["other_slots_untouched"]
        )
        ok = ok and r["ok"]
        out[f"n={n}"] = r
        del eng, graphs, states
        free_gpu()
    out["ok"] = ok
    return out


def generate(s: Setup) -> dict[str, Any]:
    from services.common.schemas import GenerateRequest, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=32 if not s.smoke else 6, ignore_eos=True)
    reqs = [GenerateRequest(input_ids=p, sampling=greedy) for p in s.prompts(16 if not s.smoke else 4, 30, 1)]
    res = {}
    for graphs in (True, False):
        res[graphs] = s.shared(graphs).generate(reqs)
    pairs = list(zip(res[True], res[False], strict=True))
    same = sum(a.choices[0].output_ids == b.choices[0].output_ids for a, b in pairs)
    diffs = []
    for a, b in pairs:  # over each pair's common prefix (the same context)
        for x, y, lx, ly in zip(
            a.choices[0].output_ids, b.choices[0].output_ids, a.choices[0].logprobs, b.choices[0].logprobs,
            strict=False,
        ):  # fmt: skip
            diffs.append(abs(lx - ly))
            if x != y:
                break
    out = {
        "sequences_equal": f"{same}/{len(reqs)}",
        "logprob_max_abs_diff_common_prefix": max(diffs),
    }
    out["ok"] = same >= 0.9 * len(reqs)
    return out


def throughput(s: Setup) -> dict[str, Any]:
    from services.common.schemas import GenerateRequest, SamplingParams

    new = 128 if not s.smoke else 4
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    out: dict[str, Any] = {"prompt_tokens": 32, "new_tokens": new}
    for graphs in (False, True):
        eng = s.shared(graphs)
        name = "graphs" if graphs else "eager"
        out[name] = {}
        for b in (1, 8, 64) if not s.smoke else (1, 4):
            reqs = [GenerateRequest(input_ids=p, sampling=params) for p in s.prompts(b, 32, b)]
            eng.generate(reqs[: min(b, 2)])  # warm-up (first-call costs, allocator)
            sync()
            t0 = time.perf_counter()
            done = eng.generate(reqs)
            sync()
            dt = time.perf_counter() - t0
            toks = sum(len(r.choices[0].output_ids) for r in done)
            out[name][f"batch={b}"] = {"tok_s": round(toks / dt, 1), "seconds": round(dt, 3)}
        del eng
    s.cache.pop((False, "none"), None)  # the eager engine is done with
    free_gpu()
    out["speedup"] = {k: round(out["graphs"][k]["tok_s"] / out["eager"][k]["tok_s"], 2) for k in out["eager"]}
    out["ok"] = True  # a measurement; the correctness is graph_step's and generate's
    return out


def dsa_topk(s: Setup) -> dict[str, Any]:
    from ops.topk import topk_first

    k = 2048 if not s.smoke else 64
    rows = 64 if not s.smoke else 4
    out: dict[str, Any] = {"k": k, "queries": rows}
    ok = True
    for ctx in (4096, 16384, 65536) if not s.smoke else (256,):
        g = torch.Generator(device=s.device).manual_seed(ctx)
        # An indexer's scores: ReLU sums (about half exactly 0), a few distinct positive values so
        # the k-th one ties, and the causal tail of each query masked.
        scores = torch.randint(0, 5, (rows, ctx), generator=g, device=s.device).float() * 0.5
        scores[torch.rand(rows, ctx, generator=g, device=s.device) < 0.5] = 0.0
        visible = (
            torch.arange(ctx, device=s.device)[None, :]
            < torch.linspace(ctx // 2, ctx, rows, device=s.device).long()[:, None]
        )
        scores = scores.masked_fill(~visible, float("-inf"))

        def stable(scores: torch.Tensor = scores) -> torch.Tensor:
            return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]

        def mask(top: torch.Tensor, scores: torch.Tensor = scores) -> torch.Tensor:
            return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)

        same = bool(torch.equal(mask(stable()), mask(topk_first(scores, k))))
        r: dict[str, Any] = {"same_selection": same}
        for name, fn in (
            ("stable_sort_ms", stable),
            ("topk_first_ms", lambda scores=scores: topk_first(scores, k)),
            ("plain_topk_ms", lambda scores=scores: scores.topk(k, -1, sorted=False).indices),
        ):
            r[name] = round(_time_ms(fn, 20 if not s.smoke else 3), 4)
        r["speedup_vs_sort"] = round(r["stable_sort_ms"] / r["topk_first_ms"], 2)
        out[f"ctx={ctx}"] = r
        ok = ok and same
    out["ok"] = ok
    return out


def prefill_logits(eng: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Every position's logits [B, L, vocab] (float32) of rows of tokens, each prefilled in one
    eager paged step on an idle engine's pages and state slots (the scheduler resets both when it
    hands them out later)."""
    from services.engine.batch import HostBatch, Span, StateMeta

    bs = eng.kv.block_size
    pages = -(-tokens.shape[1] // bs)
    spans = [
        Span(list(range(i * pages, (i + 1) * pages)), 0, row.tolist(), i) for i, row in enumerate(tokens)
    ]
    with torch.inference_mode():
        batch = HostBatch.build(spans, bs).to_forward_batch(
            eng.device, eng.model_config.n_kv_heads, eng.num_sms
        )
        batch.state = StateMeta.build(spans, eng.device)
        return eng.model.logits(eng.model(batch, eng.kv)).float().view(*tokens.shape, -1)


def fp8(s: Setup) -> dict[str, Any]:
    """quantization = "fp8" (attention, Mamba-2 in/out, MLP and expert linears; docs/fp8.md)
    against bf16, both with CUDA graphs: teacher-forced logits of 4 x 64 tokens (relative error,
    KL, top-1 agreement) and decode tok/s at the largest batch."""
    from services.common.schemas import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, s.m.vocab_size, (4, 64), generator=g)
    new = 128 if not s.smoke else 4
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    reqs = [GenerateRequest(input_ids=p, sampling=params) for p in s.prompts(s.max_batch, 32, 3)]
    out: dict[str, Any] = {}
    logits: dict[str, torch.Tensor] = {}
    for q in ("none", "fp8"):
        eng = s.shared(True, q)
        logits[q] = prefill_logits(eng, tokens).cpu().double()
        eng.generate(reqs[:2])  # warm-up
        sync()
        t0 = time.perf_counter()
        done = eng.generate(reqs)
        sync()
        toks = sum(len(r.choices[0].output_ids) for r in done)
        out[f"tok_s_batch{s.max_batch}_{'bf16' if q == 'none' else q}"] = round(
            toks / (time.perf_counter() - t0), 1
        )
        del eng
        s.cache.pop((True, q))
        free_gpu()
    lr, lf = logits["none"], logits["fp8"]
    lp_r, lp_f = lr.log_softmax(-1), lf.log_softmax(-1)
    out |= {
        "logits_rel_err": float((lf - lr).norm() / lr.norm()),
        "kl_bf16_fp8": float((lp_r.exp() * (lp_r - lp_f)).sum(-1).mean()),
        "top1_agreement": float((lr.argmax(-1) == lf.argmax(-1)).double().mean()),
    }
    # The bounds of the FP8 engine tests (tests/test_fp8_linear.py's MoE decoder).
    out["ok"] = out["logits_rel_err"] < 0.1 and out["top1_agreement"] > 0.8
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script)")
    ap.add_argument("--only", default="", help="comma-separated sections (default: all)")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("nemotron_gpu.py needs a CUDA device (or --smoke for the CPU check of the script)")
    m = model_config(args.smoke)
    s_dev = torch.device("cpu" if args.smoke else "cuda")
    result: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": environment(s_dev),
        "baseline": "the same model and engine in this process: eager decode steps (cuda_graphs off) "
        "for the graphs; the stable sort for the DSA top-k",
        "model": {
            "pattern": m.hybrid_pattern,
            "dim": m.dim,
            "vocab": m.vocab_size,
            "experts": m.n_routed_experts,
            "top_k": m.n_experts_per_tok,
            "mamba_heads": m.mamba_n_heads,
            "ssm_state": m.ssm_state_size,
            "dtype": "float32" if args.smoke else "bfloat16",
        },  # fmt: skip
    }
    sections: dict[str, Callable[[Setup], dict[str, Any]]] = {
        "graph_step": graph_step,
        "generate": generate,
        "throughput": throughput,
        "dsa_topk": dsa_topk,
        "fp8": fp8,
    }
    only = [x for x in args.only.split(",") if x]
    unknown = set(only) - set(sections)
    if unknown:
        sys.exit(f"--only: unknown sections {sorted(unknown)} (known: {sorted(sections)})")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = publish(m, Path(tmp), s_dev, torch.float32 if args.smoke else torch.bfloat16)
        result["publish_s"] = round(time.perf_counter() - t0, 1)
        setup = Setup(args.smoke, path, m)
        for name, fn in sections.items():
            if only and name not in only:
                continue
            t0 = time.perf_counter()
            try:
                result[name] = fn(setup)
            except Exception:  # noqa: BLE001 - record it and run the next section
                result[name] = {"ok": False, "error": traceback.format_exc()[-4000:]}
            result[name]["seconds"] = round(time.perf_counter() - t0, 1)
            if setup.device.type == "cuda":  # a leak of a deleted engine would show here
                result[name]["gpu_gib_allocated_after"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            write_result(args.out, result)
            print(f"[nemotron_gpu] {name}: ok={result[name]['ok']}", flush=True)
    failed = [k for k in sections if k in result and not result[k]["ok"]]
    if failed:
        print(f"[nemotron_gpu] FAILED: {failed} (details in {args.out})", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
