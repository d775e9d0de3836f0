"""Rollout groups of verifiers environments: the sandbox runs the environment's own rollouts
against decode's OpenAI API (services/sandbox/verifiers_host.py); this module turns what comes
back into training samples with the same exact token accounting as relay's own environments.

A rollout is a list of turns, each as decode saw it: prompt ids, completion ids, their log-probs
and weight versions. verifiers' token client builds each later turn's prompt as the previous
turn's prompt + completion ids + the new messages' tokens, so the sample is

    turn 1 prompt (mask 0) | completion 1 (mask 1) | new tokens of turn 2's prompt (mask 0) | ...

and every sampled token is trained exactly as the engine produced it. A turn whose prompt does
not extend the sample so far (verifiers fell back to re-rendering the messages, e.g. after a
turn cut by max_tokens) cannot continue one sequence: the sample ends before it with
finish_reason "template_mismatch", as relay's own chat environments do.
"""

from __future__ import annotations

from services.common.config import RunConfig
from services.common.schemas import (
    RolloutGroup,
    SamplingParams,
    VerifiersGroupRequest,
    VerifiersRollout,
)
from services.orchestrator.clients import DecodeClient, SandboxClient
from services.orchestrator.rollout import GroupSpec, Trajectory, group_advantages, sample_id


def stitch(rollout: VerifiersRollout) -> Trajectory | None:
    """One rollout's turns as one token sequence (None: no turn reached the model)."""
    if not rollout.turns:
        return None
    first = rollout.turns[0]
    traj = Trajectory.start(first.prompt_ids)
    traj.finish_reason = "done"
    for i, t in enumerate(rollout.turns):
        if i:
            n = len(traj.tokens)
            if t.prompt_ids[:n] != traj.tokens:
                traj.finish_reason = "template_mismatch"
                break
            traj.add_env(t.prompt_ids[n:])
        traj.tokens += t.completion_ids
        traj.mask += [1] * len(t.completion_ids)
        traj.logprobs += t.completion_logprobs
        traj.versions += t.versions
        traj.turns += 1
    else:
        if rollout.error is not None:
            traj.finish_reason = "error"
        elif rollout.turns[-1].truncated:
            traj.finish_reason = "length"
    return traj


async def run_verifiers_group(
    cfg: RunConfig,
    decode: DecodeClient,
    sandbox: SandboxClient,
    sampling: SamplingParams,
    spec: GroupSpec,
) -> RolloutGroup:
    o = cfg.orchestrator
    g = o.group_size
    # The whole group on one replica: its turns share the prompt's KV pages in its prefix cache.
    url = await decode.router.pick()
    decode.router.outstanding[url] += g
    try:
        req = VerifiersGroupRequest(
            seed=spec.seed, n=g, decode_url=url, model=cfg.run.name, sampling=sampling
        )
        timeout = o.rollout_timeout_s or 10 * o.request_timeout_s
        resp = await sandbox.verifiers_group(spec.env, req, timeout)
    finally:
        decode.router.outstanding[url] -= g
    if len(resp.rollouts) != g:
        raise ValueError(f"{spec.env}: the sandbox returned {len(resp.rollouts)} rollouts for a group of {g}")
    trajs = [stitch(r) for r in resp.rollouts]
    if all(t is None for t in trajs):
        errors = {r.error for r in resp.rollouts if r.error}
        raise ValueError(
            f"{spec.env}: no rollout reached the model ({'; '.join(sorted(errors)) or 'no turns'})"
        )
    rewards = [r.reward for r in resp.rollouts]
    advs = group_advantages(rewards, o.advantage_std_norm, o.baseline_prior)
    samples = []
    for i, (t, r, a) in enumerate(zip(trajs, rewards, advs, strict=True)):
        if t is None:  # a rollout that failed before its first turn has no tokens to train on
            continue
        samples.append(t.sample(sample_id(spec.group_id, i), r, a))
    return RolloutGroup(group_id=spec.group_id, env=spec.env, seed=spec.seed, samples=samples)
