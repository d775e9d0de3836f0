"""Why a debug run learns as it does, from its weight directories (RUN_DIR/weights/step_N).

    python -m bench.calibration.diagnose positions RUN_DIR 100 144 --out positions.json
    python -m bench.calibration.diagnose ratio-band RUN_DIR 100 130 --out ratio_band.json
    python -m bench.calibration.diagnose fates RUN_DIR --out fates.json      # a run in progress

positions: for each of the 125 `reverse` words, the policy's probability of the right token and
its entropy at each answer position (3 letters, then EOS) given the right prefix, and which
(word, position) pairs are stuck (p(right) < 0.05: a group of 16 then rarely holds a right sample,
so the group baseline gives the position almost no signal).

ratio-band: samples groups with the weights of step N-1 (one step stale, as the pipeline trains
most samples), credits them as the run does, and counts the loss tokens the trainer's ratio band
[ratio_low, ratio_high] masks under step N's weights, by the sign of their advantage and by the
side they leave on: "restoring" (a right token whose probability fell, a wrong one whose rose: PPO
would keep their gradient) or "trust region" (the policy already moved their way).

fates: from the rollout browser (GET /v1/rollouts) of a running run, its groups by task and fate
(trained, dropped, pending) with their mean reward and length.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import random
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from bench.calibration.inprocess import episodes
from bench.results import dumps, write_result
from services.common.config import EngineConfig, load_resolved
from services.common.tokenizer import eos_id, load_tokenizer
from services.engine import LLMEngine
from trainer.loss import token_logprobs
from trainer.model import build_model, load_weights_dir

STUCK_P = 0.05


def load_policy(path: Path) -> torch.nn.Module:
    m, state = load_weights_dir(path)
    model = build_model(m, seed=0)
    model.load_state_dict(state)
    return model.eval()


def positions(weights: Path) -> dict[str, Any]:
    tok = load_tokenizer(weights)
    eos = eos_id(tok)
    model = load_policy(weights)
    rows = []
    for w in ("".join(p) for p in itertools.product("abcde", repeat=3)):
        prompt = tok.encode(f"rev {w}:").ids
        answer = [*tok.encode(w[::-1]).ids, eos]
        with torch.no_grad():
            logp = model(torch.tensor([prompt + answer[:-1]]))[0].float().log_softmax(-1)
        for j, right in enumerate(answer):
            lp = logp[len(prompt) - 1 + j]
            p = lp.exp()
            rows.append(
                {
                    "word": w,
                    "pos": j,
                    "p_right": float(p[right]),
                    "entropy": float(-(p * lp).sum()),
                    "top": tok.decode([int(p.argmax())], skip_special_tokens=False),
                }
            )

    def per_pos(key: str) -> list[float]:
        return [round(sum(r[key] for r in rows if r["pos"] == j) / 125, 4) for j in range(4)]

    stuck = [r for r in rows if r["p_right"] < STUCK_P]
    return {
        "weights": str(weights),
        "p_right": per_pos("p_right"),
        "entropy": per_pos("entropy"),
        "greedy_right": [
            round(
                sum(
                    r["top"] == r["word"][::-1][j]
                    if j < 3
                    else r["top"] == tok.decode([eos], skip_special_tokens=False)
                    for r in rows
                    if r["pos"] == j
                )
                / 125,
                4,
            )
            for j in range(4)
        ],  # fmt: skip
        "stuck": len(stuck),
        "stuck_entropy_mean": round(sum(r["entropy"] for r in stuck) / len(stuck), 4) if stuck else None,
        "stuck_examples": [{k: r[k] for k in ("word", "pos", "p_right", "top")} for r in stuck[:20]],
    }


def ratio_band(run: Path, version: int, groups: int, rng: random.Random) -> dict[str, Any]:
    cfg = load_resolved(run / "config.json")
    tc, o = cfg.trainer, cfg.orchestrator
    old = run / "weights" / f"step_{version - 1}"
    engine = LLMEngine(old, EngineConfig(device="cpu", max_batch_size=512, max_seq_len=256))
    tok = load_tokenizer(old)
    mix = [t.env for t in o.tasks for _ in range(round(t.weight))]
    specs = [(mix[i % len(mix)], rng.randrange(1 << 31)) for i in range(groups)]
    batch = episodes(specs, engine, tok, eos_id(tok), o.group_size, o.sampling.max_tokens, False, True)
    model = load_policy(run / "weights" / f"step_{version}")
    kinds = {k: {"tokens": 0, "abs_adv": 0.0} for k in ("restoring", "trust_region")}
    signs = {k: {"tokens": 0, "masked": 0} for k in ("right", "wrong", "zero")}
    total_abs = 0.0
    for g in batch:
        for s in g.samples:
            with torch.no_grad():
                lp, _ = token_logprobs(model, torch.tensor([s.tokens]))
            adv = s.advantages_per_token()
            for t in range(1, len(s.tokens)):
                if not s.loss_mask[t]:
                    continue
                a = adv[t]
                r = float(torch.exp(lp[0, t - 1] - s.logprobs[t]))
                sign = "right" if a > 1e-9 else "wrong" if a < -1e-9 else "zero"
                masked = not tc.ratio_low <= r <= tc.ratio_high
                signs[sign]["tokens"] += 1
                signs[sign]["masked"] += masked
                total_abs += abs(a)
                if masked and sign != "zero":
                    fell = r < tc.ratio_low
                    kind = "restoring" if (sign == "right") == fell else "trust_region"
                    kinds[kind]["tokens"] += 1
                    kinds[kind]["abs_adv"] += abs(a)
    return {
        "version": version,
        "masked_frac_by_sign": {k: round(v["masked"] / max(1, v["tokens"]), 4) for k, v in signs.items()},
        "masked_share_of_abs_advantage": {k: round(v["abs_adv"] / max(1e-9, total_abs), 4) for k, v in kinds.items()},
        "masked_tokens": {k: v["tokens"] for k, v in kinds.items()},
    }  # fmt: skip


def fates(run: Path) -> dict[str, Any]:
    """Every group the rollout log lists (GET /v1/rollouts of the running run), counted by task
    and fate, with mean reward and length: are the groups dropped as stale a random share?"""
    import httpx

    from sbatch.launch import _run_bus
    from services.common.auth import bearer, load_run_secrets

    got = _run_bus(run)
    if got is None:
        raise SystemExit(f"{run}: no Redis yet")
    _cfg, bus = got
    (orch,) = bus.services("orchestrator")
    headers = bearer(load_run_secrets(run).token)
    rows: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 500, **({"cursor": cursor} if cursor else {})}
        page = httpx.get(f"{orch.url}/v1/rollouts", params=params, headers=headers, timeout=60).json()
        rows += page["rollouts"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    out: dict[str, Any] = {}
    for r in rows:
        key = f"{r['task']} {r['status']}"
        e = out.setdefault(key, {"groups": 0, "reward": 0.0, "length": 0.0})
        e["groups"] += 1
        e["reward"] += r["reward"] or 0.0
        e["length"] += r["length"]
    for e in out.values():
        e["reward"] = round(e["reward"] / e["groups"], 4)
        e["length"] = round(e["length"] / e["groups"], 2)
    return {"run": str(run), "groups": len(rows), "by_task_and_fate": dict(sorted(out.items()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["positions", "ratio-band", "fates"])
    ap.add_argument("run", type=Path, help="a run directory (RUN_DIR; fates: of a run in progress)")
    ap.add_argument("steps", type=int, nargs="*")
    ap.add_argument("--groups", type=int, default=32, help="ratio-band: groups sampled per step")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    if args.what == "positions":
        results = [positions(args.run / "weights" / f"step_{n}") for n in args.steps]
    elif args.what == "fates":
        results = [fates(args.run)]
    else:
        results = [ratio_band(args.run, n, args.groups, rng) for n in args.steps]
    doc = {
        "command": " ".join(["python -m bench.calibration.diagnose", *sys.argv[1:]]),
        "machine": f"{platform.node()} ({platform.machine()}, 1 torch thread)",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "baseline": "positions: the same run's earlier steps; ratio-band: the trainer's own band",
        "results": results,
    }
    if args.out:
        write_result(args.out, doc)
    print(dumps(doc), end="")


if __name__ == "__main__":
    main()
