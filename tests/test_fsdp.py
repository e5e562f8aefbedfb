"""``trainer.strategy: fsdp2`` against DDP on two real gloo processes (``tests/fsdp_equivalence.py``).

The same rows on the same two processes, from the same initial weights, give the same logged losses,
gradient norms and trained weights (to 1e-5 in float32) whether each process holds a whole model
(DDP's all-reduce) or a shard of it (FSDP2's all-gather and reduce-scatter): GRPO with the KL to a
sharded frozen reference, PPO with a sharded critic, FlowGRPO on the toy SD3 with LoRA.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from test_distributed import REPO, _torchrun

pytestmark = pytest.mark.slow

FIGURES = ("loss/total", "loss/policy", "actor/grad_norm", "actor/clip_frac", "adv/mean")


@pytest.fixture(scope="module")
def ddp_and_fsdp2(tmp_path_factory, tiny_lm_dir):
    work = tmp_path_factory.mktemp("fsdp")
    script = str(REPO / "tests" / "fsdp_equivalence.py")
    batch = work / "batch.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, script, "--prepare", "--batch", str(batch), "--work", str(work / "prep")],
                   check=True, cwd=REPO, env=env, capture_output=True, timeout=600)
    _torchrun(2, script, "--batch", str(batch), "--work", str(work / "two"), "--out", str(work / "two.pt"))
    return torch.load(work / "two.pt", weights_only=False)


@pytest.mark.parametrize("case", ["grpo", "ppo", "flowgrpo-lora"])
def test_fsdp2_updates_as_ddp(ddp_and_fsdp2, case):
    ddp, sharded = ddp_and_fsdp2[(case, "ddp")], ddp_and_fsdp2[(case, "fsdp2")]
    for step, (a, b) in enumerate(zip(ddp["steps"], sharded["steps"])):
        for name in FIGURES + (("critic/vf_loss", "critic/grad_norm") if case == "ppo" else ()):
            assert b[name] == pytest.approx(a[name], abs=1e-5, rel=1e-5), (case, step, name)
    assert ddp["steps"][1]["actor/grad_norm"] > 0
    torch.testing.assert_close(sharded["start"], ddp["start"], rtol=0, atol=0)
    assert (ddp["weights"] - ddp["start"]).abs().max() > 1e-4, f"{case}: the update moved nothing, the check could not fail"
    torch.testing.assert_close(sharded["weights"], ddp["weights"], rtol=0, atol=1e-5, msg=f"{case}: weights differ")
    if case == "ppo":
        torch.testing.assert_close(sharded["critic"], ddp["critic"], rtol=0, atol=1e-5, msg="critic weights differ")
    if case == "grpo":  # the KL is to a frozen copy, sharded like the policy
        assert sharded["sharded_ref"] and ddp["steps"][1]["loss/kl"] > 0
        assert sharded["steps"][1]["loss/kl"] == pytest.approx(ddp["steps"][1]["loss/kl"], abs=1e-6, rel=1e-5)
