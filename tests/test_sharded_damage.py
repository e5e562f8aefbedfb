"""A damaged FSDP2 checkpoint (``unirl/trainer/sharded_state.py``) is a ``StateFileError`` naming the file or
the key, which resume skips in one line before trying the checkpoint before, as for a DDP checkpoint: a
truncated shard, a tensor its JSON names but its file lacks, a value of the wrong type, a piece's dim,
offset or rows that do not tile the whole. Each was a torchrun traceback, an ``IndexError`` or, for an
optimizer's row gap, a resume that went on and failed at the first update.

The shards here are written by hand in the format the module docstring documents (two processes' rows
of a ``Linear(3, 4)``), independently of unirl's writer; the end-to-end test resumes a real 1-process
FSDP2 run whose latest checkpoint is damaged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from unirl.trainer.sharded_state import load_model_shards, load_optimizer_shards
from unirl.trainer.state_files import StateFileError


def _write(stem, model: torch.nn.Linear, change=None) -> None:
    """``model``'s weight and bias as two processes' shards of rows 0-1 and 2-3 (``torch.chunk``'s split)."""
    whole = {"weight": model.weight.detach(), "bias": model.bias.detach()}
    for rank in range(2):
        plain, tensors = {}, {}
        for name, tensor in whole.items():
            key = str(len(tensors))
            tensors[key] = tensor[2 * rank: 2 * rank + 2].contiguous()
            plain[name] = {"__shard__": key, "dim": 0, "offset": 2 * rank, "shape": list(tensor.shape)}
        if change is not None:
            change(rank, plain, tensors)
        save_file(tensors, f"{stem}.rank{rank}of2.safetensors")
        (stem.parent / f"{stem.name}.rank{rank}of2.json").write_text(json.dumps(plain))


def _on_rank(rank: int, edit):
    return lambda r, plain, tensors: edit(plain, tensors) if r == rank else None


DAMAGE = {  # name: (change to the files, what the error says)
    "missing_tensor": (_on_rank(1, lambda p, t: p["weight"].update({"__shard__": "9"})),
                       r"model_0\.rank1of2\.safetensors: cannot read tensor 9"),
    "wrong_type": (lambda r, p, t: p.update({"bias": [1, 2]}), r"bias is a list, not a saved tensor"),
    "wrong_type_on_one": (_on_rank(0, lambda p, t: p.update({"bias": [1, 2]})),
                          r"model_0\['bias'\]: the processes' files hold different states"),
    "bad_dim": (lambda r, p, t: p["weight"].update({"dim": 5}), r"model_0\['weight'\]: a piece of a \[4, 3\] tensor along dim 5"),
    "negative_offset": (_on_rank(0, lambda p, t: p["weight"].update({"offset": -1})), r"at offset -1: no such rows"),
    "row_gap": (_on_rank(1, lambda p, t: p["weight"].update({"offset": 3})),
                r"the pieces of a \[4, 3\] tensor do not tile rows 0-4 along dim 0 \(whole from 0 to 2 only\)"),
    "overlap": (_on_rank(1, lambda p, t: p["weight"].update({"offset": 1})), r"do not tile rows 0-4"),
    "other_width": (_on_rank(1, lambda p, t: t.update({"0": t["0"][:, :2].contiguous()})), r"do not tile rows 0-4"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_model_shard_is_a_state_file_error_naming_it(tmp_path, damage):
    torch.manual_seed(0)
    saved, into = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
    change, said = DAMAGE[damage]
    _write(tmp_path / "model_0", saved, change)
    with pytest.raises(StateFileError, match=said):
        load_model_shards(into, tmp_path / "model_0")


def test_whole_shards_load_exactly_and_a_truncated_one_is_named(tmp_path):
    torch.manual_seed(0)
    saved, into = torch.nn.Linear(3, 4), torch.nn.Linear(3, 4)
    _write(tmp_path / "model_0", saved)
    load_model_shards(into, tmp_path / "model_0")
    assert torch.equal(into.weight, saved.weight) and torch.equal(into.bias, saved.bias)
    shard = tmp_path / "model_0.rank1of2.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(StateFileError, match=r"model_0\.rank1of2\.safetensors: cannot read tensor 0 \(.*"):
        load_model_shards(torch.nn.Linear(3, 4), tmp_path / "model_0")


def test_an_optimizer_shard_with_a_row_gap_is_named_not_loaded(tmp_path):
    """Before, the moments came back 2 rows short and the resume went on until the first update failed."""
    model = torch.nn.Linear(3, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    for rank in range(2):
        state, tensors = [], {}
        for index, param in enumerate((model.weight, model.bias)):
            entry = {"step": {"__tensor__": f"s{index}"}}
            tensors[f"s{index}"] = torch.tensor(1.0)
            for moment in ("exp_avg", "exp_avg_sq"):
                key = f"{moment}{index}"
                tensors[key] = torch.ones_like(param[2 * rank: 2 * rank + 2]).contiguous()
                offset = 3 if (rank, index, moment) == (1, 0, "exp_avg") else 2 * rank  # rows 2 of the weight's missing
                entry[moment] = {"__shard__": key, "dim": 0, "offset": offset, "shape": list(param.shape)}
            state.append([index, entry])
        groups = [{**{k: v for k, v in optimizer.param_groups[0].items() if k != "params"}, "params": [0, 1]}]
        save_file(tensors, str(tmp_path / f"optimizer_0.rank{rank}of2.safetensors"))
        (tmp_path / f"optimizer_0.rank{rank}of2.json").write_text(
            json.dumps({"state": {"__items__": state}, "param_groups": groups}, default=list))
    with pytest.raises(StateFileError, match=r"optimizer_0\.rank0of2\.safetensors: the pieces of a \[4, 3\] tensor do "
                                             r"not tile rows 0-4"):
        load_optimizer_shards(tmp_path / "optimizer_0", optimizer)


# ----------------------------------------------------------------------------------------------- a real run
RUN = ["-m", "unirl.cli", "train", "text", "--config", "tiny", "trainer.strategy=fsdp2", "rollout.engine=hf",
       "rollout.max_new_tokens=8", "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batch_size=16",
       "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.progress=false", "trainer.save_every=1",
       "trainer.keep_checkpoints=null"]


@pytest.mark.slow
def test_fsdp2_resume_skips_damaged_checkpoints_in_one_line_each(tmp_path, tiny_lm_dir):
    """A 1-process FSDP2 run of 3 steps with a truncated optimizer shard in step 3's checkpoint and a model
    piece's rows out of place in step 2's: resume skips each in one line naming its file and goes on from
    step 1 (one run for both damages: each skip is its own line, in the order resume tries them)."""
    from test_distributed import REPO, cpu_env

    run = tmp_path / "run"
    first = subprocess.run([sys.executable, *RUN, "trainer.total_steps=3", "--output-dir", str(run)], cwd=REPO,
                           env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    states = {step: run / "checkpoints" / f"step_{step:06d}" / "trainer_state" for step in (2, 3)}
    shard = states[3] / "policy_optimizer.rank0of1.safetensors"  # truncated_optimizer
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    meta = states[2] / "policy.rank0of1.json"  # model_row_gap
    plain = json.loads(meta.read_text())
    plain["model.layers.0.self_attn.q_proj.weight"]["offset"] = 3
    meta.write_text(json.dumps(plain))
    resumed = subprocess.run([sys.executable, *RUN, "trainer.total_steps=4", "trainer.resume=true", "--output-dir",
                              str(run)], cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=600)
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and "Traceback" not in said, said[-3000:]
    skipped = [line for line in said.splitlines() if line.startswith("resume: skipping")]
    assert len(skipped) == 2, skipped
    assert skipped[0].startswith(f"resume: skipping {run / 'checkpoints' / 'step_000003'}: {states[3]}/"), skipped
    assert skipped[1].startswith(f"resume: skipping {run / 'checkpoints' / 'step_000002'}: {states[2]}/"), skipped
    assert f"resumed from {run / 'checkpoints' / 'step_000001'} (step 1)" in said
    assert (run / "checkpoints" / "step_000004").is_dir()
