"""The debug model's step costs on this CPU, for the capacity plan of `configs/debug.toml`.

    python bench/plan/cpu_rates.py --out bench/plan/results/cpu_rates.json

Measured in one process with the run's own engine and trainer code (no HTTP, Redis or envs):
  - decode: one engine step over a full batch of the debug run's rollouts (batch_size x group_size
    sequences of the `reverse` prompt length, `sampling.max_tokens` new tokens each, EOS ignored),
    at the debug config's engine settings: seconds per engine step;
  - train: the trainer's `train_step` on a batch of that many samples of the config's mean
    rollout length (`plan.rollout_tokens`, `plan.generated_tokens` of them in the loss): seconds
    per trained token.
Each is the median of `--reps` repetitions after a warm-up. The capacity plan (sbatch/plan.py)
reads both from the result file named in configs/plan/rates.toml.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.results import write_result  # noqa: E402
from services.common.config import load_config  # noqa: E402
from services.common.schemas import GenerateRequest, RolloutGroup, Sample, SamplingParams  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from trainer.model import build_model, save_weights_dir  # noqa: E402
from trainer.parallel import parallelize  # noqa: E402
from trainer.train import Dist, Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="debug")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=8, help="the reverse task's prompt length")
    args = ap.parse_args()
    cfg = load_config(args.config)
    o, ec, tc = cfg.orchestrator, cfg.decode.engine, cfg.trainer
    torch.set_num_threads(ec.torch_threads)
    rollouts = o.batch_size * o.group_size
    new = o.sampling.max_tokens
    tmp = Path(tempfile.mkdtemp())
    model = build_model(cfg.model, seed=cfg.run.seed, init_std=tc.init_std)
    d = save_weights_dir(cfg.model, model.state_dict(), tmp / "step_0", {"version": 0})
    engine = LLMEngine(d, ec)
    prompt = [5 + i % 50 for i in range(args.prompt_tokens)]

    def decode_once() -> tuple[float, int]:
        reqs = [
            GenerateRequest(
                input_ids=prompt,
                sampling=SamplingParams(max_tokens=new, ignore_eos=True, n=o.group_size, seed=i),
            )
            for i in range(o.batch_size)
        ]
        states = [engine.add_request(r) for r in reqs]
        steps = 0
        t0 = time.perf_counter()
        while not all(s.finished for s in states):
            engine.step()
            steps += 1
        return time.perf_counter() - t0, steps

    decode_once()
    dec = [decode_once() for _ in range(args.reps)]
    step_s = statistics.median(w / s for w, s in dec)

    trainer = Trainer(cfg, tmp, "redis://127.0.0.1:1/0", d=Dist("cpu"))
    trainer.model, trainer.degrees, trainer.meshes = parallelize(model, tc, 1, torch.device("cpu"), False)
    trainer.opt = torch.optim.AdamW(trainer.model.parameters(), lr=tc.lr, betas=tc.betas)
    length = round(cfg.plan.rollout_tokens)
    gen = round(cfg.plan.generated_tokens)
    tokens = [5 + i % 50 for i in range(length - gen)] + [7] * gen
    groups = [
        RolloutGroup(
            group_id=str(g),
            env="reverse",
            seed=g,
            samples=[
                Sample(
                    rollout_id=f"{g}.{i}",
                    tokens=tokens,
                    loss_mask=[0] * (length - gen) + [1] * gen,
                    logprobs=[0.0] * (length - gen) + [-1.0] * gen,
                    versions=[-1] * (length - gen) + [0] * gen,
                    reward=float(i % 2),
                    advantage=float(i % 2) - 0.5,
                )
                for i in range(o.group_size)
            ],
        )
        for g in range(o.batch_size)
    ]
    trainer.train_step(groups)
    train = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        trainer.train_step(groups)
        train.append(time.perf_counter() - t0)
    train_s = statistics.median(train)
    out = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
        f"torch threads {torch.get_num_threads()}",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        # Other work on the machine slows both rates alike; the load says how busy it was.
        "load_average_1m": os.getloadavg()[0],
        "baseline": "none: these are the inputs of the plan, checked against a measured debug run "
        "(bench/plan/README.md)",
        "config": args.config,
        "workload": {
            "rollouts": rollouts,
            "decode": {"prompt_tokens": args.prompt_tokens, "new_tokens": new},
            "train": {"sample_tokens": length, "loss_tokens": gen},
        },
        "decode": {
            "step_s": step_s,
            "runs": [{"wall_s": w, "steps": s} for w, s in dec],
        },
        "train": {
            "step_s": train_s,
            "tokens": rollouts * length,
            "s_per_token": train_s / (rollouts * length),
            "runs_s": train,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, out)
    print(json.dumps({"decode_step_s": step_s, "train_step_s": train_s}))


if __name__ == "__main__":
    main()
