"""One rollout group: G samples of one task, driven turn by turn against decode and the sandbox.

Token bookkeeping is exact: the sample's tokens are the prompt ids, then for each turn the ids
the engine produced (trained, mask 1) followed by the tokenised observation (mask 0). Model
output is never re-tokenised, so what the trainer scores is exactly what the engine sampled.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from services.common.config import RunConfig
from services.common.schemas import GenerateChoice, GenerateRequest, RolloutGroup, Sample, SamplingParams
from services.orchestrator.clients import DecodeClient, SandboxClient, SandboxSession, ServiceUnavailable


@dataclass
class GroupSpec:
    group_id: str
    env: str
    seed: int


@dataclass
class Trajectory:
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: int = 0
    finish_reason: str = "stop"
    decode_urls: set[str] = field(default_factory=set)

    @classmethod
    def start(cls, prompt_ids: list[int]) -> Trajectory:
        n = len(prompt_ids)
        return cls(list(prompt_ids), [0] * n, [0.0] * n, [-1] * n)

    def add_model(self, choice: GenerateChoice) -> None:
        self.tokens += choice.output_ids
        self.mask += [1] * len(choice.output_ids)
        self.logprobs += choice.logprobs
        self.versions += choice.versions
        self.turns += 1

    def add_env(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)


class RolloutRunner:
    def __init__(
        self, cfg: RunConfig, decode: DecodeClient, sandbox: SandboxClient, tok: Tokenizer, eos: int
    ):
        self.cfg = cfg
        self.decode = decode
        self.sandbox = sandbox
        self.tok = tok
        self.eos = eos
        o = cfg.orchestrator
        self.sampling = SamplingParams(
            temperature=o.sampling.temperature,
            top_p=o.sampling.top_p,
            top_k=o.sampling.top_k,
            max_tokens=o.sampling.max_tokens,
        )
        self.max_len = min(cfg.model.max_seq_len, cfg.decode.engine.max_seq_len)

    async def _generate(self, ids: list[int], n: int, seed: int | None) -> list[GenerateChoice]:
        """One turn's generation, re-issued on another replica if the serving one vanishes."""
        sampling = self.sampling.model_copy(update={"n": n, "seed": seed})
        req = GenerateRequest(input_ids=ids, sampling=sampling)
        deadline = time.monotonic() + self.cfg.orchestrator.request_timeout_s
        attempt = 0
        while True:
            try:
                _url, resp = await self.decode.generate(req)
                return resp.choices
            except ServiceUnavailable:
                # The replica vanished (the client dropped it from the routing cache); a
                # restarted or other replica picks the turn up from the same tokens.
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                attempt += 1

    def _budget_left(self, traj: Trajectory) -> int:
        return self.max_len - len(traj.tokens)

    async def _finish_sample(
        self, session: SandboxSession, traj: Trajectory, choice: GenerateChoice
    ) -> float:
        """Play the rest of one sample's episode after its first model turn; returns the reward."""
        while True:
            traj.add_model(choice)
            ended_eos = bool(choice.output_ids) and choice.output_ids[-1] == self.eos
            text_ids = choice.output_ids[:-1] if ended_eos else choice.output_ids
            step = await session.step(self.tok.decode(text_ids), eos=ended_eos)
            if step.done:
                traj.finish_reason = "done"
                if step.reward is not None:
                    return step.reward
                break
            if traj.turns >= self.cfg.orchestrator.max_turns:
                traj.finish_reason = "max_turns"
                break
            obs_ids = self.tok.encode(step.observation).ids
            if self._budget_left(traj) < len(obs_ids) + self.sampling.max_tokens:
                traj.finish_reason = "context"
                break
            traj.add_env(obs_ids)
            (choice,) = await self._generate(traj.tokens, 1, None)
        return (await session.score()).reward

    async def run(self, spec: GroupSpec) -> RolloutGroup:
        g = self.cfg.orchestrator.group_size
        sessions = await self.sandbox.open_group(spec.env, spec.seed, g)
        try:
            prompt_ids = self.tok.encode(sessions[0].prompt).ids
            if len(prompt_ids) + self.sampling.max_tokens > self.max_len:
                raise ValueError(f"{spec.env} prompt of {len(prompt_ids)} tokens exceeds the context budget")
            # The first turn shares one prompt: one request with n samples lets decode prefill once.
            seed = zlib.crc32(f"{spec.group_id}:{spec.seed}".encode())
            first = await self._generate(prompt_ids, g, seed)
            trajs = [Trajectory.start(prompt_ids) for _ in range(g)]
            rewards = await asyncio.gather(
                *(self._finish_sample(s, t, c) for s, t, c in zip(sessions, trajs, first, strict=True))
            )
        finally:
            await asyncio.gather(*(s.close() for s in sessions))
        advantages = group_advantages(rewards, self.cfg.orchestrator.advantage_std_norm)
        samples = [
            Sample(
                rollout_id=f"{spec.group_id}.{i}",
                tokens=t.tokens,
                loss_mask=t.mask,
                logprobs=t.logprobs,
                versions=t.versions,
                reward=r,
                advantage=a,
                turns=t.turns,
                finish_reason=t.finish_reason,
            )
            for i, (t, r, a) in enumerate(zip(trajs, rewards, advantages, strict=True))
        ]
        return RolloutGroup(group_id=spec.group_id, env=spec.env, seed=spec.seed, samples=samples)


def group_advantages(rewards: list[float], std_norm: bool) -> list[float]:
    mean = sum(rewards) / len(rewards)
    adv = [r - mean for r in rewards]
    if not std_norm:
        return adv
    std = (sum(a * a for a in adv) / len(adv)) ** 0.5
    # Below 1e-6 the group is (numerically) constant: no signal, not a huge one.
    return [a / std if std > 1e-6 else 0.0 for a in adv]


def render_sample(sample: Sample, tok: Tokenizer) -> list[dict[str, object]]:
    """Split a sample into prompt / model / env segments with their text, for humans."""
    segments: list[dict[str, object]] = []
    start = 0
    seen_model = False
    for i in range(1, len(sample.tokens) + 1):
        if i == len(sample.tokens) or sample.loss_mask[i] != sample.loss_mask[start]:
            ids = sample.tokens[start:i]
            trained = bool(sample.loss_mask[start])
            role = "model" if trained else ("env" if seen_model else "prompt")
            seen_model = seen_model or trained
            seg: dict[str, object] = {
                "role": role,
                "text": tok.decode(ids, skip_special_tokens=False),
                "tokens": ids,
                "trained": trained,
            }
            if trained:
                seg["logprobs"] = sample.logprobs[start:i]
                seg["versions"] = sample.versions[start:i]
            segments.append(seg)
            start = i
    return segments
