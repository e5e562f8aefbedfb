"""The text slice end to end through the ``unirl`` CLI, on the tiny model, with real vLLM.

The main test runs exactly the README's demo job (``configs/text/tiny.yaml``) in a subprocess and
checks what a newcomer would look at: the reward rises, the run directory is complete, the weights
changed, and the checkpoint loads back with transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def _unirl(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unirl.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_rows(run: Path) -> list[dict]:
    return [m for m in _metrics(run) if "reward/mean" in m]


@pytest.fixture(scope="module")
def tiny_run(tiny_demo_run) -> Path:
    return tiny_demo_run[0]  # tests/conftest.py: the README's demo command, once a session


def test_tiny_demo_reward_rises(tiny_run):
    rewards = [m["reward/mean"] for m in _train_rows(tiny_run)]
    assert len(rewards) == 150
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + 0.2, f"reward did not rise enough: first-10 {first:.3f}, last-10 {last:.3f}"


def test_tiny_demo_metrics_and_run_dir(tiny_run):
    rows = _train_rows(tiny_run)
    assert [m["step"] for m in rows] == list(range(1, 151))
    for key in ("reward/mean", "reward/gsm8k", "loss/policy", "loss/total", "actor/clip_frac", "actor/approx_kl",
                "actor/grad_norm", "rollout/logprob_diff_max", "rollout/logprob_diff_mean",
                "time/rollout", "time/score", "time/advantages", "time/old_logprobs", "time/update", "time/sync",
                "time/step", "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", "perf/throughput"):
        assert all(key in m for m in rows), key
    info = json.loads((tiny_run / "run_info.json").read_text())  # what the run ran on (unirl/trainer/perf.py)
    assert info["world_size"] == 1 and info["dtype"] == "float32" and info["attn_implementation"]
    # vLLM (float32) and the trainer agree on the sampled tokens' log-probs, step after step, so
    # the weight sync keeps the engine on the current policy.
    assert max(m["rollout/logprob_diff_max"] for m in rows) < 1e-4
    evals = [m for m in _metrics(tiny_run) if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 50, 100, 150]
    assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"]
    resolved = yaml.safe_load((tiny_run / "config.yaml").read_text())
    assert resolved["trainer"]["total_steps"] == 150 and resolved["output_dir"] == str(tiny_run)
    assert sorted(p.name for p in (tiny_run / "checkpoints").iterdir()) == ["step_000100", "step_000150"]


def test_tiny_demo_checkpoint_loads_and_weights_changed(tiny_run, tiny_lm_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = tiny_run / "checkpoints" / "step_000150"
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    initial = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32)
    changed = [n for (n, p), (_, q) in zip(trained.named_parameters(), initial.named_parameters()) if not torch.equal(p, q)]
    assert len(changed) == len(list(initial.parameters()))
    # The checkpoint is a working model: greedy answers in the task's format.
    ids = tokenizer("2+2=?", return_tensors="pt").input_ids
    out = trained.generate(ids, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).startswith("#### ")
    state = json.loads((ckpt / "trainer_state" / "loop.json").read_text())
    # one optimizer step per training step; no prompt batches drawn by dynamic sampling (it is off); the streak of
    # all-zero-advantage steps as the last step logged it
    streak = _train_rows(tiny_run)[-1]["adv/zero_adv_steps"]
    assert state == {"step": 150, "optimizer_steps": 150, "prompt_batches": 0, "zero_adv_steps": streak}


def test_hf_engine_run_and_resume(tmp_path, tiny_lm_dir):
    """The transformers engine path, then ``resume`` continuing from the latest checkpoint."""
    run = tmp_path / "run"
    common = ["train", "text", "--config", "tiny", "--output-dir", str(run), "rollout.engine=hf",
              "trainer.prompts_per_step=4", "trainer.mini_batch_size=16", "trainer.micro_batch_size=8",
              "trainer.eval_every=0", "trainer.save_every=2", "trainer.progress=false"]
    proc = _unirl(*common, "trainer.total_steps=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [m["step"] for m in _train_rows(run)] == [1, 2]
    # The same directory without resume is refused rather than mixed with a new run.
    proc = _unirl(*common, "trainer.total_steps=2")
    assert proc.returncode != 0 and "already holds a run" in proc.stderr
    proc = _unirl(*common, "trainer.total_steps=4", "trainer.resume=true")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [m["step"] for m in _train_rows(run)] == [1, 2, 3, 4]
    assert "resumed from" in proc.stdout + proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    # The HF engine samples with the trainer's own weights: no engine/trainer gap to speak of.
    assert max(m["rollout/logprob_diff_max"] for m in _train_rows(run)) < 1e-4
    # 2 steps + resume 2 is the 4-step run bit for bit: weights, optimizer, schedule and RNG restored.
    # (the uninterrupted reference run in this process: the CLI's own path, unirl.train, without a Python start-up)
    import unirl

    straight = tmp_path / "straight"
    unirl.train("text", "tiny", [*common[6:], "trainer.total_steps=4"], output_dir=straight, progress=False)
    untimed = [[(k, v) for k, v in m.items() if not k.startswith(("time/", "perf/"))] for m in _train_rows(run)]
    assert untimed == [[(k, v) for k, v in m.items() if not k.startswith(("time/", "perf/"))] for m in _train_rows(straight)]
    # A changed learning rate would be ignored by the restored optimizer: refused, naming it, and
    # config.yaml keeps the value the run trained with.
    lr = yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"]
    proc = _unirl(*common, "trainer.total_steps=6", "trainer.resume=true", f"optim.lr={lr * 2}")
    assert proc.returncode == 2 and f"optim.lr: {lr!r} in the checkpoint, {lr * 2!r} now" in proc.stderr, proc.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == lr


def test_dry_run_prints_resolved_config_without_loading(tmp_path):
    env = dict(os.environ, UNIRL_CACHE=str(tmp_path / "empty-cache"))
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "text", "--config", "gsm8k", "--dry-run",
                           "trainer.total_steps=7", "--output-dir", str(tmp_path / "x")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["model"]["name_or_path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolved["trainer"]["total_steps"] == 7
    assert not (tmp_path / "x").exists() and not (tmp_path / "empty-cache").exists()


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.totl_steps=3", "trainer.totl_steps"),
        ("trainer.total_steps=many", "trainer.total_steps"),
        ("trainer.prompts_per_step=3", "mini_batch_size"),
        ("rollout.engine=sglang", "rollout.engine"),
    ],
)
def test_bad_config_stops_early_with_the_key(override, expected, tmp_path):
    proc = _unirl("train", "text", "--config", "tiny", "--output-dir", str(tmp_path / "r"), override, timeout=120)
    assert proc.returncode == 2
    assert expected in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()


def test_a_bad_key_or_checkpoint_fails_before_the_model_libraries_load(tmp_path):
    """``unirl train`` and ``unirl eval`` check the config (and the checkpoint) first: the one-line error comes
    before transformers and diffusers are imported (~3 s of a CLI start), not after."""
    probe = ("import sys\nfrom unirl.cli import main\nrc = main(sys.argv[1:])\n"
             "print(rc, sorted(m for m in ('transformers', 'diffusers') if m in sys.modules))")
    for args in (["train", "text", "--config", "tiny", "trainer.totl_steps=3"],
                 ["eval", "text", "--config", "tiny", "--checkpoint", str(tmp_path / "nowhere" / "step_000003")]):
        proc = subprocess.run([sys.executable, "-c", probe, *args], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env=dict(os.environ))
        assert proc.stdout.split() == ["2", "[]"], (args, proc.stdout, proc.stderr[-2000:])
        error = proc.stderr.splitlines()[-1]  # eval says which config first
        assert error.startswith("unirl: ") and ("totl_steps" in error or "does not exist" in error), proc.stderr


def test_unknown_config_name_lists_available():
    proc = _unirl("train", "text", "--config", "gsm9k", timeout=120)
    assert proc.returncode == 2 and "gsm8k" in proc.stderr and "tiny" in proc.stderr


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_kl_reference_and_tis_paths(tmp_path, tiny_lm_dir, lora):
    """KL to the reference (LoRA: adapter disabled; full: frozen copy) and TIS weights, 2 steps."""
    from transformers import AutoModelForCausalLM

    import unirl

    run = tmp_path / "run"
    # In this process: the CLI's own path (unirl.train), without a second Python and torch start-up.
    unirl.train("text", "tiny", ["rollout.engine=hf", f"model.lora.enabled={str(lora).lower()}", "model.lora.r=8",
                                 "algo.kl_coef=0.05", "algo.tis_cap=2.0", "trainer.prompts_per_step=4",
                                 "trainer.mini_batch_size=16", "trainer.micro_batch_size=8", "trainer.ppo_epochs=2",
                                 "trainer.total_steps=2", "trainer.eval_every=0"], output_dir=run, progress=False)
    rows = _train_rows(run)
    # Step 1, first mini-batch: policy == reference, so the KL is 0; later updates move it away.
    assert all("loss/kl" in m for m in rows)
    assert rows[-1]["loss/kl"] > 0
    ckpt = run / "checkpoints" / "step_000002"
    merged = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32)
    assert any(not torch.equal(p, q) for p, q in zip(merged.parameters(), initial.parameters()))
    if lora:
        from peft import PeftModel

        assert (ckpt / "adapter" / "adapter_config.json").exists()
        with_adapter = PeftModel.from_pretrained(initial, ckpt / "adapter").merge_and_unload()
        for p, q in zip(with_adapter.parameters(), merged.parameters()):
            torch.testing.assert_close(p, q)


def test_every_way_of_naming_a_reward_in_a_run(tmp_path, tiny_lm_dir):
    """A registered name, a file.py:function, a package.module:function and an installed package's
    ``unirl.rewards`` entry point, all in one config, through a short run; each is logged."""
    site = tmp_path / "site"
    (site / "e2e_plugin").mkdir(parents=True)
    (site / "e2e_plugin" / "__init__.py").write_text("")
    (site / "e2e_plugin" / "rules.py").write_text(
        "def has_marker(samples, **kwargs):\n    return [float('####' in s) for s in samples]\n\n"
        "def short(samples, *, limit, **kwargs):\n    return [float(len(s) <= limit) for s in samples]\n"
    )
    info = site / "e2e_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: e2e-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[unirl.rewards]\ne2e_short = e2e_plugin.rules:short\n")
    (tmp_path / "my_reward.py").write_text(
        "def not_applicable_to_odd(samples, *, prompts, **kwargs):\n"
        "    return [None if int(p[0]) % 2 else 1.0 for p in prompts]\n"
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "rewards": [
            {"name": "gsm8k"},
            {"name": f"{tmp_path / 'my_reward.py'}:not_applicable_to_odd", "weight": 0.5},
            {"name": "e2e_plugin.rules:has_marker", "weight": 0.25},
            {"name": "e2e_short", "weight": 0.25, "kwargs": {"limit": 6}},
        ],
        "rollout": {"engine": "hf", "max_new_tokens": 8},
        "trainer": {"total_steps": 2, "prompts_per_step": 4, "group_size": 4, "mini_batch_size": 16,
                    "micro_batch_size": 16, "eval_every": 0, "progress": False},
    }))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "text", "--config", str(config),
                           "--output-dir", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for m in _train_rows(tmp_path / "run"):
        for name in ("gsm8k", "has_marker", "e2e_short"):
            assert 0.0 <= m[f"reward/{name}"] <= 1.0, name
        # The reward applies only to even first operands, so its logged mean is over those: 1
        # (NaN if a step drew none; the sampler is seeded, so that is deterministic).
        value = m["reward/not_applicable_to_odd"]
        assert value == 1.0 or value != value
        assert m["reward/mean"] <= 1 + 0.5 + 0.25 + 0.25


def test_a_failing_reward_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, tiny_lm_dir):
    (tmp_path / "flaky.py").write_text(
        "CALLS = 0\n\n"
        "def flaky(samples, *, prompts, **kwargs):\n"
        "    global CALLS\n"
        "    CALLS += len(samples) > 1  # batch calls only (a failing batch is re-scored sample by sample)\n"
        "    if CALLS >= 3:\n"
        "        raise RuntimeError('reward server fell over')\n"
        "    return [0.5] * len(samples)\n"
    )
    run = tmp_path / "run"
    proc = _unirl("train", "text", "--config", "tiny", "--output-dir", str(run), "rollout.engine=hf",
                  f"rewards=[{{name: {tmp_path / 'flaky.py'}:flaky}}]", "trainer.prompts_per_step=4",
                  "trainer.mini_batch_size=32", "trainer.micro_batch_size=32", "trainer.total_steps=5",
                  "trainer.eval_every=0", "trainer.save_every=2", "trainer.progress=false")
    assert proc.returncode == 2
    assert "flaky" in proc.stderr and "reward server fell over" in proc.stderr
    assert "sample 0" in proc.stderr and "=?" in proc.stderr  # the sample index and its prompt
    # One line, no traceback, saying where the finished work is.
    assert "Traceback" not in proc.stderr
    line = [x for x in proc.stderr.splitlines() if x.startswith("unirl: ")]
    assert len(line) == 1 and f"the last checkpoint is {run / 'checkpoints' / 'step_000002'}" in line[0]
    assert [m["step"] for m in _train_rows(run)] == [1, 2]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000002")
