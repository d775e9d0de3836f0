"""The same model, engine, environments and loss as a relay run, but in ONE process with no
HTTP, Redis or staleness: the baseline the distributed pipeline's learning speed is compared to.

    python bench/calibration/inprocess.py --env reverse --steps 150 --out /tmp/inprocess-reverse.json
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

from services.common.config import EngineConfig, load_config
from services.common.schemas import GenerateRequest, RolloutGroup, Sample, SamplingParams
from services.common.tokenizer import eos_id, load_tokenizer
from services.engine import LLMEngine
from services.orchestrator.credit import ActionSpan, group_token_advantages
from services.orchestrator.rollout import group_advantages
from services.sandbox.envs import get_env_class, load_plugins
from trainer.model import build_model, save_weights_dir
from trainer.parallel import parallelize
from trainer.train import Dist, Trainer


def episode(
    env_name: str,
    seed: int,
    engine: LLMEngine,
    tok,
    eos: int,
    g: int,
    max_tokens: int,
    std_norm: bool,
    token_credit: bool = False,
) -> RolloutGroup:
    envs = [get_env_class(env_name)() for _ in range(g)]
    prompt = [e.reset(seed) for e in envs][0]
    ids = tok.encode(prompt).ids
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=g, seed=seed)
    (resp,) = engine.generate([GenerateRequest(input_ids=ids, sampling=sp)])
    trajs = [(list(ids), [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)) for _ in range(g)]
    spans: list[list[ActionSpan]] = [[] for _ in range(g)]
    active = list(range(g))
    choices = {i: resp.choices[i] for i in range(g)}
    rewards = [0.0] * g
    while active:
        nxt = []
        for i in active:
            c = choices[i]
            t = trajs[i]
            ended = bool(c.output_ids) and c.output_ids[-1] == eos
            spans[i].append(ActionSpan(len(t[0]), len(c.output_ids) - int(ended), ended))
            t[0].extend(c.output_ids), t[1].extend([1] * len(c.output_ids))
            t[2].extend(c.logprobs), t[3].extend(c.versions)
            obs, done = envs[i].step(tok.decode(c.output_ids[:-1] if ended else c.output_ids), ended)
            if done:
                r = envs[i].score()
                rewards[i] = r[0] if isinstance(r, tuple) else r
                continue
            o = tok.encode(obs).ids
            t[0].extend(o), t[1].extend([0] * len(o)), t[2].extend([0.0] * len(o)), t[3].extend([-1] * len(o))
            nxt.append(i)
        if nxt:
            reqs = [
                GenerateRequest(input_ids=trajs[i][0], sampling=sp.model_copy(update={"n": 1, "seed": None}))
                for i in nxt
            ]
            for i, r in zip(nxt, engine.generate(reqs), strict=True):
                choices[i] = r.choices[0]
        active = nxt
    advantages = group_advantages(rewards, std_norm)
    per_token = None
    if token_credit:
        credits = [e.credit() for e in envs]
        masks = [t[1] for t in trajs]
        per_token = group_token_advantages(tok, [t[0] for t in trajs], spans, credits, advantages, masks)
    samples = [
        Sample(
            rollout_id=f"{seed}.{i}",
            tokens=t[0],
            loss_mask=t[1],
            logprobs=t[2],
            versions=t[3],
            reward=r,
            advantage=a,
            token_advantages=None if per_token is None else per_token[i],
        )
        for i, (t, r, a) in enumerate(zip(trajs, rewards, advantages, strict=True))
    ]
    return RolloutGroup(group_id=str(seed), env=env_name, seed=seed, samples=samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", action="append", required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--out", default="")
    ap.add_argument("--plugin", action="append", default=[], help="module registering extra envs")
    ap.add_argument(
        "--set", action="append", default=[], help="config override, e.g. --set=--trainer.lr=5e-4"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_plugins(args.plugin)
    cfg = load_config("debug", args.set)
    tc, o = cfg.trainer, cfg.orchestrator
    model = build_model(cfg.model, seed=cfg.run.seed, init_std=tc.init_std)
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
        engine = LLMEngine(
            d, EngineConfig(device="cpu", max_batch_size=512, max_seq_len=256, torch_threads=2)
        )
        tok = load_tokenizer(d)
        groups = [
            episode(
                args.env[i % len(args.env)],
                rng.randrange(1 << 31),
                engine,
                tok,
                eos_id(tok),
                o.group_size,
                o.sampling.max_tokens,
                o.advantage_std_norm,
                o.advantage == "token",
            )
            for i in range(args.prompts)
        ]
        # The trainer's own step (same batching, loss, clipping and optimizer as a run).
        res = trainer.train_step(groups)
        by_env = {}
        for g in groups:
            by_env.setdefault(g.env, []).append(g.mean_reward)
        rec = {
            "step": step,
            "reward_by_env": {k: sum(v) / len(v) for k, v in by_env.items()},
            "entropy": res.entropy,
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
            Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
