"""Packed rows (``model.share_prompt``): one copy of each prompt, no padding, the same log-probs.

The reference is the padded layout every other trainer uses: one row per sample, the prompt
left-padded and the response right-padded, positions counting real tokens, transformers' own sdpa
attention. The packed row with block attention must give the same log-probs and entropies wherever
the response mask is 1, and the same gradients for every parameter, through a real Qwen2 (grouped-query
heads), on the chunked and the full-logits paths.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import text_env
from unirl.core import entropy_from_logits
from unirl.text.logprobs import response_logprobs
from unirl.text.packing import check_packable, pack_shared_prompts, use_packed_attention

TOL = dict(rtol=1e-5, atol=1e-5)


def _left_padded(prompts: list[list[int]], P: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = torch.zeros(len(prompts), P, dtype=torch.long), torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
    return ids, mask


def _right_padded(responses: list[list[int]], R: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = torch.zeros(len(responses), R, dtype=torch.long), torch.zeros(len(responses), R)
    for i, r in enumerate(responses):
        if r:
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1.0
    return ids, mask


def test_packed_row_by_hand():
    # Samples 0 and 2 share the prompt (5, 6); samples 1 and 3 share (9,); sample 3's response is empty.
    prompt_ids, prompt_mask = _left_padded([[5, 6], [9], [5, 6], [9]], P=3)
    response_ids, response_mask = _right_padded([[7, 8], [10, 11, 12], [13], []], R=3)
    packed = pack_shared_prompts(prompt_ids, prompt_mask, response_ids, response_mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 13, 9, 10, 11, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3]]
    # Token 0 is predicted by the prompt's last token, token j by the sample's token j-1; padded
    # positions point at token 0.
    assert packed.source.tolist() == [[1, 2, 0], [5, 6, 7], [1, 0, 0], [0, 0, 0]]
    b = packed.blocks
    # Blocks: prompt (5, 6); sample 0; sample 2; prompt (9,); sample 1. Padded to 3 queries, 4 keys.
    assert b.queries.tolist() == [[0, 1, 0], [2, 3, 0], [4, 0, 0], [5, 0, 0], [6, 7, 8]]
    assert b.keys.tolist() == [[0, 1, 0, 0], [0, 1, 2, 3], [0, 1, 4, 0], [5, 0, 0, 0], [5, 6, 7, 8]]
    mask = b.mask[:, 0].int().tolist()
    assert mask[0] == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]]  # causal prompt; a padded query sees one key
    assert mask[1] == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]  # the prompt, then its own tokens causally
    assert mask[2] == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0]]  # sample 2 never sees sample 0
    assert mask[4] == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    # Where each token's output lands in the flattened [5 blocks x 3 queries].
    assert b.inverse.tolist() == [0, 1, 3, 4, 6, 9, 12, 13, 14]


def test_a_response_mask_with_a_hole_or_an_empty_prompt_is_refused_naming_the_sample():
    prompt_ids, prompt_mask = _left_padded([[3], [3]], P=1)
    response_ids = torch.tensor([[4, 5, 6], [4, 5, 6]])
    response_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    with pytest.raises(ValueError, match="sample 1: the response.s tokens must be right-padded"):
        pack_shared_prompts(prompt_ids, prompt_mask, response_ids, response_mask)
    prompt_ids, prompt_mask = _left_padded([[3], []], P=1)
    with pytest.raises(ValueError, match="sample 1 has an empty prompt"):
        pack_shared_prompts(prompt_ids, prompt_mask, response_ids, torch.ones(2, 3))


def _qwen2(attn: str, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, attn_implementation=attn)
    return Qwen2ForCausalLM(config).train()


def _grouped_batch(seed: int, prompts: int = 3, group: int = 4, P: int = 7, R: int = 9):
    """``prompts`` prompts of different lengths, ``group`` responses each (one of them empty), shuffled
    so that a prompt's samples are not next to each other."""
    g = torch.Generator().manual_seed(seed)
    prompt_tokens = [torch.randint(3, 48, (int(torch.randint(1, P + 1, (1,), generator=g)),), generator=g).tolist()
                     for _ in range(prompts)]
    samples = []
    for p in prompt_tokens:
        for _ in range(group):
            length = int(torch.randint(1, R + 1, (1,), generator=g))
            samples.append((p, torch.randint(3, 48, (length,), generator=g).tolist()))
    samples[1] = (samples[1][0], [])
    order = torch.randperm(len(samples), generator=g).tolist()
    samples = [samples[i] for i in order]
    prompt_ids, prompt_mask = _left_padded([s[0] for s in samples], P)
    response_ids, response_mask = _right_padded([s[1] for s in samples], R)
    return prompt_ids, prompt_mask, response_ids, response_mask


def _padded_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature):
    """The padded layout, written out: one row per sample, the full logits."""
    P = prompt_ids.shape[1]
    ids = torch.cat([prompt_ids, response_ids], 1)
    attn = torch.cat([prompt_mask, response_mask.long()], 1)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False).logits
    logits = logits[:, P - 1:-1].float() / temperature
    logp = logits.gather(-1, response_ids[..., None]).squeeze(-1) - logits.logsumexp(-1)
    return logp, entropy_from_logits(logits)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("chunk_size", [5, None])
def test_packed_row_gives_the_padded_logprobs_and_gradients(chunk_size):
    for seed in range(3):
        model = _qwen2("sdpa", seed)
        prompt_ids, prompt_mask, response_ids, response_mask = _grouped_batch(seed)
        want_logp, want_entropy = _padded_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, 0.7)
        use_packed_attention(model)
        assert model.config._attn_implementation == "unirl_packed"
        packed = pack_shared_prompts(prompt_ids, prompt_mask, response_ids, response_mask)
        # Each prompt once, no padding: the real tokens only.
        distinct = {tuple(p[m.bool()].tolist()) for p, m in zip(prompt_ids, prompt_mask)}
        assert len(distinct) == 3
        assert packed.input_ids.shape[1] == sum(len(p) for p in distinct) + int(response_mask.sum())
        placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool)
        logp, entropy = response_logprobs(model, model.lm_head, packed.input_ids, placeholder, packed.position_ids,
                                          response_ids, temperature=0.7, chunk_size=chunk_size, with_entropy=True,
                                          source=packed.source, model_kwargs={"unirl_blocks": packed.blocks})
        mask = response_mask.bool()
        torch.testing.assert_close(logp[mask], want_logp[mask], **TOL)
        torch.testing.assert_close(entropy[mask], want_entropy[mask], **TOL)

        w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed + 10))
        ((w * logp - 0.1 * entropy) * response_mask).sum().backward()
        got = _grads(model)
        # The reference gradients: the padded rows through the same (switched) model, whose attention
        # is transformers' sdpa when no blocks are given.
        want_logp, want_entropy = _padded_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, 0.7)
        ((w * want_logp - 0.1 * want_entropy) * response_mask).sum().backward()
        want = _grads(model)
        assert got.keys() == want.keys() and "model.embed_tokens.weight" in got
        for name in want:
            torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


def test_the_switched_model_generates_as_before():
    """Without blocks the packed attention is sdpa: left-padded generation is unchanged."""
    model = _qwen2("sdpa", 0).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    attn = (ids != 0).long()
    kwargs = dict(input_ids=ids, attention_mask=attn, max_new_tokens=6, do_sample=False, pad_token_id=0)
    before = model.generate(**kwargs)
    use_packed_attention(model)
    assert torch.equal(model.generate(**kwargs), before)


def _text_env(tmp_path, *overrides):
    return text_env(tmp_path, "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batch_size=16",
                    "trainer.micro_batch_size=16", "rollout.max_new_tokens=10", "algo.entropy_coef=0.01", *overrides)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.parametrize("lora_head", [False, True])
def test_text_env_packs_its_own_rollout_as_the_padded_rows(tmp_path, tiny_lm_dir, lora_head):
    """The environment's evaluate on a real rollout: packed (the default) against padded rows."""
    extra = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj,lm_head]",
             "model.logprob_chunk_size=null"] if lora_head else []
    env = _text_env(tmp_path, *extra)
    try:
        assert env.cfg.model.share_prompt  # the shipped default
        model = env.model.train()
        if lora_head:  # LoRA's B starts at zero; give the adapters something to carry
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.1)
        rollout = env.sampler.rollout(env.prompts.next(0), 4)
        lengths = rollout.tensors["response_mask"].sum(-1)
        assert lengths.min() < lengths.max()
        # The layouts compared in float64: in float32 the two summation orders differ by rounding that
        # grows with the gradients' size (3e-5 at gradients near 100), which says nothing about the layouts.
        model.double()
        mask = rollout.tensors["response_mask"]
        w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
        results = []
        for share in (True, False):
            env.cfg.model.share_prompt = share
            out = env.actions.score_actions(model, rollout)
            ((w * out["logp"] - out["entropy"]) * mask).sum().backward()
            results.append((out, _grads(model)))
        (packed, g_packed), (padded, g_padded) = results
        keep = mask.bool()
        for key in ("logp", "entropy"):
            torch.testing.assert_close(packed[key][keep], padded[key][keep], **TOL)
        assert g_packed.keys() == g_padded.keys() and len(g_packed) > 0
        if lora_head:
            assert any("lm_head" in name and "lora_A" in name for name in g_packed)
        for name in g_padded:
            torch.testing.assert_close(g_packed[name], g_padded[name], **TOL, msg=name)
    finally:
        env.close()


def test_one_update_is_the_same_packed_or_padded(tmp_path, tiny_lm_dir):
    """Through the loop: the same rollout, advantages and weights give the same update either way."""
    from unirl.trainer.loop import Trainer
    from unirl.text.env import TextEnvironment
    from unirl.cli import load_run_config

    trainers = []
    for share in ("true", "false"):
        cfg = load_run_config("text", "tiny", [
            "rollout.engine=hf", "rollout.max_new_tokens=12", "trainer.prompts_per_step=4", "trainer.group_size=4",
            "trainer.mini_batch_size=16", "trainer.micro_batch_size=8", "trainer.eval_every=0",
            "trainer.progress=false", "optim.lr=1e-3", "algo.kl_coef=0.05", f"model.share_prompt={share}",
        ], output_dir=str(tmp_path / share))
        trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
        trainer.setup()
        trainers.append(trainer)
    packed, padded = trainers
    try:
        rollout = packed.env.sampler.rollout(packed.env.prompts.next(0), 4)
        rewards = torch.linspace(0, 1, len(rollout))
        packed.advantages(rollout, rewards)
        other = copy.deepcopy(rollout)
        padded.advantages(other, rewards)
        metrics, grads = [], []
        for trainer, batch in ((packed, rollout), (padded, other)):
            trainer.old_and_reference(batch)
            step = trainer.backend.clip_and_step  # the optimizer step every update takes

            def recording_step(*args, trainer=trainer, step=step, **kwargs):  # the summed gradient at the optimizer step
                grads.append([p.grad.detach().clone() for p in trainer.env.model.parameters() if p.requires_grad])
                return step(*args, **kwargs)

            trainer.backend.clip_and_step = recording_step
            metrics.append(trainer.update(batch))
        for key in ("loss/policy", "loss/kl", "loss/total", "actor/grad_norm"):
            assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-4, abs=1e-6), key
        assert len(grads) == 2 and max(g.abs().max().item() for g in grads[1]) > 1e-4
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    finally:
        for trainer in trainers:
            trainer.env.close()


def test_models_the_packed_blocks_would_not_reproduce_are_refused():
    from transformers import Qwen2Config

    check_packable(Qwen2Config(attn_implementation="sdpa"))  # Qwen2 without its (off by default) window
    for impl in ("eager", "flash_attention_2"):
        with pytest.raises(ValueError, match=f"'{impl}' attention.*model.share_prompt=false"):
            check_packable(SimpleNamespace(_attn_implementation=impl))
    windowed = Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0, num_hidden_layers=2,
                           attn_implementation="sdpa")
    with pytest.raises(ValueError, match="sliding-window attention .*model.share_prompt=false"):
        check_packable(windowed)
    with pytest.raises(ValueError, match="sliding_window=4096"):  # Mistral-style: a window and no layer types
        check_packable(SimpleNamespace(_attn_implementation="sdpa", sliding_window=4096))


def test_a_checkpoint_of_a_packed_run_loads_with_plain_sdpa(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _qwen2("sdpa", 0)
    use_packed_attention(model)
    model.save_pretrained(tmp_path)
    assert "unirl_packed" not in (tmp_path / "config.json").read_text()
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"


def test_packed_blocks_reach_the_attention_under_gradient_checkpointing():
    """Checkpointed layers recompute the forward in backward: the blocks must travel with it."""
    model = _qwen2("sdpa", 1)
    model.gradient_checkpointing_enable()
    prompt_ids, prompt_mask, response_ids, response_mask = _grouped_batch(1)
    want_logp, _ = _padded_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, 1.0)
    (want_logp * response_mask).sum().backward()
    want = _grads(model)
    use_packed_attention(model)
    packed = pack_shared_prompts(prompt_ids, prompt_mask, response_ids, response_mask)
    logp, _ = response_logprobs(model, model.lm_head, packed.input_ids, torch.ones((1, 1, 1, 1), dtype=torch.bool),
                                packed.position_ids, response_ids, temperature=1.0, chunk_size=4,
                                source=packed.source, model_kwargs={"unirl_blocks": packed.blocks})
    mask = response_mask.bool()
    torch.testing.assert_close(logp[mask], want_logp[mask], **TOL)
    (logp * response_mask).sum().backward()
    got = _grads(model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)
