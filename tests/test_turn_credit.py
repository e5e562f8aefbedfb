"""Per-turn rewards on tokens (``unirl.core.turns.turn_token_rewards``): the rule by hand-derived numbers,
through both token-reward estimators (``gae``'s returns, ``reinforce++``'s discounted returns), against a
re-typed loop over plain floats, and today's ``token_scores`` as its special case."""

from __future__ import annotations

import random

import pytest
import torch

from unirl.core import ADVANTAGE_ESTIMATORS, discounted_returns, gae_advantages, token_scores, turn_token_rewards

F64 = torch.float64


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=tol)


# One episode, 8 response tokens: turn 1 = tokens 0-1, observation 2-3, turn 2 = token 4, observation
# 5-6, turn 3 = token 7. Per-turn rewards r = (0.5, 0, 1) on tokens 1, 4, 7.
MASK = torch.tensor([[1, 1, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
ENDS = torch.tensor([[0, 1, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
TURN_R = torch.tensor([[0, 0.5, 0, 0, 0, 0, 0, 1.0]], dtype=F64)


def test_by_hand_both_placements_give_each_turn_its_discounted_return():
    # R = 1.5 = sum of the turn rewards: nothing is left over for the last turn.
    # gamma = 0.5: G_3 = 1, G_2 = 0 + 0.5 * 1 = 0.5, G_1 = 0.5 + 0.5 * 0.5 = 0.75.
    R = torch.tensor([1.5], dtype=F64)
    carry = turn_token_rewards(R, TURN_R, ENDS, MASK, gamma=0.5, carry=True)
    # gae's placement: x_k = G_k - G_{k+1}: 0.75 - 0.5 = 0.25, 0.5 - 1 = -0.5, 1 - 0 = 1.
    close(carry, [[0, 0.25, 0, 0, -0.5, 0, 0, 1.0]])
    restart = turn_token_rewards(R, TURN_R, ENDS, MASK, gamma=0.5, carry=False)
    close(restart, [[0, 0.75, 0, 0, 0.5, 0, 0, 1.0]])  # reinforce++'s: G_k itself
    expected = [[0.75, 0.75, 0, 0, 0.5, 0, 0, 1.0]]  # every generated token of turn k: G_k
    # gae with gamma = lam = 1 and no values: its returns (A + V, before whitening) are the sums from t on.
    _, returns = gae_advantages(carry, torch.zeros_like(carry), MASK, gamma=1.0, lam=1.0)
    close(returns, expected)
    # reinforce++'s reward-to-go restarts after each observation token.
    close(discounted_returns(restart, MASK, gamma=1.0), expected)


def test_by_hand_the_rest_of_the_reward_is_earned_by_the_last_turn():
    # R = 2.5: the reward set added 1 (a format reward, say) to the environment's return 1.5, so
    # r'_3 = 1 + 1 = 2. gamma = 1: G_3 = 2, G_2 = 2, G_1 = 2.5.
    R = torch.tensor([2.5], dtype=F64)
    close(turn_token_rewards(R, TURN_R, ENDS, MASK, gamma=1.0, carry=True), [[0, 0.5, 0, 0, 0, 0, 0, 2.0]])
    close(turn_token_rewards(R, TURN_R, ENDS, MASK, gamma=1.0, carry=False), [[0, 2.5, 0, 0, 2.0, 0, 0, 2.0]])


def test_outcome_only_at_gamma_one_is_todays_token_scores():
    # No per-turn rewards: the gae placement puts R on the last turn's end, the last trained token.
    rng = torch.Generator().manual_seed(0)
    R = torch.randn(3, generator=rng, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    ends = torch.tensor([[0, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 1]], dtype=torch.bool)
    out = turn_token_rewards(R, torch.zeros(3, 5, dtype=F64), ends, mask, gamma=1.0, carry=True)
    close(out, token_scores(R, mask))


def test_a_sample_without_turns_gets_its_reward_as_token_scores():
    R = torch.tensor([0.3, -1.0], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    ends = torch.tensor([[0, 1, 0], [0, 0, 0]], dtype=torch.bool)
    out = turn_token_rewards(R, torch.zeros(2, 3, dtype=F64), ends, mask, gamma=0.9, carry=False)
    close(out, [[0, 0.3, 0], [-1.0, 0, 0]])


def _by_loop(R, turn_r, ends, gamma, carry):
    """The rule re-typed over floats, one episode at a time: turns in order, the rest on the last."""
    out = []
    for R_n, r_row, e_row in zip(R, turn_r, ends):
        where = [t for t, e in enumerate(e_row) if e]
        earned = [r_row[t] for t in where]
        earned[-1] += R_n - sum(earned)
        G = [0.0] * (len(where) + 1)
        for k in reversed(range(len(where))):
            G[k] = earned[k] + gamma * G[k + 1]
        row = [0.0] * len(r_row)
        for k, t in enumerate(where):
            row[t] = G[k] - G[k + 1] if carry else G[k]
        out.append(row)
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("carry", [True, False])
def test_matches_the_loop_over_random_episodes(seed, carry):
    rng = random.Random(seed)
    N, T = 5, 12
    ends = [[False] * T for _ in range(N)]
    mask = [[False] * T for _ in range(N)]
    for n in range(N):  # turns of 1-3 tokens, observations of 0-2 tokens between them
        t = 0
        while True:
            length = rng.randint(1, 3)
            if t + length > T:
                break
            for i in range(t, t + length):
                mask[n][i] = True
            ends[n][t + length - 1] = True
            t += length + rng.randint(0, 2)
    turn_r = [[rng.uniform(-1, 1) if e else 0.0 for e in row] for row in ends]
    R = [rng.uniform(-2, 2) for _ in range(N)]
    gamma = rng.uniform(0.5, 1.0)
    out = turn_token_rewards(torch.tensor(R, dtype=F64), torch.tensor(turn_r, dtype=F64), torch.tensor(ends),
                             torch.tensor(mask), gamma=gamma, carry=carry)
    close(out, _by_loop(R, turn_r, ends, gamma, carry))


def test_the_estimators_say_how_they_sum_over_observations():
    assert getattr(ADVANTAGE_ESTIMATORS.get("reinforce++"), "restarts_at_observations", False)
    assert not getattr(ADVANTAGE_ESTIMATORS.get("gae"), "restarts_at_observations", False)
