"""DAPO's dynamic sampling: the group filter against verl's rule, and whole steps on the tiny text
model with a scripted reward where known prompts are always solved, always failed, or split.

The scripted reward scores by the prompt alone ("a+b=?"): a % 3 == 0 always 1, a % 3 == 1 always 0,
a % 3 == 2 gives the group's first sample 1 and the others 0. The overlong penalty is switched on so
the shaped total varies inside constant groups: the filter must read the raw component.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unirl.cli import load_run_config
from unirl.core import nonconstant_groups
from unirl.trainer.dynamic_sampling import SamplingExhausted
from unirl.env import Rollout, concat_rollouts
from unirl.trainer.loop import Trainer
from unirl.config.schema import FilterGroupsConfig
from unirl.text.env import TextEnvironment

REPO = Path(__file__).resolve().parents[1]

SCRIPTED = '''
def scripted(samples, prompts, **kwargs):
    seen, out = set(), []
    for prompt in prompts:
        a = int(prompt.split("+")[0])
        if a % 3 == 0:
            out.append(1.0)
        elif a % 3 == 1:
            out.append(0.0)
        else:  # the group's first sample solves it, the others do not
            out.append(0.0 if prompt in seen else 1.0)
            seen.add(prompt)
    return out
'''


def _kind(prompt: str) -> int:
    return int(prompt.split("+")[0]) % 3


def _verl_kept(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """verl's filter_groups: a uid is kept when the std of its metric is > 0 or it has one sample."""
    keep = torch.zeros(len(values), dtype=torch.bool)
    for uid in group_ids.unique():
        rows = group_ids == uid
        vals = values[rows]
        keep[rows] = bool(vals.numel() == 1 or vals.std() > 0)
    return keep


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_nonconstant_groups_is_verls_rule(seed):
    g = torch.Generator().manual_seed(seed)
    group_ids = torch.randint(0, 9, (40,), generator=g)
    values = torch.randint(0, 2, (40,), generator=g).float()
    values[group_ids == 3] = 1.0  # a constant group for sure
    expected = _verl_kept(values, group_ids)
    assert torch.equal(nonconstant_groups(values, group_ids), expected)
    assert expected.any() and not expected.all()


def test_nonconstant_groups_by_hand():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, float("nan"), float("nan"), float("nan"), 2.0])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4])
    # 0: constant; 1: varies; 2: 0.5 and a reward that does not apply -> constant; 3: no value; 4: one sample.
    assert nonconstant_groups(values, group_ids).tolist() == [False, False, True, True, False, False, False, False, True]


def test_nonconstant_groups_keeps_float64_precision():
    # Group 0 differs by 1e-12 (below float32's resolution at 0.1: 7.5e-9), group 1 is constant, group 2
    # differs only in float64 too, around 1e6 (float32's step there is 0.0625).
    values = torch.tensor([0.1, 0.1 + 1e-12, 0.3, 0.3, 1e6, 1e6 + 1e-3], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    assert nonconstant_groups(values, ids).tolist() == [True, True, False, False, True, True]
    assert nonconstant_groups(torch.tensor([1, 1, 0, 1]), torch.tensor([0, 0, 1, 1])).tolist() == [False, False, True, True]


def test_rewards_reach_the_filter_in_float64(tmp_path):
    """A reward's scores are kept in float64 from the reward function to the filter: 1 and 1 + 1e-9 (one
    float32) are a varied group, as in verl, whose filter reads the scores as Python floats. The combined
    reward that feeds the advantages stays float32."""
    from unirl.config.schema import RewardConfig
    from unirl.reward_set import RewardSet

    (tmp_path / "near.py").write_text("def near(samples, **kwargs):\n    return [1.0, 1.0 + 1e-9, 1.0, 1.0]\n")
    rewards = RewardSet([RewardConfig(name=f"{tmp_path / 'near.py'}:near")])
    ids = torch.tensor([0, 0, 1, 1])
    components = rewards.components(["a", "b", "c", "d"], prompts=["p", "p", "q", "q"], columns={})
    assert components["near"].dtype == torch.float64
    assert nonconstant_groups(components["near"], ids).tolist() == [True, True, False, False]
    total, _ = rewards.combine(components, ids)
    assert total.dtype == torch.float32 and total.tolist() == [1.0] * 4


def test_concat_rollouts_pads_each_side_and_renumbers_groups():
    a = Rollout(tensors={"prompt_ids": torch.tensor([[0, 5], [0, 5]]), "response_ids": torch.tensor([[7], [8]])},
                group_ids=torch.tensor([3, 3]), prompts=["p", "p"], samples=["x", "y"], columns={"c": [1, 1]})
    b = Rollout(tensors={"prompt_ids": torch.tensor([[4, 4, 4]]), "response_ids": torch.tensor([[9, 9, 9]])},
                group_ids=torch.tensor([0]), prompts=["q"], samples=["z"], columns={"c": [2]})
    whole = concat_rollouts([a, b], left_padded=("prompt_ids",))
    assert whole.tensors["prompt_ids"].tolist() == [[0, 0, 5], [0, 0, 5], [4, 4, 4]]
    assert whole.tensors["response_ids"].tolist() == [[7, 0, 0], [8, 0, 0], [9, 9, 9]]
    assert whole.group_ids.tolist() == [0, 0, 1] and whole.samples == ["x", "y", "z"] and whole.columns == {"c": [1, 1, 2]}


def test_config_needs_a_metric():
    with pytest.raises(ValueError, match="filter_groups.metric"):
        FilterGroupsConfig(enabled=True)


def _trainer(tmp_path, *overrides) -> Trainer:
    reward = tmp_path / "scripted.py"
    reward.write_text(SCRIPTED)
    cfg = load_run_config("text", "tiny", [
        "rollout.engine=hf", "rollout.max_new_tokens=6", "trainer.prompts_per_step=4", "trainer.group_size=3",
        "trainer.mini_batch_size=12", "trainer.micro_batch_size=12", "trainer.eval_every=0", "trainer.progress=false",
        f"rewards=[{{name: '{reward}:scripted'}}]", "overlong.buffer=6", "algo.filter_groups.enabled=true",
        "algo.filter_groups.metric=scripted", *overrides], output_dir=str(tmp_path / "run"))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    trainer.setup()
    return trainer


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_each_step_trains_exactly_prompts_per_step_varied_groups(tmp_path, tiny_lm_dir):
    trainer = _trainer(tmp_path, "algo.filter_groups.max_num_gen_batches=0")
    try:
        seen_batches = 0
        for _ in range(3):
            filtered = trainer.producer.draw_filtered()
            rollout = filtered.rollout
            raw = rollout.tensors["score/scripted"]
            assert len(torch.unique(rollout.group_ids)) == 4 and len(rollout) == 12
            # Padded only as far as its own longest response (a dropped group may have been longer).
            assert rollout.tensors["response_ids"].shape[1] == int(rollout.tensors["response_mask"].sum(-1).max())
            assert {_kind(p) for p in rollout.prompts} == {2}  # only the split prompts are kept
            assert nonconstant_groups(raw, rollout.group_ids).all()
            # The shaped total varies in constant groups too (lengths differ), so it could not be the filter.
            assert (rollout.tensors["score/overlong_penalty"] != 0).any()
            m = filtered.metrics
            assert m["filter/kept_groups"] == 4 and m["filter/prompts_seen"] == 4 * m["filter/gen_batches"]
            assert m["filter/varied_groups"] >= 4
            seen_batches += int(m["filter/gen_batches"])
            assert trainer.producer.prompt_batches == seen_batches  # prompts are drawn in order, none twice
        assert seen_batches > 3, "the data has constant groups: some step needed a second batch"
        metrics = trainer.train_step()  # the whole step on a filtered batch
        assert metrics["filter/kept_groups"] == 4 and metrics["adv/zero_std_frac"] == 0.0
        assert metrics["reward/scripted"] == pytest.approx(1 / 3)  # one of three samples solves a split prompt
    finally:
        trainer.env.close()


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_at_the_limit_it_stops_with_a_clear_error_or_trains_on_what_was_kept(tmp_path, tiny_lm_dir):
    trainer = _trainer(tmp_path, "algo.filter_groups.max_num_gen_batches=1", "trainer.prompts_per_step=8",
                       "trainer.mini_batch_size=24", "trainer.micro_batch_size=24")
    try:
        with pytest.raises(SamplingExhausted, match=r"max_num_gen_batches\) kept \d of trainer.prompts_per_step=8"):
            trainer.producer.draw_filtered()
        trainer.algo.filter_groups.on_exhausted = "train"
        filtered = trainer.producer.draw_filtered()
        groups = len(torch.unique(filtered.rollout.group_ids))
        assert 0 < groups < 8 and filtered.metrics["filter/kept_groups"] == groups
        assert {_kind(p) for p in filtered.rollout.prompts} == {2}
    finally:
        trainer.env.close()


CONSTANT = """
def constant(samples, prompts, **kwargs):
    return [1.0] * len(samples)
"""
#: The tiny config with DAPO's filter on a reward that never varies: no group is ever kept.
CONSTANT_ARGS = ["rollout.engine=hf", "rollout.max_new_tokens=4", "trainer.prompts_per_step=2", "trainer.group_size=2",
                 "trainer.mini_batch_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=0",
                 "trainer.progress=false", "algo.filter_groups.enabled=true", "algo.filter_groups.metric=constant"]


def _constant_reward(tmp_path) -> str:
    (tmp_path / "constant.py").write_text(CONSTANT)
    return f"rewards=[{{name: '{tmp_path / 'constant.py'}:constant'}}]"


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_exhausted_dynamic_sampling_is_one_line_from_the_cli(tmp_path, tiny_lm_dir, capsys):
    from unirl.cli import main

    code = main(["train", "text", "--config", "tiny", "--output-dir", str(tmp_path / "run"), *CONSTANT_ARGS,
                 _constant_reward(tmp_path), "algo.filter_groups.max_num_gen_batches=2"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("unirl: dynamic sampling: 2 generation batches"), err[-2000:]
    assert "on_exhausted=train" in lines[0] and "Traceback" not in err


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_the_first_sigterm_stops_dynamic_sampling_without_a_limit(tmp_path, tiny_lm_dir, capsys):
    """max_num_gen_batches=0 and a reward that never varies: the step would draw for ever. A SIGTERM
    during it stops the run after the batch in progress, saving the state, as after a finished step."""
    import signal

    from unirl.trainer.preemption import Preempted

    cfg = load_run_config("text", "tiny", [*CONSTANT_ARGS, _constant_reward(tmp_path), "trainer.total_steps=3",
                                           "algo.filter_groups.max_num_gen_batches=0"], output_dir=str(tmp_path / "run"))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    real, calls = trainer.env.sampler.rollout, []

    def rollout(rows, group_size):
        calls.append(len(rows))
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler the run installed records it
        assert len(calls) < 30, "the SIGTERM did not stop dynamic sampling"
        return real(rows, group_size)

    trainer.env.sampler.rollout = rollout
    with pytest.raises(Preempted) as info:
        trainer.train()
    assert info.value.exit_code == 143 and len(calls) == 3
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000000"
    assert f"stopped by SIGTERM after step 0; checkpoint {checkpoint}" in str(info.value)
    assert json.loads((checkpoint / "trainer_state" / "loop.json").read_text())["prompt_batches"] == 3
    assert "still drawing" not in capsys.readouterr().out  # the line comes at 10 batches


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_every_process_keeps_the_same_number_of_groups(tmp_path, tiny_lm_dir, nproc):
    from test_distributed import cpu_env

    reward = tmp_path / "scripted.py"
    reward.write_text(SCRIPTED)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "unirl.cli", "train", "text", "--config", "tiny", "--output-dir", str(out),
           "rollout.engine=hf", "rollout.max_new_tokens=4", "trainer.total_steps=2", "trainer.prompts_per_step=2",
           "trainer.group_size=3", "trainer.mini_batch_size=6", "trainer.micro_batch_size=6", "trainer.eval_every=0",
           "trainer.progress=false", f"rewards=[{{name: '{reward}:scripted'}}]", "algo.filter_groups.enabled=true",
           "algo.filter_groups.metric=scripted", "algo.filter_groups.max_num_gen_batches=0"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=cpu_env())  # gloo on the CPU: two ranks on one GPU would meet under NCCL
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # 2 groups on each process: the global batch is world x prompts_per_step groups
        assert r["filter/kept_groups"] == 2 * nproc and r["adv/num_groups"] == 2 * nproc
        assert r["adv/zero_std_frac"] == 0.0
        assert r["filter/prompts_seen"] == 2 * nproc * r["filter/gen_batches"]


@pytest.mark.slow
def test_the_tiny_dapo_config_keeps_every_step_full_of_varied_groups(tmp_path, tiny_lm_dir):
    import unirl

    out = tmp_path / "run"
    # In this process: the CLI's own path (unirl.train), without a second Python and torch start-up.
    unirl.train("text", "tiny_dapo", ["rollout.engine=hf", "trainer.total_steps=4", "trainer.eval_every=0"],
                output_dir=out, progress=False)
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert len(rows) == 4
    for r in rows:
        assert r["filter/kept_groups"] == 16 and r["adv/num_groups"] == 16 and r["adv/zero_std_frac"] == 0.0
        assert r["filter/prompts_seen"] == 16 * r["filter/gen_batches"]
