"""DAPO's soft overlong punishment against verl's DAPO reward manager formula, and TRL's
``mask_truncated_completions``: truncated responses add nothing to the loss or its gradient (the tiny
text model, real sampling cut short)."""

from __future__ import annotations

import pytest
import torch

from unirl.cli import load_run_config
from unirl.core import overlong_penalty
from unirl.trainer.loop import Trainer
from unirl.trainer.update import micro_loss, mini_denominator
from unirl.text.env import TextEnvironment


def _verl_dapo(valid_response_length: int, max_resp_len: int, buffer_len: int, penalty_factor: float) -> float:
    """verl ``DAPORewardManager``: the overlong reward added to the score."""
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / buffer_len * penalty_factor, 0)


def test_overlong_penalty_by_hand_and_against_verl():
    # max 20, buffer 8: no penalty up to 12 tokens, then -1/8 a token, -1 at 20 (factor 1).
    lengths = torch.tensor([0, 12, 13, 16, 20])
    torch.testing.assert_close(overlong_penalty(lengths, max_length=20, buffer=8),
                               torch.tensor([0.0, 0.0, -0.125, -0.5, -1.0]))
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        max_len = int(torch.randint(8, 300, (1,), generator=g))
        buffer = int(torch.randint(1, max_len + 1, (1,), generator=g))
        factor = float(torch.rand(1, generator=g)) * 2
        lengths = torch.randint(0, max_len + 1, (64,), generator=g)
        expected = torch.tensor([_verl_dapo(int(n), max_len, buffer, factor) for n in lengths])
        torch.testing.assert_close(overlong_penalty(lengths, max_length=max_len, buffer=buffer, factor=factor),
                                   expected.float())
    with pytest.raises(ValueError, match="buffer must be in"):
        overlong_penalty(lengths, max_length=10, buffer=11)


def _trainer(tmp_path, *overrides) -> Trainer:
    cfg = load_run_config("text", "tiny", [
        "rollout.engine=hf", "rollout.max_new_tokens=6", "trainer.prompts_per_step=4", "trainer.group_size=4",
        "trainer.mini_batch_size=16", "trainer.micro_batch_size=16", "trainer.eval_every=0",
        "trainer.progress=false", *overrides], output_dir=str(tmp_path / "run"))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    trainer.setup()
    return trainer


def _loss_and_grads(trainer: Trainer, batch):
    model = trainer.env.model
    loss, _, _ = micro_loss(trainer.ctx, model, trainer.env.actions.trim_padding(batch), mini_denominator(trainer.ctx, batch))
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_truncated_completions_add_nothing_to_the_loss_or_gradient(tmp_path, tiny_lm_dir):
    trainer = _trainer(tmp_path, "overlong.mask_truncated=true", "overlong.buffer=3")
    try:
        env = trainer.env
        torch.manual_seed(0)
        rollout = env.sampler.rollout(env.prompts.next(0), 4)
        rewards, metrics = env.scorer.score(rollout)
        finished = rollout.tensors["finished"]
        assert 0 < int(finished.sum()) < len(finished), "need finished and truncated samples"
        # The overlong penalty is on the combined reward only: max 6, buffer 3.
        lengths = rollout.tensors["response_mask"].sum(-1)
        torch.testing.assert_close(rewards - rollout.tensors["score/gsm8k"].float(),  # scores stay float64
                                   (-(lengths - 3) / 3).clamp(max=0))
        assert metrics["reward/overlong_penalty"] < 0
        trainer.advantages(rollout, rewards)
        trainer.old_and_reference(rollout)
        assert (env.actions.loss_mask(rollout)[~finished] == 0).all()
        full_loss, full_grads = _loss_and_grads(trainer, rollout)
        kept_loss, kept_grads = _loss_and_grads(trainer, rollout.select(finished.nonzero().squeeze(-1)))
        torch.testing.assert_close(full_loss, kept_loss)
        assert len(full_grads) == len(kept_grads) > 0 and max(g.abs().max() for g in kept_grads) > 0
        for a, b in zip(full_grads, kept_grads):
            torch.testing.assert_close(a, b)
        # Without the mask the truncated samples do count: the check above could fail.
        env.cfg.overlong.mask_truncated = False
        unmasked_loss, _ = _loss_and_grads(trainer, rollout)
        assert not torch.allclose(unmasked_loss, kept_loss)
    finally:
        trainer.env.close()


def test_multi_turn_overlong_penalty_is_verls_whole_response_against_its_maximum_and_bounded():
    """Three turns of 16 generated tokens and two 10-token observations, max_new_tokens 16, buffer 4:
    all turns' 48 generated tokens against one turn's 16 gave -(48 - 12) / 4 = -9 for a factor of 1.
    As verl: the whole response (68 tokens with the observations) against the most it may hold
    (max_total_tokens less its prompt), and never below -factor. Without max_total_tokens: the generated
    tokens against max_turns * max_new_tokens (``test_without_max_total_tokens_observations_count_nowhere``)."""
    from types import SimpleNamespace

    from unirl.text.multiturn_rollout import overlong_lengths

    g = torch.Generator().manual_seed(0)
    N, P, R = 16, 12, 90
    prompt_len = torch.randint(3, P + 1, (N,), generator=g)
    response_len = torch.randint(0, R + 1, (N,), generator=g)
    prompt_mask = (torch.arange(P).flip(0)[None, :] < prompt_len[:, None]).long()  # left-padded [N, P]
    attention = (torch.arange(R)[None, :] < response_len[:, None]).float()  # [N, R]
    generated = attention.clone()
    generated[:, 16:26] = 0  # an observation: conditioned on, not generated
    tensors = {"prompt_mask": prompt_mask, "response_attention_mask": attention, "response_mask": generated}
    for max_total, buffer, factor in ((100, 8, 1.0), (60, 20, 0.5), (None, 4, 1.0)):
        cfg = SimpleNamespace(max_total_tokens=max_total, max_turns=3, max_new_tokens=16)
        lengths, max_length = overlong_lengths(cfg, tensors)
        got = overlong_penalty(lengths, max_length=max_length, buffer=buffer, factor=factor)
        # the reference, sample by sample: verl's formula on (response length, the response's maximum); without
        # max_total_tokens on (generated tokens, the generated budget)
        limit = [max_total - int(p) if max_total is not None else 3 * 16 for p in prompt_len]
        counted = response_len if max_total is not None else generated.sum(-1).long()
        ref = [max(-factor, _verl_dapo(int(n), m, buffer, factor)) for n, m in zip(counted, limit)]
        torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float32))
        assert got.min() >= -factor
        # where the response is within its maximum (all verl can see), exactly verl's unbounded formula
        within = [i for i in range(N) if int(counted[i]) <= limit[i]]
        assert torch.equal(got[within], torch.tensor([_verl_dapo(int(counted[i]), limit[i], buffer, factor)
                                                      for i in within], dtype=torch.float32))
    # the case of the issue: 48 generated tokens, one turn's max_new_tokens, buffer 4: bounded at -1
    assert overlong_penalty(torch.tensor([48]), max_length=torch.tensor([16]), buffer=4).item() == -1.0


def test_without_max_total_tokens_observations_count_nowhere():
    """Two turns of 16 generated tokens around a 10-token observation, max_turns 3, max_new_tokens 16, no
    max_total_tokens, buffer 8: the 32 generated tokens are under the budget's last 8 (48 - 8 = 40), no
    penalty. Counting the observation in the length but not in the maximum gave 42 against 48: -0.25."""
    from types import SimpleNamespace

    from unirl.text.multiturn_rollout import overlong_lengths

    attention = torch.zeros(1, 50)
    attention[0, :42] = 1
    generated = attention.clone()
    generated[0, 16:26] = 0  # the observation
    tensors = {"prompt_mask": torch.ones(1, 5, dtype=torch.long), "response_attention_mask": attention,
               "response_mask": generated}
    cfg = SimpleNamespace(max_total_tokens=None, max_turns=3, max_new_tokens=16)
    lengths, max_length = overlong_lengths(cfg, tensors)
    assert lengths.tolist() == [32.0] and max_length == 48
    assert overlong_penalty(lengths, max_length=max_length, buffer=8).item() == 0.0
    # With max_total_tokens both count the observation (verl): 42 of 70 - 5 = 65, no penalty either.
    lengths, max_length = overlong_lengths(SimpleNamespace(max_total_tokens=70, max_turns=3, max_new_tokens=16), tensors)
    assert lengths.tolist() == [42.0] and max_length.tolist() == [65]
