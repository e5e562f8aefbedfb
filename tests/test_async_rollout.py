"""Asynchronous rollouts (``source.max_staleness``, ``unirl.rollout.sources``): the version
bookkeeping of the producer, the staleness bound, weight loads never inside a generation, the drained
state a checkpoint saves, and the tiny text run: staleness 0 is the synchronous loop, k >= 1 samples
batch s with the weights after step max(0, s - k) and resumes exactly."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from unirl.cli import load_run_config
from unirl.config import config_to_dict
from unirl.env import Rollout
from unirl.text.env import TextEnvironment
from unirl.rollout.sources import InlineSource, ThreadedSource
from unirl.trainer.checkpoints import CheckpointError
from unirl.trainer.loop import Preempted, Trainer

from stage_helpers import sigterm_after  # tests/stage_helpers.py


# ------------------------------------------------------------ the producer alone (no model)
class Engine:
    """A stand-in for a rollout engine: which weights it holds, and whether a load ever landed during a
    generation (what ``engine_lock`` prevents)."""

    def __init__(self):
        self.weights, self.generating, self.overlaps, self.loads = None, False, 0, []

    def load(self, snapshot):
        self.overlaps += self.generating
        self.loads.append(snapshot)
        time.sleep(random.random() * 0.002)
        self.weights = snapshot

    def produce(self, batch: int, times=None, stop=None):
        self.generating = True
        time.sleep(random.random() * 0.004)
        held = self.weights
        self.generating = False
        tokens = {"prompt_ids": torch.zeros(2, 1, dtype=torch.long), "prompt_mask": torch.ones(2, 1, dtype=torch.long),
                  "response_ids": torch.zeros(2, 1, dtype=torch.long), "response_mask": torch.ones(2, 1)}  # a checkpoint checks them
        rollout = Rollout(tensors={"held": torch.full((2,), held), **tokens}, group_ids=torch.tensor([0, 0]),
                          prompts=["p", "p"], samples=[str(batch)] * 2, columns={"batch": [batch, batch]})
        return rollout, torch.tensor([float(batch), 0.0]), {"reward/x": float(batch)}, None


def _train(rollouts: ThreadedSource, steps: range, updates_per_step: int) -> list[tuple[int, int, int]]:
    """The trainer's side: publish the weights at each step's start, take the batch, 'update'."""
    seen = []
    for step in steps:
        if rollouts.needs_weights(step):
            rollouts.publish(step, step, step * updates_per_step)
        produced, _ = rollouts.get(step, step * updates_per_step)
        seen.append((step, int(produced.rollout.tensors["held"][0]), int(produced.rollout.policy_version[0])))
        assert produced.rollout.samples[0] == str(step)
        time.sleep(random.random() * 0.004)  # the update
    return seen


@pytest.mark.parametrize("k,updates", [(1, 1), (2, 1), (3, 2)])
def test_each_batch_is_sampled_with_the_weights_k_steps_back_and_no_load_lands_in_a_generation(k, updates):
    random.seed(k)
    engine = Engine()
    rollouts = ThreadedSource(k, 12, engine.produce, engine.load)
    rollouts.start(0, 0, snapshot=0)
    try:
        seen = _train(rollouts, range(12), updates)
    finally:
        rollouts.close()
    # Batch s holds the weights after max(0, s - k) steps, and its version counts their optimizer steps.
    assert seen == [(s, max(0, s - k), max(0, s - k) * updates) for s in range(12)]
    staleness = [s * updates - version for s, _, version in seen]  # optimizer steps, against the step's own weights
    assert max(staleness) == k * updates and min(staleness) == 0
    assert engine.overlaps == 0
    assert engine.loads == sorted(set(engine.loads))  # each version loaded once, in order


def _producer(k: int, total: int) -> ThreadedSource:
    engine = Engine()
    return ThreadedSource(k, total, engine.produce, engine.load)


def test_a_drained_state_resumes_to_the_batches_of_the_uninterrupted_run():
    random.seed(0)
    k, total, stop = 2, 9, 4
    whole = _producer(k, total)
    whole.start(0, 0, snapshot=0)
    expected = _train(whole, range(total), 1)
    whole.close()

    first = _producer(k, total)
    first.start(0, 0, snapshot=0)
    seen = _train(first, range(stop), 1)
    state = first.state_dict()  # drained: batches stop .. stop+k-1, sampled with weights before step stop
    first.close()
    assert [item["batch"] for item in state["batches"]] == list(range(stop, stop + k))

    resumed = _producer(k, total)
    resumed.load_state_dict(state)
    resumed.start(stop, stop, snapshot=stop)  # the checkpoint's weights: version stop
    seen += _train(resumed, range(stop, total), 1)
    resumed.close()
    assert seen == expected

    wrong = _producer(k + 1, total)
    with pytest.raises(ValueError, match="source.max_staleness=2, this run has 3"):
        wrong.load_state_dict(state)


def test_a_producer_error_reaches_the_trainer():
    def produce(batch, times=None, stop=None):
        raise RuntimeError(f"reward server down at batch {batch}")

    rollouts = ThreadedSource(1, 4, produce, lambda snapshot: None)
    rollouts.start(0, 0, snapshot=0)
    with pytest.raises(RuntimeError, match="reward server down at batch 0"):
        rollouts.get(0, 0)
    rollouts.close()


# ------------------------------------------------------------ the tiny text run
ARGS = ["rollout.engine=hf", "rollout.max_new_tokens=8", "trainer.prompts_per_step=4", "trainer.group_size=4",
        "trainer.mini_batch_size=16", "trainer.micro_batch_size=16", "trainer.eval_every=0", "trainer.save_every=0",
        "trainer.progress=false"]


def _run(tmp_path, name: str, *extra: str, config: str = "tiny") -> tuple[Trainer, list[dict]]:
    cfg = load_run_config("text", config, [*ARGS, *extra], output_dir=str(tmp_path / name))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    return trainer, trainer.train()


def _figures(rows: list[dict]) -> list[dict]:
    """The figures a run's math gives (wall-clock and machine figures left out)."""
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))} for row in rows]


def test_staleness_zero_is_the_synchronous_loop(tmp_path, tiny_lm_dir):
    trainer, explicit = _run(tmp_path, "zero", "trainer.total_steps=2", "source.max_staleness=0")
    assert isinstance(trainer.source, InlineSource)
    _, default = _run(tmp_path, "default", "trainer.total_steps=2")
    assert _figures(explicit) == _figures(default)
    assert not any(k.startswith("rollout/staleness") for k in explicit[0])


def test_staleness_one_samples_with_the_weights_one_step_back_and_resumes_exactly(tmp_path, tiny_lm_dir):
    trainer, rows = _run(tmp_path, "whole", "trainer.total_steps=4", "source.max_staleness=1")
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]  # batch 0 and 1 both from the start
    assert all(r["perf/wait_for_data_s"] >= 0 and r["perf/wait_for_weights_s"] >= 0 for r in rows)
    assert not trainer.source._thread.is_alive()

    # SIGTERM during step 2: the step finishes, the producer is drained and batch 2 (sampled with the
    # weights after step 1) is saved with the checkpoint; the resumed run trains on it.
    cfg = load_run_config("text", "tiny", [*ARGS, "trainer.total_steps=4", "source.max_staleness=1"],
                          output_dir=str(tmp_path / "split"))
    stopped = Trainer.from_config(TextEnvironment(cfg), cfg)
    sigterm_after(stopped, 2)
    with pytest.raises(Preempted, match="stopped by SIGTERM after step 2"):
        stopped.train()
    saved = json.loads((tmp_path / "split" / "checkpoints" / "step_000002" / "trainer_state" / "source.json").read_text())
    assert [item["batch"] for item in saved["batches"]] == [2]
    with pytest.raises(CheckpointError, match="source.max_staleness: 1 in the checkpoint, 0 now"):
        _run(tmp_path, "split", "trainer.total_steps=4", "source.max_staleness=0", "trainer.resume=true")
    _, resumed = _run(tmp_path, "split", "trainer.total_steps=4", "source.max_staleness=1", "trainer.resume=true")
    assert _figures(resumed) == _figures(rows[2:])


class _ClaimedVersionCheck(Trainer):
    """A trainer that keeps a copy of its weights at each step's start (the version a later batch claims)
    and, before learning from a batch, recomputes its log-probs with the weights of ``policy_version``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.versions, self.gaps = {}, []  # optimizer steps -> state; (step, |engine - claimed|, |engine - now|)

    def train_step(self):
        model = self.accelerator.unwrap_model(self.env.model)
        self.versions[self.optimizer_steps] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return super().train_step()

    def learn(self, rollout, rewards, times=None):
        from unirl.trainer.logprobs import score_all

        model, mask = self.accelerator.unwrap_model(self.env.model), rollout.tensors["response_mask"].bool()
        with torch.no_grad():
            now_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            now = score_all(self.ctx, self.env.model, rollout)["logp"]
            model.load_state_dict(self.versions[int(rollout.policy_version[0])])
            claimed = score_all(self.ctx, self.env.model, rollout)["logp"]
            model.load_state_dict(now_state)
        gap = lambda x: (rollout.engine_logp - x).abs()[mask].max().item()  # noqa: E731
        self.gaps.append((self.step, gap(claimed), gap(now)))
        return super().learn(rollout, rewards, times)


def test_a_stale_batch_was_sampled_with_exactly_the_weights_it_claims(tmp_path, tiny_lm_dir):
    """The engine's log-probs of every batch equal those the trainer recomputes with the weights of the
    batch's ``policy_version`` (float noise), and not those of the weights it trains with: no torn or
    wrong-version weights reach the engine while the trainer updates (the diagnosis of the staleness-1
    collapse, docs/async.md, found the same on vLLM over 100 steps)."""
    cfg = load_run_config("text", "tiny", [*ARGS, "trainer.total_steps=4", "source.max_staleness=1", "optim.lr=1e-2"],
                          output_dir=str(tmp_path / "claimed"))
    trainer = _ClaimedVersionCheck(TextEnvironment(cfg), algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer,
                                   run_dir=cfg.output_dir, config_dict=config_to_dict(cfg), source=cfg.source)
    rows = trainer.train()
    assert [step for step, _, _ in trainer.gaps] == [0, 1, 2, 3]
    for step, claimed, now in trainer.gaps:
        assert claimed < 1e-4, f"batch {step}: the engine's log-probs are {claimed} off its claimed weights'"
        if step >= 1:  # one step old: the weights it trains with are another policy
            assert now > 1e-2, f"batch {step}: the engine's log-probs are only {now} off the newer weights'"
    # Bypass mode (the default here): the ratio is against the engine's log-probs, the gap still logged.
    assert trainer.bypass_mode and any(r["actor/ratio_max"] != 1.0 for r in rows[1:])
    assert all(r["rollout/mismatch_kl"] != 0.0 for r in rows[1:])


def _versions_follow_the_schedule(rows: list[dict], k: int) -> None:
    """With one optimizer step a step, batch s's staleness is min(s, k) optimizer steps."""
    assert [r["rollout/staleness_max"] for r in rows] == [float(min(s, k)) for s in range(len(rows))]
    assert [r["rollout/staleness_mean"] for r in rows] == [float(min(s, k)) for s in range(len(rows))]


def test_dynamic_sampling_runs_ahead_with_its_prompt_batches_counted(tmp_path, tiny_lm_dir):
    extra = ["trainer.total_steps=3", "source.max_staleness=2", "algo.filter_groups.max_num_gen_batches=4",
             "algo.filter_groups.on_exhausted=train"]
    trainer, rows = _run(tmp_path, "dapo", *extra, config="tiny_dapo")
    _versions_follow_the_schedule(rows, 2)
    assert all("filter/kept_groups" in r for r in rows)
    # The producer drew the prompt batches of all three steps, in order, and counted them for the checkpoint.
    assert trainer.producer.prompt_batches == sum(r["filter/gen_batches"] for r in rows)


@pytest.mark.slow  # the run that proves learning: ~40 s of training once vLLM has started
@pytest.mark.requires("vllm")
def test_staleness_one_learns_the_tiny_task(tmp_path, tiny_lm_dir):
    """The shipped tiny recipe, one step off-policy, the ratio clipped against the weights that sampled (bypass mode)."""
    _, rows = _run(tmp_path, "learn", "rollout.engine=vllm", "trainer.prompts_per_step=16", "trainer.group_size=8",
                   "trainer.mini_batch_size=128", "trainer.micro_batch_size=64", "trainer.total_steps=40",
                   "source.max_staleness=1", "algo.tis_cap=2.0")
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + 0.05, f"reward/mean: first 10 steps {first:.3f}, last 10 {last:.3f}"
    _versions_follow_the_schedule(rows, 1)


def test_a_run_whose_every_advantage_stays_zero_is_counted_and_warned_about_once():
    from unirl.trainer.zero_advantage import ZeroAdvantageWatch

    watch, said = ZeroAdvantageWatch(), []
    figures = [{"adv/abs_mean": a, "reward/mean": 0.0} for a in [0.3, 0.0, 0.0, 0.2] + [0.0] * 7]
    for step, metrics in enumerate(figures, start=1):
        watch.observe(metrics, step, said.append)
    assert [m["adv/zero_adv_steps"] for m in figures] == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]
    assert len(said) == 1 and said[0].startswith("unirl: warning: step 9: every advantage has been 0 for 5 steps")
    no_advantages = {"loss/policy": 0.1}  # an estimator that logs no advantages: nothing counted
    watch.observe(no_advantages, 12, said.append)
    assert "adv/zero_adv_steps" not in no_advantages
