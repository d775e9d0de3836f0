"""Multi-turn log-prob check: does the engine's log-prob of a token it sampled in a later turn of
an episode agree with a from-scratch scoring of the whole transcript, by the engine and by the
trainer? One JSON out.

    python3 bench/engine/multiturn_check.py --out $OUT/multiturn.json          # one GPU, ~2 minutes
    python bench/engine/multiturn_check.py --smoke --out /tmp/multiturn.json   # CPU, tiny MoE

The model: configs/models/qwen3-30b-a3b-2l.toml (full width, 2 layers), the trainer's random
init (trainer.model.build_model), published as version 0 by trainer.publish.Publisher as the
trainer publishes for its engines (bf16; FP8-quantized for a variant with an FP8 engine) (--smoke: a tiny MoE). Episodes run through one LLMEngine
the way the orchestrator runs them (a group's first turn one request of n = --group-size samples
sharing the prompt's pages, each later turn a request of its own) (services/orchestrator/rollout.py's Trajectory): all episodes
start together, and each time a turn finishes its next turn is submitted at once while the other
episodes decode (so later turns are prefilled in mixed steps, from the prefix cache when on):
turn k+1's input_ids = turn k's input + its sampled tokens + an observation (random ids). Sampling
as configs/system-moe.toml: temperature 1, up to --max-tokens tokens a turn (each turn a random
length, EOS ignored, so episodes drift apart), Router Replay routing returned.

Per sampled token three log-probs:
- `engine`: what the engine returned while sampling (what the trainer gets as logp_infer);
- `scratch`: the same engine, the whole transcript prefilled from position 0 in one eager step
  on fresh pages (no prefix cache, no CUDA graph, no decode kernel);
- `trainer`: the trainer's model scoring the samples as train_step does (trainer.batch
  micro-batches of right-padded rows, Router Replay on the engine's recorded experts,
  packed_logprobs under the trainer's autocast, FP8 via trainer.fp8's converter when the variant
  has fp8); `trainer_alone`: the same, each sample a micro-batch of its own.
Per turn index and overall: tokens, max |delta logp| and the mean k3 KL (exp(r) - 1 - r with
r = logp_other - logp_engine, the trainer's mismatch KL) for engine-vs-scratch,
engine-vs-trainer, scratch-vs-trainer and trainer_alone-vs-trainer. A defect in the multi-turn engine path (cached pages,
prefill chunks at nonzero positions, mixed steps, graphs) shows as engine-vs-scratch growing past
turn 1 while scratch-vs-trainer stays flat; a transcript the trainer scores differently from what
the engine saw shows in scratch-vs-trainer.

Variants (--variants, comma-separated; each `+`-joined): `cache`/`nocache`
(enable_prefix_caching), `graphs`/`nographs` (cuda_graphs, with mixed-step graphs), `fp8`/`bf16`
(engine quantization and the trainer's FP8 recipe), `torchattn` (the engine's torch attention
instead of its Triton kernels). Each variant builds its own engine and
samples its own episodes (same seeds).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# bench.r3.replay, imported before services/ and trainer/, installs the carried wheels (.whl/)
# into /tmp/site on the GPU machine when torchtitan or pydantic is missing
import torch  # noqa: E402

from bench.machine import machine  # noqa: E402
from bench.r3.replay import (  # noqa: E402
    build_trainer_model,
    engine_threads,
    free,
    model_toml,
    single_process,
    tiny_moe,
)
from bench.results import write_result  # noqa: E402
from services.common.config import EngineConfig, ModelConfig, TrainerSection  # noqa: E402
from services.common.schemas import GenerateRequest, Sample, SamplingParams  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.batch import ForwardBatch, HostBatch, Span  # noqa: E402
from services.engine.cuda_graphs import MixedGraphs  # noqa: E402
from services.engine.overlap import Feed  # noqa: E402
from services.orchestrator.rollout import Trajectory  # noqa: E402
from trainer.attention import micro_batch_attention, packed_logprobs  # noqa: E402
from trainer.batch import micro_batches, plan_micro_batches  # noqa: E402
from trainer.chunked import enable_chunked_output  # noqa: E402
from trainer.parallel import autocast_context  # noqa: E402
from trainer.publish import Publisher  # noqa: E402
from trainer.replay import enable_router_replay, micro_batch_routes, routing  # noqa: E402

SWITCHES: dict[str, tuple[str, Any]] = {
    "cache": ("cache", True),
    "nocache": ("cache", False),
    "graphs": ("graphs", True),
    "nographs": ("graphs", False),
    "fp8": ("fp8", True),
    "bf16": ("fp8", False),
    "fp8engine": ("fp8", "engine"),  # the engine's FP8 only (CPU: the trainer's FP8 needs CUDA)
    "torchattn": ("attention", "torch"),  # CUDA: the torch attention instead of the Triton kernels
    "triton": ("attention", "triton"),  # CPU: the Triton kernels under TRITON_INTERPRET=1
    # CPU with triton: mixed steps run eagerly on the padded static batch a mixed-step CUDA graph
    # is captured on (cuda_graphs.MixedBuffers)
    "static": ("static", True),
}


def parse_variant(name: str, cuda: bool) -> dict[str, Any]:
    v: dict[str, Any] = {"cache": True, "graphs": cuda, "fp8": cuda, "attention": "auto", "static": False}
    for part in name.split("+"):
        if part not in SWITCHES:
            raise SystemExit(f"--variants: unknown switch {part!r} in {name!r} (one of {sorted(SWITCHES)})")
        key, val = SWITCHES[part]
        v[key] = val
    return v


def run_episodes(
    eng: LLMEngine, m: ModelConfig, args: argparse.Namespace
) -> tuple[list[Sample], list[list[int]]]:
    """Episodes as the orchestrator runs them: the samples, and per sample the turn index (1-based)
    of each token (0: prompt or observation). A group's first turn is one request of n =
    --group-size samples sharing the prompt's pages; each later turn is a request of its own."""
    rng = random.Random(args.seed)
    vocab = m.vocab_size
    g = args.group_size
    trajs: list[Trajectory] = []
    turn_of: list[list[int]] = []
    pending: dict[str, list[int]] = {}  # request id -> its episodes, in choice order

    def submit(episodes: list[int]) -> None:
        traj = trajs[episodes[0]]
        params = SamplingParams(
            n=len(episodes),
            temperature=1.0,
            max_tokens=rng.randint(max(1, args.max_tokens // 2), args.max_tokens),
            ignore_eos=True,
            seed=rng.randrange(2**31),
        )
        req = GenerateRequest(
            input_ids=list(traj.tokens),
            sampling=params,
            request_id=f"ep{episodes[0]}-t{traj.turns + 1}",
            return_routed_experts=m.is_moe,
        )
        pending[eng.add_request(req).request_id] = episodes

    for first in range(0, args.episodes, g):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
        group = list(range(first, min(first + g, args.episodes)))
        for _ in group:
            trajs.append(Trajectory.start(prompt))
            turn_of.append([0] * len(prompt))
        submit(group)
    while pending:
        for state in eng.step():
            episodes = pending.pop(state.request_id)
            for i, choice in zip(episodes, state.response().choices, strict=True):
                traj = trajs[i]
                traj.add_model(choice)
                turn_of[i] += [traj.turns] * len(choice.output_ids)
                if traj.turns < args.turns:
                    obs = [rng.randrange(1, vocab) for _ in range(rng.randint(args.obs_min, args.obs_max))]
                    traj.add_env(obs)
                    turn_of[i] += [0] * len(obs)
                    submit([i])
    samples = [t.sample(f"mt-{i}", reward=0.0, advantage=0.0) for i, t in enumerate(trajs)]
    return samples, turn_of


class EagerMixed(MixedGraphs):
    """Mixed steps on the padded fixed-shape batch a captured mixed-step graph runs on, run
    eagerly (no capture: CPU under the Triton interpreter), as test_engine_kernels checks it."""

    steps = 0  # mixed steps run on the static batch

    def capture(self, pool: object | None = None) -> None:
        return None

    def run(self, hb: HostBatch, feed: Feed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        (size, ragged), last = self.load(hb, feed)
        self.steps += 1
        return self.model(self.buf.static_batch(size, ragged), self.kv), last


@torch.inference_mode()
def scratch_logprobs(eng: LLMEngine, s: Sample) -> list[float]:
    """The engine's log-prob of every token given all before it (index t: token t; 0.0 at t=0):
    the whole transcript prefilled from position 0 in one eager step of the engine's own forward
    (its runner's, graphs off), on pages 0.. of an idle engine."""
    runner = eng.runner
    runner.graphs = runner.mixed_graphs = None  # eager; the engine is not stepped again
    pages = -(-len(s.tokens) // eng.kv.block_size)
    spans = [Span(list(range(pages)), 0, list(s.tokens))]
    if eng.attention_backend == "torch":
        batch = ForwardBatch.build(spans, eng.device, eng.kv.max_seq_len, eng.kv.block_size)
        hidden = eng.model(batch, eng.kv)
    else:
        hidden, _ = runner._forward(HostBatch.build(spans, eng.kv.block_size), spans, None)
    logits = eng.model.logits(hidden).float()
    tokens = torch.tensor(s.tokens, device=logits.device)
    lp = torch.log_softmax(logits[:-1], -1).gather(1, tokens[1:, None])[:, 0]
    return [0.0, *lp.tolist()]


@torch.no_grad()
def trainer_logprobs(
    model: torch.nn.Module,
    m: ModelConfig,
    samples: list[Sample],
    tc: TrainerSection,
    device: torch.device,
    replay: bool,
) -> list[list[float]]:
    """The trainer's log-prob of every token of each sample (index t: token t; 0.0 at t=0), as
    train_step computes them: trainer.batch's micro-batches (rows right-padded, longest first),
    the routes aligned with them, packed_logprobs under the trainer's autocast."""
    budget = tc.micro_batch_tokens
    plans = plan_micro_batches([len(s.tokens) for s in samples], budget)  # micro_batches' plans
    mbs = micro_batches(samples, budget)
    routes = micro_batch_routes(samples, m, packing=False, token_budget=budget)
    out: list[list[float]] = [[] for _ in samples]
    for plan, mb, route in zip(plans, mbs, routes, strict=True):
        mb = mb.to(device)
        route = route.to(device) if route is not None else None
        with routing(model, route, replay), micro_batch_attention(model, mb):
            with autocast_context(tc, device, False):
                logp, _ = packed_logprobs(model, mb, tc.logprob_chunk_tokens)
        for row, i in enumerate(plan):
            out[i] = [0.0, *logp[row, : len(samples[i].tokens) - 1].float().tolist()]
    return out


def compare(ref: list[float], other: list[float]) -> dict[str, Any]:
    if not ref:
        return {"tokens": 0}
    r = torch.tensor(other, dtype=torch.float64) - torch.tensor(ref, dtype=torch.float64)
    k3 = torch.exp(r) - 1 - r
    return {
        "tokens": len(ref),
        "max_abs_dlogp": float(r.abs().max()),
        "mean_abs_dlogp": float(r.abs().mean()),
        "kl_k3": float(k3.mean()),
    }


def tables(
    samples: list[Sample], turn_of: list[list[int]], lps: dict[str, list[list[float]]]
) -> dict[str, Any]:
    """Per turn index and overall: each pair's comparison over the sampled tokens."""
    pairs = (
        ("engine", "scratch"),
        ("engine", "trainer"),
        ("scratch", "trainer"),
        ("trainer_alone", "trainer"),
    )
    buckets: dict[int, dict[str, list[float]]] = {}
    for i, s in enumerate(samples):
        for t, turn in enumerate(turn_of[i]):
            if not turn:
                continue
            assert s.loss_mask[t] == 1, "a sampled token outside the loss mask"
            b = buckets.setdefault(turn, {k: [] for k in lps})
            for k, v in lps.items():
                b[k].append(v[i][t])
    keys = ["all", "turn1", "turn2+", *map(str, sorted(buckets))]
    out: dict[str, Any] = {}
    for key in keys:
        if key == "all":
            sel = list(buckets)
        elif key == "turn1":
            sel = [1]
        elif key == "turn2+":
            sel = [k for k in buckets if k > 1]
        else:
            sel = [int(key)]
        got = {k: [x for j in sel if j in buckets for x in buckets[j][k]] for k in lps}
        out[key] = {f"{a}_vs_{b}": compare(got[a], got[b]) for a, b in pairs if a in got and b in got}
        # how peaked the sampled distributions are: a flat one hides any mismatch
        out[key]["engine_logp_mean"] = sum(got["engine"]) / max(len(got["engine"]), 1)
    return out


def run_variant(
    name: str,
    v: dict[str, Any],
    args: argparse.Namespace,
    m: ModelConfig,
    model_dir: Path,
    device: torch.device,
) -> dict[str, Any]:
    cuda = device.type == "cuda"
    ecfg = EngineConfig(
        device=device.type,
        dtype="bfloat16",
        quantization="fp8" if v["fp8"] else "none",  # True or "engine"
        max_batch_size=args.episodes,
        max_seq_len=args.max_seq_len,
        enable_prefix_caching=v["cache"],
        cuda_graphs=v["graphs"],
        torch_threads=engine_threads(device),
        attention_backend=v["attention"],
    )
    t0 = time.perf_counter()
    eng = LLMEngine(model_dir, ecfg)
    out: dict[str, Any] = {
        "switches": v,
        "attention_backend": eng.attention_backend,
        "cuda_graphs": eng.graphs is not None,
        "mixed_graphs": eng.mixed_graphs is not None,
        "engine_load_s": round(time.perf_counter() - t0, 1),
    }
    if v["static"]:
        r, c = eng.runner, eng.cfg
        r.mixed_graphs = EagerMixed(
            r.model,
            r.kv,
            c.max_num_batched_tokens,
            min(c.max_batch_size, c.cuda_graph_max_batch_size),
            c.cuda_graph_max_prefill_spans,
            r.num_sms,
            r.device,
        )
    t0 = time.perf_counter()
    samples, turn_of = run_episodes(eng, m, args)
    out["episodes_s"] = round(time.perf_counter() - t0, 1)
    if isinstance(eng.runner.mixed_graphs, EagerMixed):
        out["mixed_static_steps"] = eng.runner.mixed_graphs.steps
    out["prefix_hit_tokens"] = eng.stats.prefix_cache_hit_tokens
    out["transcript_tokens"] = [len(s.tokens) for s in samples]
    engine_lp = [list(s.logprobs) for s in samples]
    # after the episodes: the scratch prefill writes pages from 0 up, over whatever the cache held
    scratch = [scratch_logprobs(eng, s) for s in samples]
    del eng
    free()
    tc = TrainerSection(
        device=device.type,
        dtype="bfloat16",
        fp8=v["fp8"] is True,
        router_replay=not args.no_replay,
        micro_batch_tokens=16384,
    )
    model = build_trainer_model(m, args.init, args.seed, device)
    enable_chunked_output(model, tc.logits_fp32, tc.head_cache_gib)
    enable_router_replay(model)
    if tc.fp8:
        from trainer.fp8 import Fp8BlockwiseConverter

        Fp8BlockwiseConverter(fp8_dgrad=False, fp8_wgrad=False, min_weights=tc.fp8_min_weights).convert(model)
    model = single_process(model, tc, device)
    trainer = trainer_logprobs(model, m, samples, tc, device, not args.no_replay)
    # each sample a micro-batch of its own: a difference from the batched rows is the trainer's
    alone = [trainer_logprobs(model, m, [s], tc, device, not args.no_replay)[0] for s in samples]
    del model
    free()
    out["by_turn"] = tables(
        samples,
        turn_of,
        {"engine": engine_lp, "scratch": scratch, "trainer": trainer, "trainer_alone": alone},
    )
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    return out


def headline(result: dict[str, Any]) -> dict[str, Any]:
    rows = {}
    for name, v in result.get("variants", {}).items():
        bt = v.get("by_turn") if isinstance(v, dict) else None
        if not bt:
            rows[name] = "error"
            continue
        rows[name] = {
            part: {
                pair: (c.get("kl_k3"), c.get("max_abs_dlogp"))
                for pair, c in bt[part].items()
                if isinstance(c, dict)
            }
            for part in ("turn1", "turn2+")
            if part in bt
        }
    return {"kl_k3_and_max_abs_dlogp": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny MoE (CPU)")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cuda or cpu")
    ap.add_argument(
        "--variants",
        default=None,
        help="comma-separated; CUDA default cache+graphs+fp8,nocache+graphs+fp8,cache+nographs+fp8,"
        "cache+graphs+bf16; CPU default cache+bf16,nocache+bf16",
    )
    ap.add_argument("--model", default="qwen3-30b-a3b-2l", help="configs/models/<name>.toml")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8, help="samples of a first turn (request n)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompt-min", type=int, default=20)
    ap.add_argument("--prompt-max", type=int, default=60)
    ap.add_argument("--obs-min", type=int, default=4)
    ap.add_argument("--obs-max", type=int, default=20)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--no-replay", action="store_true", help="trainer on its own routing")
    ap.add_argument(
        "--init",
        default="trainer",
        help="trainer (the system run's), hf or peaked (logits of std ~4: no flat distributions)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.smoke:
        args.episodes, args.turns, args.group_size = (
            min(args.episodes, 6),
            min(args.turns, 4),
            min(args.group_size, 3),
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    want = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(want)
    cuda = device.type == "cuda"
    variants = args.variants or (
        "cache+graphs+fp8,nocache+graphs+fp8,cache+nographs+fp8,cache+graphs+bf16"
        if cuda
        else "cache+bf16,nocache+bf16"
    )
    m = tiny_moe() if args.smoke else model_toml(args.model)
    m = m.model_copy(update={"max_seq_len": args.max_seq_len})
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": str(device),
        "torch": torch.__version__,
        "machine": machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "baseline": "in each variant's process: the same engine prefilling each whole transcript "
        "from position 0 (scratch) and the trainer's scoring of the same samples",
        "model": m.model_dump(include={"arch", "dim", "n_layers", "n_routed_experts", "vocab_size"}),
        "variants": {},
    }
    names = [s.strip() for s in variants.split(",") if s.strip()]
    switches = {name: parse_variant(name, cuda) for name in names}
    with tempfile.TemporaryDirectory(prefix="multiturn-") as tmp:
        # as train.py publishes for its engines: in the engines' dtype and quantization (an FP8
        # engine loads the trainer's quantized weights)
        dirs = {
            q: Path(tmp) / f"step_0_{q}" for q in {"fp8" if v["fp8"] else "none" for v in switches.values()}
        }
        t0 = time.perf_counter()
        model = build_trainer_model(m, args.init, args.seed, device)
        result["publish"] = {}
        for q, d in dirs.items():
            pub = Publisher(m, dtype=torch.bfloat16, quantization=q)  # type: ignore[arg-type]
            pub.publish(model, 0, d, background=False)
            result["publish"][q] = {"bytes": pub.last.bytes if pub.last else None}
            del pub
        del model
        free()
        result["publish"]["build_and_publish_s"] = round(time.perf_counter() - t0, 1)
        for name, v in switches.items():
            t0 = time.perf_counter()
            try:
                result["variants"][name] = run_variant(
                    name, v, args, m, dirs["fp8" if v["fp8"] else "none"], device
                )
            except Exception:  # noqa: BLE001 - one failed variant must not lose the others
                result["variants"][name] = {"switches": v, "error": traceback.format_exc()[-4000:]}
            result["variants"][name]["variant_s"] = round(time.perf_counter() - t0, 1)
            free()
            result["headline"] = headline(result)
            write_result(args.out, result, default=str)
            print(name, json.dumps(result["headline"]["kl_k3_and_max_abs_dlogp"].get(name)), flush=True)
    ok = all("error" not in v for v in result["variants"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
