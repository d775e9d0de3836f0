"""The same model, engine, environments and loss as a relay run, but in ONE process with no
HTTP or Redis: the baseline the distributed pipeline's learning speed is compared to. On-policy
by default; `--stale N` samples with the weights of N steps back (the pipeline trains most
samples one step stale), so the trainer's ratio band sees the same policy lag.

    python bench/calibration/inprocess.py --env reverse --steps 150 --out /tmp/inprocess-reverse.json
    python bench/calibration/inprocess.py --env reverse --env reverse --env reverse-turns --stale 1 --out /tmp/s.json
    python bench/calibration/inprocess.py ... --init-weights RUN_DIR/weights/step_200 --steps 60   # from a run's state
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench.results import write_result
from services.common.config import EngineConfig, load_config
from services.common.schemas import GenerateRequest, RolloutGroup, Sample, SamplingParams
from services.common.tokenizer import eos_id, load_tokenizer
from services.engine import LLMEngine
from services.orchestrator.credit import ActionSpan, group_token_advantages
from services.orchestrator.rollout import group_advantages
from services.sandbox.envs import get_env_class, load_plugins
from trainer.model import build_model, load_weights_dir, save_weights_dir
from trainer.parallel import parallelize
from trainer.train import Dist, Trainer


def episodes(
    specs: list[tuple[str, int]],
    engine: LLMEngine,
    tok,
    eos: int,
    g: int,
    max_tokens: int,
    std_norm: bool,
    token_credit: bool = False,
    prior: float = 0.0,
) -> list[RolloutGroup]:
    """One group of `g` samples per (env, seed), every group's turn generated in one engine call
    (a step's whole batch at once, as decode batches the pipeline's concurrent requests)."""
    n = len(specs)
    envs = [[get_env_class(name)() for _ in range(g)] for name, _ in specs]
    prompts = [[e.reset(seed) for e in es][0] for es, (_, seed) in zip(envs, specs, strict=True)]
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=g)
    first = engine.generate(
        [
            GenerateRequest(input_ids=tok.encode(p).ids, sampling=sp.model_copy(update={"seed": seed}))
            for p, (_, seed) in zip(prompts, specs, strict=True)
        ]
    )
    keys = [(k, i) for k in range(n) for i in range(g)]
    trajs = {}
    for k, p in enumerate(prompts):
        ids = tok.encode(p).ids
        for i in range(g):
            trajs[k, i] = (list(ids), [0] * len(ids), [0.0] * len(ids), [-1] * len(ids))
    spans: dict[tuple[int, int], list[ActionSpan]] = {key: [] for key in keys}
    choices = {(k, i): first[k].choices[i] for k, i in keys}
    rewards = dict.fromkeys(keys, 0.0)
    active = keys
    while active:
        nxt = []
        for key in active:
            c, t, env = choices[key], trajs[key], envs[key[0]][key[1]]
            ended = bool(c.output_ids) and c.output_ids[-1] == eos
            spans[key].append(ActionSpan(len(t[0]), len(c.output_ids) - int(ended), ended))
            t[0].extend(c.output_ids), t[1].extend([1] * len(c.output_ids))
            t[2].extend(c.logprobs), t[3].extend(c.versions)
            obs, done = env.step(tok.decode(c.output_ids[:-1] if ended else c.output_ids), ended)
            if done:
                r = env.score()
                rewards[key] = r[0] if isinstance(r, tuple) else r
                continue
            o = tok.encode(obs).ids
            t[0].extend(o), t[1].extend([0] * len(o)), t[2].extend([0.0] * len(o)), t[3].extend([-1] * len(o))
            nxt.append(key)
        if nxt:
            one = sp.model_copy(update={"n": 1, "seed": None})
            out = engine.generate([GenerateRequest(input_ids=trajs[key][0], sampling=one) for key in nxt])
            for key, r in zip(nxt, out, strict=True):
                choices[key] = r.choices[0]
        active = nxt
    groups = []
    for k, (env_name, seed) in enumerate(specs):
        ks = [(k, i) for i in range(g)]
        rw = [rewards[key] for key in ks]
        advantages = group_advantages(rw, std_norm, prior)
        per_token = None
        if token_credit:
            credits = [envs[k][i].credit() for i in range(g)]
            toks = [trajs[key][0] for key in ks]
            masks = [trajs[key][1] for key in ks]
            per_token = group_token_advantages(
                tok, toks, [spans[key] for key in ks], credits, advantages, masks, prior
            )
        samples = [
            Sample(
                rollout_id=f"{seed}.{i}",
                tokens=trajs[k, i][0],
                loss_mask=trajs[k, i][1],
                logprobs=trajs[k, i][2],
                versions=trajs[k, i][3],
                reward=rw[i],
                advantage=advantages[i],
                token_advantages=None if per_token is None else per_token[i],
            )
            for i in range(g)
        ]
        groups.append(RolloutGroup(group_id=str(seed), env=env_name, seed=seed, samples=samples))
    return groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", action="append", required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--out", default="")
    ap.add_argument("--plugin", action="append", default=[], help="module registering extra envs")
    ap.add_argument(
        "--stale",
        type=int,
        default=0,
        help="sample with the weights of this many steps ago (the pipeline trains mostly 1 step stale)",
    )
    ap.add_argument(
        "--set", action="append", default=[], help="config override, e.g. --set=--trainer.lr=5e-4"
    )
    ap.add_argument(
        "--init-weights",
        default="",
        help="start from this weights directory (e.g. a run's weights/step_200) instead of the "
        "seeded init: recipes compared from one late-phase state (the optimizer starts fresh)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_plugins(args.plugin)
    cfg = load_config("debug", args.set)
    tc, o = cfg.trainer, cfg.orchestrator
    model = build_model(cfg.model, seed=cfg.run.seed, init_std=tc.init_std)
    if args.init_weights:
        model.load_state_dict(load_weights_dir(args.init_weights)[1])
    tmp = Path(tempfile.mkdtemp())
    rng = random.Random(0)
    # No Redis is reached: train_step only uses the model, optimizer and process group.
    trainer = Trainer(cfg, tmp, "redis://127.0.0.1:1/0", d=Dist("cpu"))
    # The trainer's own model path (no FSDP on one CPU process), so train_step sees what it expects.
    trainer.model, trainer.degrees, trainer.meshes = parallelize(model, tc, 1, torch.device("cpu"), False)
    trainer.opt = torch.optim.AdamW(
        trainer.model.parameters(), lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay
    )
    hist = []
    t_start = time.time()
    for step in range(1, args.steps + 1):
        d = save_weights_dir(cfg.model, model.state_dict(), tmp / f"step_{step}", {"version": step - 1})
        # --stale N: the samples come from the weights N steps back, as in the asynchronous
        # pipeline; the trainer's ratio band then sees the same policy lag.
        d = tmp / f"step_{max(1, step - args.stale)}"
        engine = LLMEngine(
            d, EngineConfig(device="cpu", max_batch_size=512, max_seq_len=256, torch_threads=1)
        )
        tok = load_tokenizer(d)
        specs = [(args.env[i % len(args.env)], rng.randrange(1 << 31)) for i in range(args.prompts)]
        groups = episodes(
            specs,
            engine,
            tok,
            eos_id(tok),
            o.group_size,
            o.sampling.max_tokens,
            o.advantage_std_norm,
            o.advantage == "token",
            o.baseline_prior,
        )
        # The trainer's own step (same batching, loss, clipping and optimizer as a run).
        res = trainer.train_step(groups)
        by_env = {}
        for g in groups:
            by_env.setdefault(g.env, []).append(g.mean_reward)
        rec = {
            "step": step,
            "reward_by_env": {k: sum(v) / len(v) for k, v in by_env.items()},
            "entropy": res.entropy,
            "entropy_coef": res.entropy_coef,
            "masked_ratio_frac": res.masked_ratio_frac,
            "grad_norm": res.grad_norm,
            "mismatch_kl_k3": res.mismatch.get("mismatch_kl_k3", 0.0),
            "s": round(time.time() - t_start, 1),
        }
        hist.append(rec)
        print(json.dumps(rec), flush=True)
        if args.out and (step % 10 == 0 or step == args.steps):
            # Rewritten every 10 steps, so a run cut by a time limit keeps its curve so far.
            out = {
                "command": " ".join(sys.argv),
                "machine": f"{platform.node()} ({platform.processor() or platform.machine()}, "
                f"{torch.get_num_threads()} threads)",
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "config": f"configs/debug.toml trainer + sampling settings, overrides {args.set}",
                "baseline": "the plain in-process loop is itself the baseline of the distributed pipeline",
                "wall_s": time.time() - t_start,
                "steps_done": step,
                "history": hist,
            }
            write_result(args.out, out)


if __name__ == "__main__":
    main()
