"""PPO with a critic in the loop, on the tiny text model with the transformers engine
(``configs/text/tiny_ppo.yaml``, smaller batches): the critic warm-up leaves the actor untouched
while the critic trains, and a resumed run (critic, its optimizer, the adaptive KL coefficient)
continues bit for bit as an uninterrupted one.
"""

from __future__ import annotations

import pytest
import torch

from unirl.cli import load_run_config
from unirl.trainer.loop import Trainer
from unirl.text.env import TextEnvironment

SMALL = ["rollout.engine=hf", "rollout.max_new_tokens=8", "trainer.prompts_per_step=8", "trainer.mini_batch_size=4",
         "trainer.micro_batch_size=2", "trainer.eval_every=0", "trainer.progress=false", "algo.kl_ctrl.horizon=50",
         "algo.kl_ctrl.target_kl=0.001"]  # two optimizer steps a pass, accumulation, a beta that moves every step


def _trainer(run_dir, *overrides: str) -> Trainer:
    cfg = load_run_config("text", "tiny_ppo", [*SMALL, *overrides], output_dir=str(run_dir))
    return Trainer.from_config(TextEnvironment(cfg), cfg)


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def test_critic_warmup_trains_only_the_critic_for_n_minus_1_steps_as_verl(tmp_path, tiny_lm_dir):
    """verl's ``RayPPOTrainer.fit`` numbers steps from 1 and updates the actor when ``critic_warmup <=
    global_steps``: critic_warmup=3 holds the actor back for steps 1 and 2, and step 3 trains it."""
    trainer = _trainer(tmp_path / "run", "trainer.critic_warmup=3")
    trainer.setup()
    actor, critic = _weights(trainer.env.model), _weights(trainer.critic.model)
    for step in range(3):
        metrics = trainer.train_step()
        if step < 2:  # warm-up: the actor bit-identical, no actor figures; the critic moved
            assert torch.equal(_weights(trainer.env.model), actor), step
            assert "actor/grad_norm" not in metrics and "time/update" not in metrics
            assert metrics["critic/grad_norm"] > 0 and metrics["critic/vf_loss"] > 0
            moved = _weights(trainer.critic.model)
            assert (moved - critic).abs().max() > 0, step
            critic = moved
        else:  # then both train
            assert (_weights(trainer.env.model) - actor).abs().max() > 0
            assert metrics["actor/grad_norm"] > 0
    assert trainer.optimizer_steps == 2  # only the third step's two mini-batches stepped the actor
    trainer.env.close()


def test_resume_with_critic_and_adaptive_kl_is_exact(tmp_path, tiny_lm_dir):
    whole = _trainer(tmp_path / "whole", "trainer.total_steps=4", "trainer.save_every=2")
    straight = whole.train()
    first = _trainer(tmp_path / "split", "trainer.total_steps=2")
    first.train()
    second = _trainer(tmp_path / "split", "trainer.total_steps=4", "trainer.resume=true")
    resumed = second.train()
    assert [m["step"] for m in resumed] == [3, 4]
    for a, b in zip(straight[2:], resumed):
        a, b = ({k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))} for m in (a, b))
        assert a == b  # every logged figure, exactly: rewards, KL penalty and beta, critic and actor losses
    assert straight[-1]["actor/reward_kl_penalty_coeff"] != straight[0]["actor/reward_kl_penalty_coeff"]
    assert whole.kl_ctrl.value == second.kl_ctrl.value
    assert torch.equal(_weights(whole.env.model), _weights(second.env.model))
    assert torch.equal(_weights(whole.critic.model), _weights(second.critic.model))


def test_a_critic_for_an_environment_without_one_is_a_clear_error(tmp_path, tiny_lm_dir):
    cfg = load_run_config("text", "tiny_ppo", SMALL, output_dir=str(tmp_path / "run"))
    trainer = Trainer(TextEnvironment(cfg), algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer,
                      run_dir=cfg.output_dir, critic=None)
    with pytest.raises(ValueError, match="adv_estimator=gae trains a critic.*no critic config"):
        trainer.setup()
    trainer.env.close()


def test_gsm8k_ppo_dry_run_from_an_empty_directory(tmp_path, monkeypatch, capsys):
    import yaml

    from unirl.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert main(["train", "text", "--config", "gsm8k_ppo", "--dry-run"]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)
    assert resolved["algo"]["adv_estimator"] == "gae" and resolved["trainer"]["group_size"] == 1
    assert resolved["critic"]["optim"]["lr"] == 1e-5 and resolved["optim"]["lr"] == 1e-6
    assert "# PROBLEM" not in out
    assert not list(tmp_path.glob("runs"))  # a dry run creates nothing


@pytest.mark.parametrize("lora", [False, True])
def test_values_sit_where_the_logprobs_are_packed_or_padded(tmp_path, tiny_lm_dir, lora):
    """The critic's values are the head's output at the hidden states that predict each response token
    (the log-probs' positions), the same whether responses share their prompt (packed) or not; with
    LoRA the new head trains beside the adapter."""
    from tests.conftest import text_env

    env = text_env(tmp_path, "trainer.prompts_per_step=3", "trainer.group_size=2", "trainer.mini_batch_size=6",
                   "trainer.micro_batch_size=6", "rollout.max_new_tokens=6",
                   f"critic.lora.enabled={str(lora).lower()}")
    model = env.models.value_model(env.cfg.critic)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any("score" in name for name in trainable)
    if lora:
        assert all("lora_" in name or "score" in name for name in trainable)
    rollout = env.sampler.rollout(env.prompts.next(0), 2)
    with torch.no_grad():
        packed = env.actions.values(model, rollout)  # [N, R]
        env.cfg.model.share_prompt = False
        padded = env.actions.values(model, rollout)
        # By hand for sample 0: its own row [prompt | response], the head at positions P-1 .. P+R-2.
        t = rollout.tensors
        P = int(t["prompt_mask"][0].sum())
        R = int(t["response_mask"][0].sum())
        ids = torch.cat([t["prompt_ids"][0, -P:], t["response_ids"][0, :R]])[None]
        by_hand = model(input_ids=ids).logits[0, P - 1:P + R - 1, 0]
    mask = t["response_mask"].bool()
    torch.testing.assert_close(packed[mask], padded[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(padded[0, :R], by_hand, rtol=0, atol=1e-5)
    env.close()


def _critic_dir(tiny_lm_dir, directory, vocab_size=None, swap=None):
    """The tiny model's directory as another critic: ``vocab_size`` embedding rows, or a tokenizer
    with the ids of the tokens ``swap`` exchanged (the same size, another order)."""
    import json
    import shutil

    shutil.copytree(tiny_lm_dir, directory)
    if vocab_size is not None:
        from transformers import AutoConfig, Qwen2ForCausalLM

        config = AutoConfig.from_pretrained(directory)
        config.vocab_size = vocab_size
        Qwen2ForCausalLM(config).save_pretrained(directory)
    if swap is not None:
        file = directory / "tokenizer.json"
        plain = json.loads(file.read_text())
        vocab = plain["model"]["vocab"]
        a, b = swap
        vocab[a], vocab[b] = vocab[b], vocab[a]
        file.write_text(json.dumps(plain))
    return directory


def test_a_critic_of_another_vocabulary_is_refused_at_load_in_one_line(tmp_path, tiny_lm_dir):
    from tests.conftest import text_env
    from unirl.text.config import CriticConfig

    env = text_env(tmp_path / "env")
    try:
        needed = len(env.tokenizer)
        small = _critic_dir(tiny_lm_dir, tmp_path / "small", vocab_size=needed - 5)
        with pytest.raises(ValueError) as info:
            env.models.value_model(CriticConfig(name_or_path=str(small)))
        message = str(info.value)
        assert message.startswith(f"critic.name_or_path={small}: the critic embeds {needed - 5} tokens, the policy's "
                                  f"tokenizer has {needed}") and "\n" not in message
        other = _critic_dir(tiny_lm_dir, tmp_path / "other", swap=("1", "2"))
        with pytest.raises(ValueError, match=r"another tokenizer than the policy's \(token '1' is \d+ in the policy's, "
                                             r"the critic's has it as \d+\)"):
            env.models.value_model(CriticConfig(name_or_path=str(other)))
        assert env.models.value_model(CriticConfig(name_or_path=str(tiny_lm_dir))) is not None  # the same vocabulary loads
    finally:
        env.close()
