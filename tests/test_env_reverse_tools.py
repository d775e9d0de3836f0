"""reverse-tools: determinism by seed, the heavy tail of episode lengths, scoring and credit,
the tool's results, a random policy's reward, and the sandbox ending an episode at its length."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.common.tokenizer import CHARS
from services.sandbox.envs import make_env, normalize_score
from services.sandbox.envs.base import normalize_credit
from services.sandbox.envs.reverse_tools import MAX_TURNS, draw_turns, tool_call, turns_pmf
from services.sandbox.sessions import EpisodeDone, SessionStore

NAME = "reverse-tools"


def solver(context: str) -> tuple[str, bool]:
    word = context[context.rindex("rev ") + 4 :][:3]
    return tool_call(word[::-1]), True


def play(seed: int, policy) -> tuple[float, list[str], int]:  # noqa: ANN001
    """One episode: (reward, texts shown, turns taken)."""
    env = make_env(NAME)
    context = env.reset(seed)
    shown = [context]
    turns = 0
    while True:
        action, eos = policy(context)
        obs, done = env.step(action, eos)
        turns += 1
        shown.append(obs)
        context += action + obs
        if done:
            break
    reward, _ = normalize_score(NAME, env.score())
    return reward, shown, turns


def test_same_seed_same_episode_and_text_in_charset() -> None:
    for seed in range(200):
        rng = random.Random(seed)
        policy = lambda _c, rng=rng: (rng.choice(["[abc]", "[cba]", "ab", "[a"]), True)  # noqa: E731
        first = play(seed, policy)
        rng.seed(seed)
        assert play(seed, policy) == first
        for text in first[1]:
            assert set(text) <= set(CHARS), text
    # different seeds give different words and lengths
    envs = [make_env(NAME) for _ in range(50)]
    prompts = {e.reset(s) for s, e in enumerate(envs)}
    assert len(prompts) > 20 and len({e.max_turns for e in envs}) > 3


def test_tail_shape() -> None:
    pmf = turns_pmf()
    assert len(pmf) == MAX_TURNS and sum(pmf) == pytest.approx(1.0)
    assert all(a > b for a, b in zip(pmf, pmf[1:], strict=False))  # decreasing: most episodes short
    # P(n) ~ n^-2: the exact ratios, and the shares the module docstring states
    assert pmf[1] / pmf[0] == pytest.approx(1 / 4) and pmf[19] / pmf[0] == pytest.approx(1 / 400)
    assert pmf[0] == pytest.approx(0.6265, abs=1e-4) and sum(pmf[9:]) == pytest.approx(0.0353, abs=1e-4)
    mean = sum((n + 1) * p for n, p in enumerate(pmf))
    assert mean == pytest.approx(2.254, abs=1e-3)

    n = 40_000
    drawn = Counter(draw_turns(random.Random(s)) for s in range(n))
    assert set(drawn) <= set(range(1, MAX_TURNS + 1)) and drawn[MAX_TURNS] > 0
    for k in (1, 2, 3, 10, 20):  # each count within 5 standard deviations of its expectation
        expected = n * pmf[k - 1]
        assert abs(drawn[k] - expected) < 5 * (expected * (1 - pmf[k - 1])) ** 0.5 + 1, (k, drawn[k])
    lengths = sorted(drawn.elements())
    median = lengths[n // 2]
    assert median == 1 and max(lengths) == 20 * median
    # the env itself follows the same draw: an instance's max_turns is its episode's length
    for seed in range(300):
        env = make_env(NAME)
        env.reset(seed)
        assert env.max_turns == draw_turns(random.Random(seed))


@pytest.mark.parametrize("seed", range(30))
def test_correct_calls_score_one_and_every_turn_is_played(seed: int) -> None:
    reward, shown, turns = play(seed, solver)
    assert reward == 1.0
    assert turns == draw_turns(random.Random(seed))
    assert all(o.startswith(" ok") for o in shown[1:])
    assert shown[-1] == " ok"  # the last result, no next task


def test_scoring_credit_and_tool_results() -> None:
    seed = next(s for s in range(1000) if draw_turns(random.Random(s)) == 3)
    env = make_env(NAME)
    prompt = env.reset(seed)
    word = prompt[4:7]
    target = tool_call(word[::-1])
    obs, done = env.step(target, True)
    assert (obs[:4], done) == (" ok\n", False) and obs.endswith(":")
    obs2, done = env.step("[zzz]", True)  # brackets and end right, letters wrong: 3 of 6
    assert obs2.startswith(" no\n") and not done
    last, done = env.step("zzz", False)  # no call at all: the tool's error, 0 positions
    assert (last, done) == (" ?", True)
    reward, info = normalize_score(NAME, env.score())
    assert reward == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert info == {"turns": 3, "episode_turns": 3, "exact_turns": 1, "malformed": 1}
    credit = normalize_credit(NAME, env.credit(), [len(target), 5, 3])
    assert credit == [[1.0] * 6, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]

    # partial answers: the right call cut before EOS, a call with trailing text
    for action, eos, want, result in (
        (target, False, 5 / 6, " ok"),
        (target + "x", True, 5 / 6, " ok"),  # the call is right; the end position is not
        (target[:4], True, 4 / 6, " ?"),  # unterminated call
        ("", True, 0.0, " ?"),
    ):
        env = make_env(NAME)
        env.reset(seed)
        obs, _ = env.step(action, eos)
        assert obs.startswith(result), (action, obs)
        assert env.turn_scores == [pytest.approx(want)], action  # type: ignore[attr-defined]


def test_untaken_turns_count_zero() -> None:
    seed = next(s for s in range(1000) if draw_turns(random.Random(s)) == 4)
    env = make_env(NAME)
    prompt = env.reset(seed)
    env.step(tool_call(prompt[4:7][::-1]), True)
    assert normalize_score(NAME, env.score())[0] == pytest.approx(0.25)
    fresh = make_env(NAME)
    fresh.reset(seed)
    assert normalize_score(NAME, fresh.score())[0] == 0.0


def test_random_policy_reward_is_a_few_percent() -> None:
    vocab = [*CHARS, None]  # None = EOS
    rng = random.Random(0)

    def policy(_context: str) -> tuple[str, bool]:
        out = []
        for _ in range(6):
            tok = rng.choice(vocab)
            if tok is None:
                return "".join(out), True
            out.append(tok)
        return "".join(out), False

    n = 3000
    mean = sum(play(seed, policy)[0] for seed in range(n)) / n
    assert 0.005 < mean < 0.04, mean


def test_sandbox_ends_the_episode_at_its_length() -> None:
    seed = next(s for s in range(1000) if draw_turns(random.Random(s)) == 2)
    store = SessionStore(4, ttl_s=60)
    s, _prompt = store.create(NAME, seed)
    assert s.max_turns == 2
    assert store.step(s.id, "[zz", True)[2] is False
    assert store.step(s.id, "[zz", True)[2] is True
    with pytest.raises(EpisodeDone):
        store.step(s.id, "[zz", True)
