"""Several processes train as one: real gloo processes under ``torchrun``, on CPU.

The same global batch updated by 1 process and by 2 (each holding half of the rows) must give the
same logged loss, gradient norm and updated weights (to 1e-5 in float32), for every loss
aggregation mode, with and without KL, in both environments (and DiffusionNFT, with and without its KL) (``tests/dist_equivalence.py`` runs
the loop's stages; this file launches it). A short CLI run on 2 processes then checks what a user
sees: the logged step covers both processes' samples, and only the main process writes files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def cpu_env() -> dict[str, str]:
    """The environment of these tests' child processes: CPU processes over gloo, one thread each. CUDA is
    hidden so a GPU machine runs the same comparison (two ranks on its one GPU would need NCCL, which
    refuses two ranks on one device, and a GPU rank beside a CPU one would not compare to 1e-5)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _torchrun(nproc: int, *args: str, cwd: Path = REPO, timeout: int = 600) -> subprocess.CompletedProcess:
    """``torchrun --standalone``: its rendezvous store binds port 0 itself, so no other process can take the
    port between its choice and the bind (a free port picked here and closed could be)."""
    env = cpu_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory, equivalence_batch):
    batch, one = equivalence_batch  # tests/conftest.py: the batch and the one-process figures
    work = tmp_path_factory.mktemp("dist")
    script = str(REPO / "tests" / "dist_equivalence.py")
    _torchrun(2, script, "--batch", str(batch), "--work", str(work / "two"), "--out", str(work / "two.pt"))
    return torch.load(one, weights_only=False), torch.load(work / "two.pt", weights_only=False)


def test_one_and_two_processes_give_the_same_update(one_and_two):
    one, two = one_and_two
    # 2 environments x 4 modes x (KL on, off), 2 PPO, 2 DiffusionNFT (its KL on, off)
    assert len(one) == 20 and one.keys() == two.keys()
    for key, a in one.items():
        b = two[key]
        assert (a["world"], b["world"]) == (1, 2), key
        for name in ("loss/total", "loss/policy", "actor/grad_norm", "adv/mean", "adv/abs_mean", "adv/num_groups",
                     "adv/zero_std_frac"):
            assert b[name] == pytest.approx(a[name], abs=1e-5, rel=1e-5), (key, name)
        if key[2] > 0:
            assert a["loss/kl"] > 0 and b["loss/kl"] == pytest.approx(a["loss/kl"], abs=1e-5, rel=1e-5), key
        moved = (a["weights"] - one[(key[0], key[1], 0.0)]["weights"]).abs().max() if key[2] > 0 else None
        torch.testing.assert_close(b["weights"], a["weights"], rtol=0, atol=1e-5, msg=f"{key}: weights differ")
        if moved is not None:
            assert moved > 1e-5, f"{key}: the KL term changed nothing, so the check could not fail"


def test_ppo_one_and_two_processes_agree(one_and_two):
    """GAE's whitening and the KL controller see the global batch; the critic's update is the same."""
    one, two = one_and_two
    ppo = [key for key in one if key[0] == "text-ppo"]
    assert len(ppo) == 2
    for key in ppo:
        a, b = one[key], two[key]
        for name in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean",
                     "critic/explained_var", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "adv/mean",
                     "adv/abs_mean", "loss/policy", "actor/grad_norm"):
            assert b[name] == pytest.approx(a[name], abs=1e-5, rel=1e-5), (key, name)
        assert a["critic/vf_loss"] > 0 and a["actor/reward_kl_penalty"] != 0, key  # k1: a KL estimate of either sign
        assert a["kl_coef"] != 0.05 and b["kl_coef"] == pytest.approx(a["kl_coef"], abs=0, rel=1e-6), key
        torch.testing.assert_close(b["weights"], a["weights"], rtol=0, atol=1e-5, msg=f"{key}: actor weights differ")
        torch.testing.assert_close(b["critic_weights"], a["critic_weights"], rtol=0, atol=1e-5,
                                   msg=f"{key}: critic weights differ")


def test_a_two_process_cli_run_logs_the_global_batch_once(tmp_path, tiny_lm_dir):
    out = tmp_path / "run"
    _torchrun(2, "-m", "unirl.cli", "train", "text", "--config", "tiny", "--output-dir", str(out),
              "rollout.engine=hf", "rollout.max_new_tokens=12", "trainer.total_steps=2", "trainer.prompts_per_step=4",
              "trainer.group_size=4", "trainer.mini_batch_size=16", "trainer.micro_batch_size=8",
              "trainer.eval_every=2", "data.eval_size=6", "trainer.progress=false")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2]  # one row per step: only the main process writes
    assert all(r["adv/num_groups"] == 8 for r in train_rows)  # 2 processes x 4 prompts
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    samples = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 6  # all 6 held-out prompts at each evaluation, split over the processes
    assert (out / "checkpoints" / "step_000002" / "model.safetensors").exists()
    # Each process's RNG states beside the shared state; both processes resume from them.
    state = out / "checkpoints" / "step_000002" / "trainer_state"
    assert all((state / f"rng_{rank}.safetensors").exists() for rank in (0, 1))
    _torchrun(2, "-m", "unirl.cli", "train", "text", "--config", "tiny", "--output-dir", str(out),
              "rollout.engine=hf", "rollout.max_new_tokens=12", "trainer.total_steps=3", "trainer.prompts_per_step=4",
              "trainer.group_size=4", "trainer.mini_batch_size=16", "trainer.micro_batch_size=8",
              "trainer.eval_every=0", "data.eval_size=6", "trainer.progress=false", "trainer.resume=true")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
