"""Evaluation protocols (``unirl/text/protocols.py``) and their figures (``unirl/text/held_out.py:figures``,
``unirl/core/eval_metrics.py``): how a protocol resolves against a config, pass@k's tensor form against its
definition, the figures of hand-made scores, and the config's errors. The run-vs-``unirl eval`` agreement
and the training RNG's independence are end to end in ``tests/test_eval_agreement.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from unirl.api import load_config
from unirl.core.eval_metrics import avg_at_k, mean_pass_at_k, pass_at_k
from unirl.config.schema import RewardConfig
from unirl.reward_set import RewardSet
from unirl.text.held_out import figures
from unirl.text.protocols import PROTOCOLS, EvalProtocol, resolve_protocol, run_protocols


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_mean_pass_at_k_is_chens_estimator_per_prompt(n):
    """Every count of right answers c = 0..n as one prompt each: the tensor form equals ``pass_at_k`` (the
    combinations' formula) per prompt, and that equals the share of k-subsets holding a right answer."""
    correct = torch.tensor([[j < c for j in range(n)] for c in range(n + 1)])  # [n + 1, n]
    for k in range(1, n + 1):
        per_prompt = [pass_at_k(n, c, k) for c in range(n + 1)]
        for c, value in enumerate(per_prompt):
            subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
            assert value == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
            assert float(mean_pass_at_k(correct[c:c + 1], k)) == pytest.approx(value, abs=1e-12)
        assert float(mean_pass_at_k(correct, k)) == pytest.approx(sum(per_prompt) / (n + 1), abs=1e-12)
    assert float(mean_pass_at_k(correct, 1)) == pytest.approx(float(avg_at_k(correct)))  # pass@1 = avg@n
    with pytest.raises(ValueError, match="needs 1 <= k <= n"):
        mean_pass_at_k(correct, n + 1)


def _unbiased_pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021 (https://arxiv.org/abs/2107.03374), eq. 1, re-typed: 1 - C(n - c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # math.comb(a, b) = 0 when b > a: pass@k is 1 then


def _human_eval_pass_at_k(n: int, c: int, k: int) -> float:
    """human-eval's estimate_pass_at_k (openai/human-eval, execution.py), re-typed: the product form."""
    if n - c < k:
        return 1.0
    return 1.0 - float(torch.prod(1.0 - k / torch.arange(n - c + 1, n + 1, dtype=torch.float64)))


# (n, c, k, pass@k) by hand: C(3,2)/C(4,2) = 3/6; C(3,3)/C(5,3) = 1/10; C(5,4)/C(8,4) = 5/70; C(15,1)/C(16,1).
HAND = [(4, 1, 2, 0.5), (5, 2, 3, 0.9), (8, 3, 4, 1 - 5 / 70), (16, 1, 1, 1 / 16), (10, 0, 5, 0.0), (10, 6, 5, 1.0),
        (4, 4, 4, 1.0)]


@pytest.mark.parametrize("n, c, k, expected", HAND)
def test_pass_at_k_by_hand_and_by_the_formula(n, c, k, expected):
    assert _unbiased_pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert _human_eval_pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    correct = torch.tensor([[j < c for j in range(n)]])  # [1, n]: c right answers
    assert float(mean_pass_at_k(correct, k)) == pytest.approx(expected, abs=1e-12)


def test_mean_pass_at_k_averages_prompts():
    """Three prompts of 8 answers with 0, 3 and 8 right: pass@4 = (0 + (1 - 5/70) + 1) / 3, avg@8 = 11/24."""
    correct = torch.tensor([[j < c for j in range(8)] for c in (0, 3, 8)])[:, torch.randperm(8)]  # [3, 8], any order
    assert float(mean_pass_at_k(correct, 4)) == pytest.approx((0 + (1 - 5 / 70) + 1) / 3, abs=1e-12)
    assert float(mean_pass_at_k(correct, 4)) == pytest.approx(
        sum(_unbiased_pass_at_k(8, c, 4) for c in (0, 3, 8)) / 3, abs=1e-12)
    assert float(avg_at_k(correct)) == pytest.approx(11 / 24) == float(mean_pass_at_k(correct, 1))


def test_a_shipped_protocol_resolves_with_the_keys_given_replaced():
    cfg = load_config("text", "tiny", ["eval.protocols=[tiny_sampled, {shipped: tiny_sampled, name: wide, n: 16, "
                                       "metrics: [pass@16]}, {name: own, n: 4, temperature: 0.5}]"])
    default, shipped, wide, own = run_protocols(cfg)
    assert default.name is None and default.n == 1 and default.greedy and default.size == 100  # tiny.yaml's eval_size
    assert default.data == "tiny" and default.max_new_tokens == 8 and default.metrics == []
    assert shipped == resolve_protocol(EvalProtocol(shipped="tiny_sampled"), cfg)
    assert (shipped.name, shipped.n, shipped.temperature, shipped.seed) == ("tiny_sampled", 8, 1.0, 0)
    assert (wide.name, wide.n, wide.metrics, wide.temperature) == ("wide", 16, ["pass@16"], 1.0)
    # Own, with data null: the run's held-out set as the run reads it (data.test, its adapter and eval_size).
    assert (own.data, own.adapter, own.size, own.n, own.temperature, own.top_p, own.seed) == \
        ("tiny", "plain", 100, 4, 0.5, 1.0, 0)
    # unirl eval --protocol: the config's own by name, the default set, or a shipped one.
    assert [p.name for p in run_protocols(cfg, ["own", "default", "gsm8k_verl"])] == ["own", None, "gsm8k_verl"]
    with pytest.raises(ValueError, match="--protocol nope: neither one of this config's eval.protocols"):
        run_protocols(cfg, ["nope"])


def test_the_gsm8k_protocol_is_verls_validation():
    gsm8k = resolve_protocol(EvalProtocol(shipped="gsm8k_verl"), load_config("text", "gsm8k"))
    # verl: data.val_files = gsm8k test.parquet (openai/gsm8k "main" test), val_kwargs n 1, temperature 0, greedy;
    # response length 1024 (examples/grpo_trainer/run_qwen2-7b.sh); the whole split (val_max_samples -1).
    assert (gsm8k.data, gsm8k.hub_config, gsm8k.split, gsm8k.adapter, gsm8k.prompt_key) == \
        ("openai/gsm8k", "main", "test", "gsm8k", "question")
    assert (gsm8k.n, gsm8k.greedy, gsm8k.top_p, gsm8k.top_k, gsm8k.max_new_tokens, gsm8k.size) == \
        (1, True, 1.0, -1, 1024, None)
    assert set(PROTOCOLS) >= {"tiny", "tiny_sampled", "tiny_search", "tiny_game", "arithmetic", "gsm8k_verl",
                              "gsm8k_sampled", "walk_words"}


@pytest.mark.parametrize("config, shipped", [("tiny", "tiny"), ("tiny_vlm", "tiny"), ("tiny_search", "tiny_search"),
                                             ("tiny_game", "tiny_game"), ("smollm2_math", "arithmetic"),
                                             ("smollm2_game", "walk_words"),
                                             ("gsm8k", "gsm8k_verl"), ("gsm8k_ppo", None)])
def test_each_bundled_task_evaluates_its_shipped_protocol(config, shipped):
    """A bundled config's own held-out evaluation (its default set) is the shipped protocol of its task, so a run's
    eval/accuracy and eval/<shipped>/accuracy are one figure; verl's GSM8K quickstart answers 256 tokens (its
    data.max_response_length), not the 1024 of gsm8k_verl (run_qwen2-7b.sh's)."""
    cfg = load_config("text", config)
    own = dataclasses.asdict(resolve_protocol(EvalProtocol(), cfg))
    reference = dataclasses.asdict(resolve_protocol(EvalProtocol(shipped=shipped or "gsm8k_verl"), cfg))
    differ = {k for k in own if own[k] != reference[k]} - {"name", "shipped", "metrics"}
    assert differ == (set() if shipped else {"max_new_tokens"}), {k: (own[k], reference[k]) for k in differ}


@pytest.mark.parametrize("override, message", [
    ("eval.protocols=[{name: x, n: 4}]", "n=4 greedy answers .temperature 0. are one answer 4 times"),
    ("eval.protocols=[nope]", "unknown evaluation protocol 'nope'"),
    ("eval.protocols=[{n: 2, temperature: 1.0}]", "give it a name"),
    ("eval.protocols=[{name: a, n: 2, temperature: 1.0, metrics: [pass@3]}]", "pass@3 needs k <= n, n=2"),
    ("eval.protocols=[{name: a, n: 2, temperature: 1.0, metrics: [avg@1]}]", "avg@1 needs k = n, n=2"),
    ("eval.protocols=[{name: a, metrics: [maj@3]}]", "'maj@3' is not avg@K or pass@K"),
    ("eval.protocols=[tiny, tiny]", "the name 'tiny' is used twice"),
    ("eval.protocols=[{name: reward}]", "name 'reward'"),
    ("eval.protocols=[{name: a, correct: nope}]", "correct='nope' is not one of the rewards .gsm8k."),
    ("eval.protocols=[{name: a, temperature: -1.0}]", "temperature must be >= 0"),
])
def test_a_bad_protocol_is_one_error_where_the_config_loads(override, message):
    with pytest.raises(ValueError, match=message):
        load_config("text", "tiny", [override])


def test_figures_by_hand():
    """2 prompts x 4 answers, gsm8k scores 1/0 and a second reward at weight 0.5: accuracy 3/8, pass@2 per prompt
    1 - C(n - c, 2) / C(4, 2): c = 2 -> 1 - 1/6, c = 1 -> 1 - 3/6; grouped by a column."""
    protocol = EvalProtocol(name="p", n=4, temperature=1.0, metrics=["avg@4", "pass@1", "pass@2", "pass@4"],
                            group_by="level", top_p=1.0, top_k=-1, seed=0, max_new_tokens=8)
    rewards = RewardSet([RewardConfig(name="gsm8k"), RewardConfig(name="em", weight=0.5)])
    comps = {"gsm8k": torch.tensor([1, 0, 1, 0, 0, 0, 0, 1], dtype=torch.float64),
             "em": torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)}
    rows = [{"prompt": "a", "level": 1}, {"prompt": "b", "level": 2}]
    fig = figures(protocol, rewards, rows, comps, tool_calls=[0, 1, 2, 3, 0, 0, 0, 1])
    assert fig["accuracy"] == fig["avg@4"] == fig["pass@1"] == 3 / 8
    assert fig["pass@2"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6)) / 2)
    assert fig["pass@4"] == 1.0
    assert fig["reward/gsm8k"] == 3 / 8 and fig["reward/em"] == 5 / 8
    assert fig["reward"] == pytest.approx(3 / 8 + 0.5 * 5 / 8)
    assert fig["tool_calls_mean"] == 7 / 8
    assert fig["level=1/accuracy"] == 0.5 and fig["level=2/accuracy"] == 0.25
    assert fig["level=1/pass@2"] == pytest.approx(1 - 1 / 6) and fig["level=2/pass@4"] == 1.0
    assert fig["level=2/reward/em"] == 1.0 and fig["level=1/tool_calls_mean"] == 1.5
    # A reward that does not apply (NaN) counts nowhere in its mean and adds nothing to the total.
    comps["em"][:4] = math.nan
    fig = figures(protocol, rewards, rows, comps)
    assert fig["reward/em"] == 1.0 and fig["reward"] == pytest.approx(3 / 8 + 0.5 * 4 / 8)
    # correct names the reward that counts an answer right.
    fig = figures(dataclasses.replace(protocol, correct="em", group_by=None), rewards, rows, comps)
    assert fig["accuracy"] == 0.5
    with pytest.raises(ValueError, match="group_by='level', but row 1 has no such column"):
        figures(protocol, rewards, [rows[0], {"prompt": "b"}], comps)
    rewards.close()
