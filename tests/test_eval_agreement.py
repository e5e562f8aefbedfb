"""The held-out figures of a run and of ``unirl eval`` on its checkpoint agree (issue 50): the tiny config, a
short run evaluating its default set (greedy) and a sampled protocol, then ``unirl eval`` on the last checkpoint
with the run's saved config, through the same path (``unirl/text/held_out.py``). And sampled evaluation does not
touch what training samples next: a run that evaluates a sampled protocol every step trains on the same
samples, to the last figure, as one that does not evaluate.
"""

from __future__ import annotations

import json

import pytest

import unirl

SAMPLED = {"shipped": "tiny_sampled", "size": 8, "n": 4, "metrics": ["avg@4", "pass@1", "pass@2", "pass@4"]}


def _overrides(engine: str, eval_every: int) -> dict:
    return {"rollout.engine": engine, "trainer.total_steps": 2, "trainer.eval_every": eval_every,
            "trainer.save_every": 2, "data.eval_size": 8, "trainer.prompts_per_step": 4, "trainer.group_size": 4,
            "trainer.mini_batch_size": 16, "trainer.micro_batch_size": 16, "eval.protocols": [SAMPLED]}


def _evaluated(run) -> dict:
    """The run's figures at its last evaluation (step 2)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reversed(rows) if "eval/accuracy" in r)


def _agree(run, out) -> None:
    summary = unirl.evaluate("text", checkpoint=run / "checkpoints" / "step_000002", output_dir=out)
    logged = _evaluated(run)
    assert summary["config"].endswith("(the run's saved config)")
    # The default set: every figure the run logged under eval/ equals the summary's, exactly (same answers).
    default = {k.removeprefix("eval/"): v for k, v in logged.items()
               if k.startswith("eval/") and not k.startswith("eval/tiny_sampled/")}
    assert default.keys() >= {"accuracy", "reward", "reward/gsm8k"}
    assert {k: summary[k] for k in default} == default
    # The sampled protocol: 8 prompts x 4 answers, seeded.
    sampled = {k.removeprefix("eval/"): v for k, v in logged.items() if k.startswith("eval/tiny_sampled/")}
    assert sampled.keys() >= {f"tiny_sampled/{m}" for m in ("accuracy", "avg@4", "pass@1", "pass@2", "pass@4")}
    assert {k: summary[k] for k in sampled} == sampled
    assert summary["tiny_sampled/prompts"] == 8 and summary["tiny_sampled/n"] == 4
    answers = [json.loads(line) for line in (out / "samples_tiny_sampled.jsonl").read_text().splitlines()]
    assert len(answers) == 32 and len({a["response"] for a in answers}) > 8  # sampled: the answers differ
    per_prompt = [sum(a["correct"] for a in answers if a["index"] == i) for i in range(8)]
    assert summary["tiny_sampled/accuracy"] == pytest.approx(sum(per_prompt) / 32)


def _training_figures(result) -> list[dict]:
    """Each step's training figures (not the evaluation's, not the clock's)."""
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))} for m in result.metrics
            if "loss/policy" in m]


def _same_training(engine: str, tmp_path):
    """A run evaluating the sampled protocol every step and one that never evaluates train alike; returns the first."""
    evaluated = tmp_path / "evaluated"
    with_eval = unirl.train("text", "tiny", _overrides(engine, eval_every=1), output_dir=evaluated, progress=False)
    without = unirl.train("text", "tiny", _overrides(engine, eval_every=0), output_dir=tmp_path / "plain",
                          progress=False)
    trained, alone = _training_figures(with_eval), _training_figures(without)
    assert len(trained) == len(alone) == 2 and trained[0].keys() == alone[0].keys()
    # The same samples (rewards, lengths) and updates: equal up to the last bits two runs in one process differ by
    # (tests/pinned_metrics.py); other samples would move the rewards by 1/16 at least.
    for a, b in zip(trained, alone):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    return evaluated


def test_a_runs_held_out_figures_are_unirl_evals_on_its_checkpoint(tmp_path, tiny_lm_dir):
    """The transformers engine (a forked torch generator for a seeded evaluation)."""
    run = _same_training("hf", tmp_path)
    _agree(run, tmp_path / "eval")
    # --protocol NAME: only that set, the config's own protocol of that name, with the same figures.
    only = unirl.evaluate("text", checkpoint=run / "checkpoints" / "step_000002", output_dir=tmp_path / "only",
                          protocols=["tiny_sampled"])
    logged = {k.removeprefix("eval/"): v for k, v in _evaluated(run).items() if k.startswith("eval/tiny_sampled/")}
    assert "prompts" not in only and {k: only[k] for k in logged} == logged


@pytest.mark.slow
def test_with_vllm_too(tmp_path, tiny_lm_dir):
    """vLLM samples training's answers from its engine's generator, in this process; a seeded evaluation request
    has its own, so evaluating every step leaves training as it was, and unirl eval's engine (started on the
    checkpoint's directory) answers as the run's did."""
    run = _same_training("vllm", tmp_path)
    _agree(run, tmp_path / "eval")
