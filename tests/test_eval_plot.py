"""``unirl eval`` and ``unirl plot``: the commands run for real on tiny runs made here."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import unirl
from unirl.core.eval_metrics import pass_at_k

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unirl.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("n", [1, 3, 5])
def test_pass_at_k_is_the_chance_that_a_random_k_subset_holds_a_correct_answer(n):
    for c in range(n + 1):
        answers = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(answers, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(3, 4, 1)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_lm_dir):
    """A 3-step run trained in this process (``unirl.train``, the CLI's own path): ``eval`` and ``plot``, the
    commands under test here, run as real commands on it."""
    out = tmp_path_factory.mktemp("evalplot") / "run"
    unirl.train("text", "tiny", ["rollout.engine=hf", "rollout.max_new_tokens=8", "trainer.total_steps=3",
                                 "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.mini_batch_size=8",
                                 "trainer.micro_batch_size=8", "trainer.eval_every=3", "data.eval_size=4"],
                output_dir=out, progress=False)
    return out


@pytest.mark.slow
def test_eval_scores_a_checkpoint_greedy_and_sampled(tiny_run, tmp_path):
    ckpt = tiny_run / "checkpoints" / "step_000003"
    greedy = _cli("eval", "text", "--config", "tiny", "--checkpoint", str(ckpt), "--output-dir", str(tmp_path / "g"),
                  "rollout.engine=hf", "data.eval_size=4")
    assert greedy.returncode == 0, greedy.stderr[-3000:]
    summary = json.loads((tmp_path / "g" / "summary.json").read_text())
    # The run's own greedy evaluation at step 3 scored the same 4 prompts with the same weights.
    run_eval = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()][-1]
    assert summary["accuracy"] == pytest.approx(run_eval["eval/accuracy"])
    assert greedy.stdout.strip().splitlines()[-1].startswith(f"eval {ckpt}: 4 prompts x 1, accuracy")
    samples = [json.loads(line) for line in (tmp_path / "g" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all({"prompt", "response", "reward/gsm8k", "correct"} <= s.keys() for s in samples)

    sampled = _cli("eval", "text", "--config", "tiny", "--checkpoint", str(ckpt), "--output-dir", str(tmp_path / "s"),
                   "--n", "4", "--k", "2", "rollout.engine=hf", "data.eval_size=4")
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    samples = [json.loads(line) for line in (tmp_path / "s" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16 and summary["n"] == 4
    per_prompt = [sum(s["correct"] for s in samples if s["index"] == i) for i in range(4)]
    for k in (1, 2, 4):
        assert summary[f"pass@{k}"] == pytest.approx(sum(pass_at_k(4, c, k) for c in per_prompt) / 4)


@pytest.mark.slow
def test_eval_diffusion_reproduces_the_runs_own_evaluation(tmp_path):
    run = tmp_path / "run"
    # Trained in this process (the CLI's own path); the command under test, eval, runs as a command.
    unirl.train("diffusion", "tiny", ["trainer.total_steps=3", "trainer.eval_every=3"], output_dir=run, progress=False)
    ckpt = run / "checkpoints" / "step_000003"
    result = _cli("eval", "diffusion", "--config", "tiny", "--checkpoint", str(ckpt))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((ckpt / "eval" / "summary.json").read_text())
    # The checkpoint holds the EMA LoRA the run evaluated with; same prompts, seeds and sampler.
    run_eval = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert summary["reward"] == pytest.approx(run_eval["eval/reward"], abs=1e-6)
    assert summary["prompts"] == 8 and (ckpt / "eval" / "grid.png").exists()
    assert len((ckpt / "eval" / "samples.jsonl").read_text().splitlines()) == 8
    assert result.stdout.strip().splitlines()[-1].startswith(f"eval {ckpt}: 8 prompts x 1, reward ")


def test_eval_names_a_checkpoint_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    result = _cli("eval", "text", "--config", "tiny", "--checkpoint", str(tmp_path / "empty"), "rollout.engine=hf")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"--checkpoint {tmp_path / 'empty'}: neither a model directory" in result.stderr


@pytest.mark.slow
def test_plot_overlays_runs_with_a_panel_per_metric(tiny_run, tmp_path):
    from PIL import Image

    other = tmp_path / "other"
    other.mkdir()
    rows = [{"step": s, "reward/mean": 0.1 * s} for s in range(1, 4)] + [{"step": 3, "eval/accuracy": 0.5}]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "curves.png"
    result = _cli("plot", str(tiny_run), str(other), "--out", str(out), "--metrics", "reward/mean,eval/accuracy")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == f"wrote {out}"
    width, height = Image.open(out).size
    assert width > height > 200  # two panels side by side

    missing = _cli("plot", str(tiny_run), "--metrics", "reward/nope")
    assert missing.returncode == 2 and "--metrics: reward/nope not logged by these runs; logged:" in missing.stderr
    not_a_run = _cli("plot", str(tmp_path / "nowhere"))
    assert not_a_run.returncode == 2 and "no metrics.jsonl there" in not_a_run.stderr


# ------------------------------------------------------------------ faults (issue 37 item 10)
def _truncate_safetensors(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return dst


def test_eval_of_a_truncated_safetensors_is_one_line_naming_the_file(tmp_path, tiny_lm_dir):
    ckpt = _truncate_safetensors(Path(tiny_lm_dir), tmp_path / "cut")
    result = _cli("eval", "text", "--config", "tiny", "--checkpoint", str(ckpt), "rollout.engine=hf")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"checkpoint file {ckpt / 'model.safetensors'} is truncated" in result.stderr


@pytest.mark.parametrize("missing", ["/nowhere/run/checkpoints/step_000003", "run/checkpoints/step_000003", "./step_3"])
def test_eval_of_a_missing_checkpoint_says_it_does_not_exist(missing, tmp_path):
    import unirl

    with pytest.raises(FileNotFoundError, match=f"--checkpoint {missing} does not exist"):
        unirl.evaluate("text", "tiny", ["rollout.engine=hf"], checkpoint=missing, output_dir=tmp_path / "e")
    result = _cli("eval", "diffusion", "--config", "tiny", "--checkpoint", missing)
    assert result.returncode == 2 and f"--checkpoint {missing} does not exist" in result.stderr, result.stderr[-2000:]
    assert not (REPO / "eval" / Path(missing).name).exists()  # nothing written for it


def test_eval_leaves_no_temporary_directory_even_for_a_lora_checkpoint(tmp_path, tiny_lm_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_lm_dir),
                                LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(adapter)
    temp = tmp_path / "tmp"
    temp.mkdir()
    for ckpt in (adapter, Path(tiny_lm_dir)):
        result = subprocess.run([sys.executable, "-m", "unirl.cli", "eval", "text", "--config", "tiny", "--checkpoint",
                                 str(ckpt), "--output-dir", str(tmp_path / "out"), "rollout.engine=hf", "data.eval_size=2",
                                 "rollout.max_new_tokens=4"], cwd=REPO, capture_output=True, text=True, timeout=600,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(temp)})
        assert result.returncode == 0, result.stderr[-3000:]
        assert not list(temp.glob("unirl-eval-*")), f"left behind by eval of {ckpt}"


def test_plot_names_the_file_of_a_list_row_and_of_a_binary_file(tmp_path):
    from unirl.plot import PlotError, read_rows

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n[1, 2, 3]\n')
    with pytest.raises(PlotError, match=r"a/metrics\.jsonl:2: not a JSON object \(a list\)"):
        read_rows(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    result = _cli("plot", str(tmp_path / "b"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{tmp_path / 'b' / 'metrics.jsonl'}: not a text file" in result.stderr


def test_eval_of_a_runs_checkpoint_scores_with_the_runs_saved_config(tmp_path, tiny_lm_dir):
    """A run trained on its own reward: ``--config tiny`` (gsm8k) used to score it with gsm8k."""
    import shutil

    import yaml

    from unirl.api import load_config
    from unirl.config import config_to_dict

    (tmp_path / "length.py").write_text("def length(samples, **kwargs):\n    return [len(s) / 100 for s in samples]\n")
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000001"
    shutil.copytree(tiny_lm_dir, ckpt)
    saved = load_config("text", "tiny", [f"rewards=[{{name: '{tmp_path / 'length.py'}:length'}}]"])
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(saved)))
    common = ["--checkpoint", str(ckpt), "rollout.engine=hf", "data.eval_size=2", "rollout.max_new_tokens=4"]
    own = _cli("eval", "text", "--config", "tiny", "--output-dir", str(tmp_path / "own"), *common)
    assert own.returncode == 0, own.stderr[-3000:]
    assert f"config: {run / 'config.yaml'} (the run's saved config; not tiny" in own.stderr
    summary = json.loads((tmp_path / "own" / "summary.json").read_text())
    assert "reward/length" in summary and "reward/gsm8k" not in summary
    told = _cli("eval", "text", "--config", "tiny", "--no-run-config", "--output-dir", str(tmp_path / "told"), *common)
    assert told.returncode == 0, told.stderr[-3000:]
    assert "config: tiny" in told.stderr and "reward/gsm8k" in json.loads((tmp_path / "told" / "summary.json").read_text())
    plain = _cli("eval", "text", "--output-dir", str(tmp_path / "plain"), *common)  # --config may be left out
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "reward/length" in json.loads((tmp_path / "plain" / "summary.json").read_text())


def test_default_plot_leaves_out_panels_whose_value_never_changes(tmp_path, capsys):
    """Issue 37 item 20: ``actor/clip_frac`` 0 in every step of an on-policy run was a flat panel."""
    from PIL import Image

    from unirl.plot import plot_runs

    for name, clip in (("a", 0.0), ("b", 0.0)):
        (tmp_path / name).mkdir()
        rows = [{"step": s, "reward/mean": 0.1 * s + (name == "b"), "actor/clip_frac": clip, "loss/kl": 0.01}
                for s in range(1, 5)] + [{"step": 4, "eval/accuracy": 0.5}]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "curves.png")
    err = capsys.readouterr().err
    # loss/kl is constant too; eval/accuracy has one point, which is not "never changes": it stays.
    assert "left out loss/kl (always 0.01), actor/clip_frac (always 0):" in err, err
    width, height = Image.open(out).size
    assert width > height  # two panels side by side (reward/mean, eval/accuracy), not four
    # Named with --metrics it is drawn, and nothing is said.
    plot_runs([tmp_path / "a"], tmp_path / "named.png", ["actor/clip_frac"])
    assert "left out" not in capsys.readouterr().err
    # A panel that changes in one run only is kept.
    (tmp_path / "b" / "metrics.jsonl").write_text(json.dumps({"step": 1, "actor/clip_frac": 0.2, "reward/mean": 1}) + "\n")
    plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "both.png")
    assert "actor/clip_frac" not in capsys.readouterr().err
