"""``unirl.train`` from Python: a callable reward and in-memory data, repeated runs in one process, the
same metrics as the command line for the same config and seed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import unirl
from unirl.cli import main

from machine import repo_env

REPO = Path(__file__).resolve().parents[1]

#: A short text run on the transformers engine: 3 steps of 4 prompts x 4 answers, evaluated at the end.
TEXT = {"rollout.engine": "hf", "trainer.total_steps": 3, "trainer.prompts_per_step": 4, "trainer.group_size": 4,
        "trainer.mini_batch_size": 16, "trainer.micro_batch_size": 16, "trainer.eval_every": 3, "trainer.save_every": 0,
        "data.eval_size": 4, "data.prompt_key": "question"}
ROWS = [{"question": f"{a}+{b}=?", "total": str(a + b)} for a in range(1, 5) for b in range(1, 5)]

# The same reward as a Python callable and as a file the command line names.
REWARD_SOURCE = '''
def ends_right(samples, *, total, **kwargs):
    """1 when the answer ends with the sum (a column of the in-memory data), else 0."""
    return [1.0 if s.strip().endswith(t) else 0.0 for s, t in zip(samples, total)]
'''
namespace: dict = {}
exec(REWARD_SOURCE, namespace)
ends_right = namespace["ends_right"]


def _training_rows(metrics: list[dict]) -> list[dict]:
    """Every figure but the timings (wall-clock), step by step."""
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))} for m in metrics]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_text_twice_in_one_process_and_as_the_cli(tmp_path):
    first = unirl.train("text", "tiny", TEXT, rewards=[ends_right], train_data=ROWS, test_data=ROWS[:4],
                        output_dir=tmp_path / "a", progress=False)
    # 1. What comes back: every step's metrics with the callable's own reward, the run's files.
    assert [m["step"] for m in first.metrics] == [1, 2, 3]
    assert all("reward/ends_right" in m and 0 <= m["reward/mean"] <= 1 for m in first.metrics)
    assert first.rewards == [m["reward/mean"] for m in first.metrics]
    assert first.run_dir == tmp_path / "a" and first.checkpoint == tmp_path / "a" / "checkpoints" / "step_000003"
    assert [e["step"] for e in first.evals] == [0, 3] and "eval/reward/ends_right" in first.evals[-1]
    assert (first.run_dir / "data" / "train.jsonl").read_text().count("\n") == len(ROWS)
    # 2. The reward was registered for the run only.
    from unirl.rewards.registry import REWARDS

    assert "ends_right" not in REWARDS
    # 3. The command line on the same config (the reward in a file, the data in JSON lines), in this
    #    process after the first run: the same metrics, step by step.
    reward_file = tmp_path / "my_rewards.py"
    reward_file.write_text(textwrap.dedent(REWARD_SOURCE))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    code = main(["train", "text", "--config", "tiny", "--output-dir", str(tmp_path / "cli"), "trainer.progress=false",
                 *(f"{k}={v}" for k, v in TEXT.items()), f"rewards=[{reward_file}:ends_right]",
                 f"data.train={data}", f"data.test={test}"])
    assert code == 0
    cli_rows = [m for m in _metrics(tmp_path / "cli") if "reward/mean" in m]
    assert _training_rows(cli_rows) == _training_rows(first.metrics)
    # 4. A second Python run in the same process, the data as a datasets.Dataset: the same again.
    import datasets

    second = unirl.train("text", "tiny", TEXT, rewards=[("ends_right", ends_right, 1.0)],
                         train_data=datasets.Dataset.from_list(ROWS), test_data=ROWS[:4], output_dir=tmp_path / "b",
                         progress=False)
    assert _training_rows(second.metrics) == _training_rows(first.metrics)
    assert second.evals[-1]["eval/reward/ends_right"] == first.evals[-1]["eval/reward/ends_right"]


def red(samples, **kwargs):
    """Mean red channel in [0, 1]."""
    import numpy as np

    return [float(np.asarray(image.convert("RGB"), dtype=np.float32)[..., 0].mean() / 255) for image in samples]


def test_diffusion_twice_in_one_process(tmp_path):
    overrides = {"trainer.total_steps": 2, "trainer.prompts_per_step": 4, "trainer.group_size": 2,
                 "trainer.mini_batch_size": 8, "trainer.micro_batch_size": 8, "trainer.eval_every": 0,
                 "trainer.reward_workers": 0, "sampling.num_steps": 4}
    prompts = ["a red apple", "a blue car", "a green leaf", "a yellow sun", "a white cloud"]
    runs = [unirl.train("diffusion", "tiny", overrides, rewards=[red], train_data=prompts, test_data=None,
                        output_dir=tmp_path / name, progress=False) for name in ("a", "b")]
    for run in runs:
        assert [m["step"] for m in run.metrics] == [1, 2]
        assert all(0 <= m["reward/red"] <= 1 for m in run.metrics)
        assert (run.checkpoint / "pytorch_lora_weights.safetensors").exists()
    assert _training_rows(runs[0].metrics) == _training_rows(runs[1].metrics)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install -e .[cpu])")
def test_vllm_engine_twice_in_one_process(tmp_path):
    """Each run closes its engine: a second colocated vLLM starts in the same process and samples the same."""
    overrides = {**TEXT, "rollout.engine": "vllm", "trainer.total_steps": 1, "trainer.eval_every": 0}
    runs = [unirl.train("text", "tiny", overrides, rewards=[ends_right], train_data=ROWS, output_dir=tmp_path / name,
                        progress=False) for name in ("a", "b")]
    assert _training_rows(runs[0].metrics) == _training_rows(runs[1].metrics)


# ----------------------------------------------------------------------------------------------
# What is checked before anything loads
# ----------------------------------------------------------------------------------------------


def test_load_config_takes_a_name_a_path_an_object_and_dict_overrides(tmp_path):
    from unirl.config import ConfigError, config_to_dict

    cfg = unirl.load_config("text", "tiny", {"algo.clip_high": 0.3, "output_dir": tmp_path / "x"})
    assert cfg.algo.clip_high == 0.3 and cfg.output_dir == str(tmp_path / "x")
    again = unirl.load_config("text", cfg, ["trainer.total_steps=7"])
    assert again.trainer.total_steps == 7 and again.algo.clip_high == 0.3 and cfg.trainer.total_steps == 150
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  total_steps: 4\n")
    assert unirl.load_config("text", path).trainer.total_steps == 4
    assert config_to_dict(unirl.load_config("text", config_to_dict(cfg))) == config_to_dict(cfg)
    with pytest.raises(ConfigError, match="algo.clip_hgih: unknown key. Did you mean 'clip_high'"):
        unirl.load_config("text", "tiny", ["algo.clip_hgih=0.3"])
    with pytest.raises(ValueError, match="unknown environment 'txt'"):
        unirl.load_config("txt")


def test_reward_forms_and_their_errors(tmp_path):
    from unirl.api import _reward_configs

    configs, callables = _reward_configs([ends_right, ("short", len, 0.5), "gsm8k", {"name": "brightness", "weight": 2}],
                                         "text")
    assert [(c.name, c.weight) for c in configs] == [("ends_right", 1.0), ("short", 0.5), ("gsm8k", 1.0), ("brightness", 2.0)]
    assert callables == [("ends_right", ends_right), ("short", len)]
    with pytest.raises(ValueError, match=r"has no usable name \('<lambda>'\); pass it as \(name, fn\)"):
        _reward_configs([lambda samples, **kw: [0.0] * len(samples)], "text")
    with pytest.raises(TypeError, match=r"rewards\[0\]: expected a callable"):
        _reward_configs([3], "text")

    def gsm8k(samples, **kwargs):
        return [0.0] * len(samples)

    with pytest.raises(ValueError, match="reward name 'gsm8k' is taken by a registered reward; pass the function as"):
        unirl.train("text", "tiny", rewards=[gsm8k], train_data=ROWS, output_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_directory_holding_a_run_is_refused_before_data_is_written(tmp_path):
    from unirl.preflight import PreflightError

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(PreflightError, match="already holds a run"):
        unirl.train("text", "tiny", train_data=ROWS, output_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "data").exists()


def test_unirl_evaluate_stays_the_function_once_the_modules_are_imported():
    import unirl.api
    import unirl.evaluation  # noqa: F401  (a submodule named "evaluate" would replace the function)

    assert unirl.evaluate is unirl.api.evaluate and unirl.train is unirl.api.train


def test_import_unirl_loads_no_library():
    code = "import sys, unirl; unirl.train; print(sorted(m for m in ('torch', 'transformers', 'vllm', 'datasets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install -e .[cpu])")
def test_the_python_example_of_the_docs_runs_as_written(tmp_path, tiny_lm_dir):
    """The example of README.md and docs/python.md, run as written, shows learning in its 20 steps (issue 37
    item 19: its length reward was 0.93 at step 0, so the two printed rewards showed nothing)."""
    text = (REPO / "docs" / "python.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    readme = (REPO / "README.md").read_text()
    assert readme.split("```python\n", 1)[1].split("```", 1)[0] == example, "README's Python example is docs/python.md's"
    proc = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env=repo_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last, checkpoint = proc.stdout.splitlines()[-1].split()
    assert 0 <= float(first) <= 1 and 0 <= float(last) <= 1
    assert float(last) >= float(first) + 0.2, (first, last)  # printed 0.34 -> 0.95
    assert Path(checkpoint).parent.parent.parent == tmp_path / "runs" and Path(checkpoint).name == "step_000020"



# ------------------------------------------------------------------------------------ TRL users' first try
def trl_order(prompts, completions, **kwargs):
    """A reward in TRL's argument order: unirl would pass the completions as ``prompts``, then ``prompts`` again."""
    return [0.0] * len(completions)


def test_trls_model_and_reward_funcs_are_taken(tmp_path, tiny_lm_dir):
    result = unirl.train("text", "tiny", {"trainer.total_steps": 1, "rollout.engine": "hf", "data.test": None},
                         model=tiny_lm_dir, reward_funcs=[ends_right], train_data=ROWS, output_dir=tmp_path / "run",
                         progress=False)
    assert result.config.model.name_or_path == str(tiny_lm_dir) and [r.name for r in result.config.rewards] == ["ends_right"]
    assert "reward/ends_right" in result.metrics[0]
    with pytest.raises(TypeError, match=r"has no 'train_dataset' \(TRL's GRPOTrainer argument\); here it is train_data="):
        unirl.train("text", "tiny", train_dataset=ROWS, output_dir=tmp_path / "other")
    with pytest.raises(TypeError, match=r"unexpected argument 'reward'; did you mean rewards"):
        unirl.train("text", "tiny", reward=[ends_right], output_dir=tmp_path / "other")
    with pytest.raises(TypeError, match="rewards or reward_funcs"):
        unirl.train("text", "tiny", rewards=[ends_right], reward_funcs=[ends_right], output_dir=tmp_path / "other")


def test_a_reward_in_trls_argument_order_is_refused_before_anything_loads(tmp_path):
    """It failed after the first rollout (41 s) with "got multiple values for argument 'prompts'"."""
    from unirl.preflight import PreflightError

    with pytest.raises(PreflightError) as err:
        unirl.train("text", "tiny", rewards=[trl_order], train_data=ROWS, output_dir=tmp_path / "run")
    assert ("reward 'trl_order' takes (prompts, completions, ...) first, TRL's order; unirl calls a reward as "
            "reward(samples, prompts=..., **columns)") in str(err.value)
    assert "def trl_order(completions, prompts, **kwargs)" in str(err.value)
    assert not (tmp_path / "run" / "run.log").exists()  # no model was loaded


def test_an_unknown_key_suggests_the_same_name_in_another_section():
    from unirl.config import ConfigError

    with pytest.raises(ConfigError, match=r"trainer\.lr: unknown key\. Did you mean 'optim\.lr', 'critic\.optim\.lr'\?"):
        unirl.load_config("text", "tiny", ["trainer.lr=1e-5"])
    with pytest.raises(ConfigError, match=r"trainer\.lr: unknown key\. Did you mean 'optim\.lr'"):
        unirl.load_config("text", {"trainer": {"lr": 1e-5}})
