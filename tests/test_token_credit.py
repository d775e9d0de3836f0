"""Token credit (orchestrator.advantage = "token"): environments' per-character credit, checked
by the sandbox, placed on model tokens by the orchestrator with a per-position group baseline,
and used token by token by the trainer's batching and loss."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from test_agent_budgets import EOS, TOK, budget_cfg, budget_sandbox, committed, run_groups  # noqa: F401
from tokenizers import Tokenizer, decoders, models

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.schemas import GenerateRequest, Sample
from services.orchestrator.credit import ActionSpan, char_bounds, group_token_advantages, token_credit
from services.orchestrator.rollout import render_sample
from services.sandbox.envs.base import EnvError, normalize_credit, positional_credit, positional_score
from services.sandbox.envs.reverse import Reverse, ReverseTurns
from trainer.batch import collate, truncate
from trainer.loss import ratio_loss
from trainer.packing import pack


def test_positional_credit_adds_up_to_the_score() -> None:
    assert positional_credit("cba", "cba", True) == [1.0, 1.0, 1.0, 1.0]
    assert positional_credit("caa", "cba", True) == [1.0, 0.0, 1.0, 1.0]
    assert positional_credit("cbaa", "cba", True) == [1.0, 1.0, 1.0, 0.0, 0.0]  # too long
    assert positional_credit("cb", "cba", False) == [1.0, 1.0, 0.0]  # cut, and too short
    for action, eos in [("cba", True), ("caa", True), ("cbaa", True), ("cb", False), ("", True)]:
        c = positional_credit(action, "cba", eos)
        assert sum(c) / 4 == positional_score(action, "cba", eos)


def test_reverse_envs_give_credit_per_turn() -> None:
    env = Reverse()
    env.reset(3)
    assert env.credit() == []  # no turn taken yet
    target = env.target
    env.step(target[0] + "x" + target[2], True)
    assert env.credit() == [[1.0, float(target[1] == "x"), 1.0, 1.0]]
    multi = ReverseTurns()
    multi.reset(5)
    multi.step(multi.words[0][::-1], True)
    multi.step("", False)
    assert multi.credit() == [[1.0, 1.0, 1.0, 1.0], [0.0]]
    assert multi.score()[0] == pytest.approx(4 / 4 / 3)


def test_normalize_credit_names_the_env_and_what_is_wrong() -> None:
    assert normalize_credit("e", None, [3]) is None
    assert normalize_credit("e", [[1, 0, 1, 1]], [3]) == [[1.0, 0.0, 1.0, 1.0]]
    with pytest.raises(EnvError, match=r"env 'e': credit\(\) gave 2 turn\(s\), the episode has 1"):
        normalize_credit("e", [[1.0], [1.0]], [0])
    with pytest.raises(EnvError, match="turn 0 has 2 values, expected 4"):
        normalize_credit("e", [[1.0, 1.0]], [3])
    with pytest.raises(EnvError, match="outside"):
        normalize_credit("e", [[1.0, 1.5]], [1])


def test_char_bounds_line_tokens_up_with_the_action() -> None:
    ids = TOK.encode("cba").ids
    assert char_bounds(TOK, ids, "cba") == [1, 2, 3]
    bpe = Tokenizer(
        models.BPE(vocab={"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4}, merges=[("a", "b"), ("ab", "c")])
    )
    bpe.decoder = decoders.Fuse()
    ids = bpe.encode("abcab").ids
    assert ids == [4, 3] and char_bounds(bpe, ids, "abcab") == [3, 5]
    # a multi-character token gets the mean credit of its characters
    placed = token_credit(bpe, [0, *ids], [ActionSpan(1, 2, False)], [[1.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    assert placed == {(0, 0): (1, pytest.approx(2 / 3)), (0, 1): (2, 1.0)}


def test_group_token_advantages_per_position_baseline() -> None:
    prompt = TOK.encode("rev abc:").ids
    answers = [("cba", True), ("caa", True), ("cb", False)]
    credits = [[positional_credit(a, "cba", e)] for a, e in answers]
    tokens, spans, masks = [], [], []
    for a, e in answers:
        out = TOK.encode(a).ids + ([EOS] if e else [])
        tokens.append(prompt + out)
        spans.append([ActionSpan(len(prompt), len(a), e)])
        masks.append([0] * len(prompt) + [1] * len(out))
    seq_adv = [0.5, 0.0, -0.5]
    adv = group_token_advantages(TOK, tokens, spans, credits, seq_adv, masks)
    assert adv is not None
    n = len(prompt)
    assert all(a[:n] == [0.0] * n for a in adv)  # prompt tokens: no advantage
    # position 0 ('c'): right everywhere -> 0; position 1: 'b','a','b' -> 1 - 2/3, 0 - 2/3;
    # position 2: 'a','a' (the third sample has none) -> 0; position 3 (EOS): 1, 1 -> 0.
    assert adv[0][n:] == pytest.approx([0.0, 1 / 3, 0.0, 0.0])
    assert adv[1][n:] == pytest.approx([0.0, -2 / 3, 0.0, 0.0])
    assert adv[2][n:] == pytest.approx([0.0, 1 / 3])
    # no credit in the group: sequence advantages stay
    assert group_token_advantages(TOK, tokens, spans, [None] * 3, seq_adv, masks) is None
    # a rambling tail that no other sample reaches has no baseline: it keeps the sequence advantage
    long_ids = [*TOK.encode("cbaxy").ids, EOS]
    long_tokens = [tokens[0], prompt + long_ids]
    long_spans = [spans[0], [ActionSpan(n, 5, True)]]
    long_credit = [credits[0], [positional_credit("cbaxy", "cba", True)]]
    long_masks = [masks[0], [0] * n + [1] * len(long_ids)]
    tail = group_token_advantages(TOK, long_tokens, long_spans, long_credit, [0.5, -0.5], long_masks)
    assert tail is not None
    # 'x' shares position 3 with the first sample's EOS (credit 1): 0 - 1/2; 'y' and the late EOS
    # are alone at positions 4 and 5: the sample's sequence advantage
    assert tail[1][n:] == pytest.approx([0.0, 0.0, 0.0, -0.5, -0.5, -0.5])
    assert tail[0][n:] == pytest.approx([0.0, 0.0, 0.0, 0.5])
    # a sample without credit keeps its sequence advantage on every model token
    mixed = group_token_advantages(TOK, tokens, spans, [credits[0], credits[1], None], seq_adv, masks)
    assert mixed is not None and mixed[2][n:] == [-0.5, -0.5]


def test_baseline_prior_pushes_down_a_position_the_whole_group_got_wrong() -> None:
    # 'abc' -> 'cba'; every sample writes 'a' at position 2 (wrong: the answer has 'a' last), so
    # the plain per-position baseline gives it 0; with a prior of k full-credit samples it gets
    # -k / (n + k), and the position every sample got right (the first) keeps 0.
    prompt = TOK.encode("rev abc:").ids
    answers = ["caa", "caa", "cba", "caa"]
    credits = [[positional_credit(a, "cba", True)] for a in answers]
    tokens = [prompt + [*TOK.encode(a).ids, EOS] for a in answers]
    spans = [[ActionSpan(len(prompt), 3, True)] for _ in answers]
    masks = [[0] * len(prompt) + [1] * 4 for _ in answers]
    seq_adv = [0.0] * 4
    n, k = len(prompt), 2.0
    plain = group_token_advantages(TOK, tokens, spans, credits, seq_adv, masks)
    shifted = group_token_advantages(TOK, tokens, spans, credits, seq_adv, masks, prior=k)
    assert plain is not None and shifted is not None
    # positions: 'c' (all right), middle ('a' wrong x3, 'b' right x1), 'a' (right: 'cba'[2] == 'a'), EOS
    assert plain[0][n:] == pytest.approx([0.0, -1 / 4, 0.0, 0.0])
    assert shifted[0][n:] == pytest.approx([0.0, -(1 + k) / (4 + k), 0.0, 0.0])
    assert shifted[2][n:] == pytest.approx([0.0, 1 - (1 + k) / (4 + k), 0.0, 0.0])
    wrong = [[positional_credit("cbb", "cba", True)] for _ in answers]
    all_wrong_tokens = [prompt + [*TOK.encode("cbb").ids, EOS] for _ in answers]
    stuck = group_token_advantages(TOK, all_wrong_tokens, spans, wrong, seq_adv, masks, prior=k)
    assert stuck is not None
    assert stuck[1][n:] == pytest.approx([0.0, 0.0, -k / (4 + k), 0.0])


def sample(tokens: list[int], mask: list[int], adv: float, token_adv: list[float] | None) -> Sample:
    return Sample(
        rollout_id="r",
        tokens=tokens,
        loss_mask=mask,
        logprobs=[-1.0 * m for m in mask],
        versions=[0 if m else -1 for m in mask],
        reward=0.0,
        advantage=adv,
        token_advantages=token_adv,
    )


def test_trainer_batches_carry_token_advantages() -> None:
    a = sample([1, 2, 3, 4], [0, 1, 1, 1], 0.5, [0.0, 0.1, 0.2, 0.3])
    b = sample([5, 6, 7], [0, 1, 1], -0.5, None)
    mb = collate([a, b])
    assert mb.advantages.shape == (2, 3)
    assert mb.advantages[0].tolist() == pytest.approx([0.1, 0.2, 0.3])  # shifted like loss_mask
    assert mb.advantages[1].tolist() == pytest.approx([-0.5, -0.5, 0.0])  # padding: 0
    packed = pack([a, b])
    assert packed.advantages[0].tolist() == pytest.approx([0.1, 0.2, 0.3, -0.5, -0.5])
    assert truncate(a, 3).token_advantages == [0.0, 0.1, 0.2]
    with pytest.raises(ValueError, match="token_advantages must have one value per token"):
        sample([1, 2], [0, 1], 0.0, [0.0])


def loss_and_grad(
    logp: torch.Tensor, batch: list[Sample], total_loss_tokens: int
) -> tuple[float, torch.Tensor]:
    """ratio_loss of `batch` (collated) at the first len(batch) rows of `logp`, clipping off:
    (loss, its gradient with respect to the whole of `logp`)."""
    mb = collate(batch)
    loss, _ = ratio_loss(
        logp[: len(batch)],
        mb.logp_infer,
        mb.advantages,
        mb.loss_mask,
        ratio_low=0.0,
        ratio_high=1e9,
        total_loss_tokens=total_loss_tokens,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad


def test_loss_with_uniform_token_advantages_equals_sequence_loss() -> None:
    torch.manual_seed(0)
    seq = [sample([1, 2, 3, 4], [0, 1, 1, 1], 0.7, None), sample([1, 2, 3], [0, 1, 1], -0.2, None)]
    tok = [s.model_copy(update={"token_advantages": s.advantages_per_token()}) for s in seq]
    logp = torch.randn(2, 3, requires_grad=True)
    losses = [loss_and_grad(logp, batch, total_loss_tokens=5) for batch in (seq, tok)]
    assert losses[0][0] == pytest.approx(losses[1][0])
    assert torch.allclose(losses[0][1], losses[1][1])
    # and a per-token advantage moves only its own token's gradient
    one = [seq[0].model_copy(update={"token_advantages": [0.0, 0.0, 1.0, 0.0]})]
    _, grad = loss_and_grad(logp, one, total_loss_tokens=3)
    assert grad[0, 0] == 0 and grad[0, 2] == 0 and grad[0, 1] < 0


def test_sandbox_returns_checked_credit_over_http(budget_sandbox: object) -> None:  # noqa: F811
    url = budget_sandbox.url  # type: ignore[attr-defined]
    with httpx.Client(base_url=url, timeout=10, headers=auth_headers()) as c:
        created = c.post("/v1/sessions", json={"env": "reverse", "seed": 7}).json()
        sid = created["session_id"]
        env = Reverse()
        assert env.reset(7) == created["prompt"]
        r = c.post(
            f"/v1/sessions/{sid}/step?score=true&credit=true", json={"action": env.target[:2], "eos": True}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["done"] and body["credit"] == [[1.0, 1.0, 0.0]], body
        assert body["reward"] == pytest.approx(2 / 4)
        # not asked for: no credit (a run with sequence advantages never calls credit())
        sid = c.post("/v1/sessions", json={"env": "reverse", "seed": 7}).json()["session_id"]
        r = c.post(f"/v1/sessions/{sid}/step?score=true", json={"action": env.target, "eos": True})
        assert r.status_code == 200 and r.json()["credit"] is None and r.json()["reward"] == 1.0
        sid = c.post("/v1/sessions", json={"env": "reverse", "seed": 7}).json()["session_id"]
        c.post(f"/v1/sessions/{sid}/step", json={"action": env.target, "eos": True})
        scored = c.post(f"/v1/sessions/{sid}/score?credit=true").json()
        assert scored["credit"] == [[1.0, 1.0, 1.0, 1.0]]


async def reverse_policy(req: GenerateRequest) -> list[list[int]]:
    """The group's samples answer the word reversed, then with a wrong middle letter, then
    reversed but cut (no EOS): what token credit must tell apart."""
    word = TOK.decode(req.input_ids).split()[-1].rstrip(":")
    target = word[::-1]
    wrong_mid = target[0] + ("a" if target[1] != "a" else "b") + target[2]
    answers = [[*TOK.encode(target).ids, EOS], [*TOK.encode(wrong_mid).ids, EOS], TOK.encode(target).ids]
    return [answers[i % 3] for i in range(req.sampling.n)]


def token_credit_group(sandbox: object, redis_url: str, tmp: Path, env: str, policy: object) -> list[dict]:
    """One group of 3 through the orchestrator's own runner (token credit on) against the real
    sandbox process and a scripted decode over HTTP; returns the committed samples."""
    prefix = sandbox.prefix  # type: ignore[attr-defined]
    bus = Bus(redis_url, prefix)
    cfg = budget_cfg(redis_url, prefix, advantage="token", group_size=3)
    specs, _, _ = asyncio.run(run_groups(cfg, bus, tmp, [11], env=env, policy=policy, credit=True))  # type: ignore[arg-type]
    return committed(bus)[specs[0].group_id]["samples"]  # type: ignore[return-value]


def test_orchestrator_token_advantages_end_to_end(
    budget_sandbox: object,  # noqa: F811
    redis_server: str,
    tmp_path: Path,
) -> None:
    right, wrong, cut = token_credit_group(budget_sandbox, redis_server, tmp_path, "reverse", reverse_policy)
    assert [right["reward"], wrong["reward"], cut["reward"]] == pytest.approx([1.0, 0.75, 0.75])
    n = len(right["tokens"]) - 4
    # per position over the three samples: only the middle letter differs (right, wrong, right)
    assert right["token_advantages"][n:] == pytest.approx([0.0, 1 / 3, 0.0, 0.0])
    assert wrong["token_advantages"][n:] == pytest.approx([0.0, -2 / 3, 0.0, 0.0])
    assert cut["token_advantages"][n:] == pytest.approx([0.0, 1 / 3, 0.0])  # no EOS token, no end credit
    assert right["token_advantages"][:n] == [0.0] * n
    # sequence advantages are still recorded (reward - group mean)
    assert right["advantage"] == pytest.approx(1.0 - 2.5 / 3)


def test_rendered_transcript_shows_each_tokens_advantage() -> None:
    prompt = TOK.encode("rev abc:").ids
    out = [*TOK.encode("caa").ids, EOS]
    s = sample(prompt + out, [0] * len(prompt) + [1] * 4, 0.0, [0.0] * len(prompt) + [0.0, -0.6, 0.0, 0.0])
    prompt_seg, model_seg = render_sample(s, TOK)
    assert "advantages" not in prompt_seg and model_seg["advantages"] == [0.0, -0.6, 0.0, 0.0]
    assert model_seg["pieces"] == ["c", "a", "a", TOK.id_to_token(EOS)]
    # Sequence advantages: every model token shows the sample's one advantage.
    seq = s.model_copy(update={"token_advantages": None, "advantage": 0.25})
    assert render_sample(seq, TOK)[1]["advantages"] == [0.25] * 4


async def reverse_turns_policy(req: GenerateRequest) -> list[list[int]]:
    """Turn 1 as reverse_policy; in later turns a sample that got its first middle letter wrong
    keeps getting it wrong, the others answer right (with EOS)."""
    if req.sampling.n > 1:
        return await reverse_policy(req)
    context = TOK.decode(req.input_ids)
    first_word, first_answer = context.split("\n")[0][4:].split(":")  # "rev abc:<first answer>"
    target = context.split()[-1].rstrip(":")[::-1]  # the word asked now, reversed
    if first_answer != first_word[::-1][: len(first_answer)]:  # the wrong-middle sample
        target = target[0] + ("a" if target[1] != "a" else "b") + target[2]
    return [[*TOK.encode(target).ids, EOS]]


def test_orchestrator_token_advantages_over_turns(
    budget_sandbox: object,  # noqa: F811
    redis_server: str,
    tmp_path: Path,
) -> None:
    """Credit of every turn lands on that turn's tokens (the spans stay right after env tokens)."""
    right, wrong, cut = token_credit_group(
        budget_sandbox, redis_server, tmp_path, "reverse-turns", reverse_turns_policy
    )

    def turns(s: dict) -> list[list[float]]:
        """The token advantages of each model turn (runs of loss_mask 1); env tokens must be 0."""
        out: list[list[float]] = []
        prev = 0
        for m, a in zip(s["loss_mask"], s["token_advantages"], strict=True):
            if m and not prev:
                out.append([])
            if m:
                out[-1].append(a)
            else:
                assert a == 0.0
            prev = m
        return out

    assert [s["turns"] for s in (right, wrong, cut)] == [3, 3, 3]
    assert turns(right) == [pytest.approx([0.0, 1 / 3, 0.0, 0.0])] * 3
    assert turns(wrong) == [pytest.approx([0.0, -2 / 3, 0.0, 0.0])] * 3
    # the cut first turn has no EOS token; its later turns end with EOS like the others
    assert turns(cut) == [pytest.approx([0.0, 1 / 3, 0.0])] + [pytest.approx([0.0, 1 / 3, 0.0, 0.0])] * 2
