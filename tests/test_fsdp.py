"""``trainer.strategy: fsdp2`` on real gloo processes.

Parity (``tests/fsdp_equivalence.py``): the same rows on the same two processes, from the same initial
weights, give the same logged losses, gradient norms and trained weights (to 1e-5 in float32) whether
each process holds a whole model (DDP's all-reduce) or a shard of it (FSDP2's all-gather and
reduce-scatter): GRPO with the KL to a sharded frozen reference, PPO with a sharded critic, FlowGRPO on
the toy SD3 with LoRA, and GRPO with host offload and with activation checkpointing.

Checkpoints: a 1-process FSDP2 run resumed from its checkpoint ends with the weights of an uninterrupted
run; a checkpoint written by 2 processes loads on 1 (sharded, or whole under DDP) and one written by 1
loads on 2, every weight and AdamW moment as saved (the moments put together here from the files'
documented format, not with unirl's reader); the export is a plain HF directory.

Weight sync (``tests/fsdp_sync_check.py``): vLLM's log-probs equal the trainer's after a bucketed sync
from shards, with and without LoRA.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from conftest import run_stopped_after
from test_distributed import REPO, _torchrun, cpu_env

pytestmark = pytest.mark.slow

FIGURES = ("loss/total", "loss/policy", "actor/grad_norm", "actor/clip_frac", "adv/mean")


@pytest.fixture(scope="module")
def ddp_and_fsdp2(tmp_path_factory, equivalence_batch):
    work = tmp_path_factory.mktemp("fsdp")
    script = str(REPO / "tests" / "fsdp_equivalence.py")
    batch, _ = equivalence_batch  # tests/conftest.py: test_distributed's batch, made once a session
    _torchrun(2, script, "--batch", str(batch), "--work", str(work / "two"), "--out", str(work / "two.pt"))
    return torch.load(work / "two.pt", weights_only=False)


@pytest.mark.parametrize("case,variant", [("grpo", "fsdp2"), ("ppo", "fsdp2"), ("flowgrpo-lora", "fsdp2"),
                                          ("grpo", "fsdp2-offload"), ("grpo", "fsdp2-checkpointing")])
def test_fsdp2_updates_as_ddp(ddp_and_fsdp2, case, variant):
    """``fsdp2-offload``: trainer.fsdp.offload=params (on the CPU the same memory; the step runs through
    CPUOffloadPolicy's code); ``fsdp2-checkpointing``: model.gradient_checkpointing under FSDP2."""
    ddp, sharded = ddp_and_fsdp2[(case, "ddp")], ddp_and_fsdp2[(case, variant)]
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


# ===================================================================== checkpoints
RUN = ["train", "text", "--config", "tiny", "trainer.strategy=fsdp2", "rollout.engine=hf", "rollout.max_new_tokens=12",
       "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batch_size=16", "trainer.micro_batch_size=8",
       "trainer.eval_every=0", "trainer.progress=false", "trainer.save_every=1", "trainer.keep_checkpoints=null"]
ENV = cpu_env()


def _train(nproc: int, out, *extra: str) -> None:
    args = ["-m", "unirl.cli", *RUN, "--output-dir", str(out), *extra]
    if nproc == 1:
        result = subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    else:
        _torchrun(nproc, *args)


def _load(nproc: int, checkpoint, strategy: str, work):
    script = str(REPO / "tests" / "fsdp_equivalence.py")
    args = [script, "--load", str(checkpoint), "--strategy", strategy, "--work", str(work), "--out", str(work / "out.pt")]
    if nproc == 1:
        subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, check=True, capture_output=True, timeout=600)
    else:
        _torchrun(nproc, *args)
    return torch.load(work / "out.pt", weights_only=False)


def _saved_moments(state_dir) -> dict[int, dict[str, torch.Tensor]]:
    """The AdamW moments of an FSDP2 checkpoint, put together here from each process's files (the format's
    JSON read directly, each shard placed at its offset), independently of unirl's reader."""
    import json

    from safetensors.torch import load_file

    moments: dict[int, dict[str, torch.Tensor]] = {}
    for meta in sorted(state_dir.glob("policy_optimizer.rank*of*.json")):
        tensors = load_file(str(meta).removesuffix(".json") + ".safetensors")
        for index, entry in json.loads(meta.read_text())["state"]["__items__"]:
            for key, ref in entry.items():
                if "__shard__" in ref:
                    whole = moments.setdefault(index, {}).setdefault(key, torch.zeros(ref["shape"]))
                    local = tensors[ref["__shard__"]]
                    whole.narrow(ref["dim"], ref["offset"], local.shape[ref["dim"]]).copy_(local)
                else:
                    moments.setdefault(index, {})[key] = tensors[ref["__tensor__"]]
    return moments


def _exported(checkpoint) -> dict[str, torch.Tensor]:
    """The exported HF directory's weights: FSDP2 writes them bucket by bucket, listed in the index."""
    from safetensors.torch import load_file

    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(checkpoint / file)))
    assert out.keys() == index["weight_map"].keys()
    return out


def _assert_loaded(loaded, checkpoint) -> None:
    exported = _exported(checkpoint)  # gathered at save time, a bucket at a time, written by the main process
    assert set(exported) <= set(loaded["weights"])
    for name, tensor in exported.items():
        torch.testing.assert_close(loaded["weights"][name], tensor, rtol=0, atol=0, msg=name)
    saved = _saved_moments(checkpoint / "trainer_state")
    assert saved and saved.keys() == loaded["moments"].keys()
    for index, state in saved.items():
        for key, value in state.items():
            torch.testing.assert_close(loaded["moments"][index][key], value, rtol=0, atol=0, msg=f"{index} {key}")


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, tiny_lm_dir):
    work = tmp_path_factory.mktemp("fsdp_ckpt")
    _train(1, work / "straight", "trainer.total_steps=3")
    # The straight run stopped after its step-2 checkpoint (not trained again to get one), resumed.
    _train(1, run_stopped_after(work / "straight", 2, work / "resumed"), "trainer.total_steps=3", "trainer.resume=true")
    _train(2, work / "two", "trainer.total_steps=2")
    return work


def test_fsdp2_resume_is_exact_on_one_process(fsdp_runs):
    from transformers import AutoModelForCausalLM

    final = "checkpoints/step_000003"
    a, b = _exported(fsdp_runs / "straight" / final), _exported(fsdp_runs / "resumed" / final)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    # The export is a plain HF directory: from_pretrained reads it as the trained weights.
    model = AutoModelForCausalLM.from_pretrained(fsdp_runs / "straight" / final)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, a[name if name in a else "model.embed_tokens.weight"], rtol=0, atol=0)
    state = fsdp_runs / "two" / "checkpoints" / "step_000002" / "trainer_state"
    assert {p.name for p in state.glob("policy.rank*")} == {f"policy.rank{r}of2.{e}" for r in (0, 1)
                                                             for e in ("json", "safetensors")}
    assert not list(state.rglob("*.bin")) and not list(state.rglob("*.pt")) and not list(state.rglob("*.pkl"))


@pytest.mark.parametrize("nproc,written_by,strategy", [(1, "two", "fsdp2"), (1, "two", "ddp"), (2, "resumed", "fsdp2")])
def test_fsdp2_checkpoints_reshard(fsdp_runs, tmp_path, nproc, written_by, strategy):
    """A checkpoint of 2 processes loads on 1 (sharded or whole) and one of 1 process on 2: every weight and
    AdamW moment is the one saved."""
    checkpoint = fsdp_runs / written_by / "checkpoints" / "step_000002"
    loaded = _load(nproc, checkpoint, strategy, tmp_path)
    assert loaded["world"] == nproc
    _assert_loaded(loaded, checkpoint)


# ===================================================================== weight sync
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install -e .[cpu])")
def test_sharded_weight_sync_gives_vllm_the_trainers_logprobs(tmp_path, tiny_lm_dir):
    """A sharded policy (full fine-tuning, and LoRA merged from its gathered pieces) synced to vLLM in
    buckets of 1 MiB (the tiny model: 1.3 MB, so more than one): vLLM's log-probs of its samples then
    equal the trainer's, as tests/test_vllm_engine.py checks for a whole model."""
    script = str(REPO / "tests" / "fsdp_sync_check.py")
    subprocess.run([sys.executable, script, "--out", str(tmp_path / "sync.json")], cwd=REPO, env=ENV, check=True,
                   capture_output=True, timeout=600)
    for name, result in json.loads((tmp_path / "sync.json").read_text()).items():
        assert result["sharded"], name
        assert result["before"] < 1e-4 and result["stale"] > 1e-2, (name, result)  # the weights moved
        assert result["after"] < 1e-4, (name, result)
        assert len(result["buckets"]) > 1, (name, result)
