"""``HFEngine.generate`` gathers the sampled tokens' log-probs step by step (``SampledTokenLogprobs``)
instead of stacking ``[N, R, V]`` logits: the values must equal the full-vocabulary computation,
``log_softmax(stack(output_logits) / T)`` gathered at the sampled ids, written out here, on the same
seeded samples (the processor draws no random numbers, so both runs sample the same tokens)."""

from __future__ import annotations

import json

import pytest
import torch

from unirl.rollout.hf import HFEngine

from unirl.rollout.engine import eos_token_ids


def _full_vocabulary(model, tokenizer, prompts, *, n, max_new_tokens, temperature, top_p, top_k, greedy, seed):
    """[P*n, R] sampled ids and their log-probs from the whole [P*n, R, V] float32 logits."""
    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=attn, do_sample=not greedy,
                         temperature=None if greedy else temperature, top_p=None if greedy else top_p,
                         top_k=None if greedy or top_k < 0 else top_k, max_new_tokens=max_new_tokens,
                         num_return_sequences=1 if greedy else n, pad_token_id=pad,
                         eos_token_id=sorted(eos_token_ids(tokenizer, model.generation_config)),
                         output_logits=True, return_dict_in_generate=True)
    seqs = out.sequences[:, width:]  # [P*n, R]
    logits = torch.stack(out.logits, dim=1).float()  # [P*n, R, V]
    scale = 1.0 if greedy else temperature
    return seqs, torch.log_softmax(logits / scale, dim=-1).gather(-1, seqs.unsqueeze(-1)).squeeze(-1)


def _prompts(tiny_lm_dir, tokenizer) -> list[list[int]]:
    """Four task questions, led by 0..3 spaces so that the left padding differs between rows."""
    rows = [json.loads(line) for line in (tiny_lm_dir / "test.jsonl").read_text().splitlines()[:4]]
    return [tokenizer(" " * i + r["question"]).input_ids for i, r in enumerate(rows)]


@pytest.mark.parametrize("sampling", [dict(temperature=0.7, top_p=0.9, top_k=20, greedy=False),
                                      dict(temperature=1.3, top_p=1.0, top_k=-1, greedy=False),
                                      dict(temperature=1.0, top_p=1.0, top_k=-1, greedy=True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_step_by_step_logprobs_equal_the_full_vocabulary_ones(tiny_lm_dir, sampling, seed):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32)
    prompts = _prompts(tiny_lm_dir, tokenizer)
    assert len({len(p) for p in prompts}) > 1, "prompts of one length: the left padding is not exercised"
    kw = dict(n=3, max_new_tokens=8, **sampling)
    seqs, expected = _full_vocabulary(model, tokenizer, prompts, seed=seed, **kw)
    torch.manual_seed(seed)
    groups = HFEngine(lambda: model, tokenizer).generate(prompts, **kw)
    n = 1 if sampling["greedy"] else 3
    eos = eos_token_ids(tokenizer, model.generation_config)
    for i, group in enumerate(groups):
        assert len(group) == n
        for j, gen in enumerate(group):
            row = seqs[i * n + j].tolist()
            length = next((k + 1 for k, tok in enumerate(row) if tok in eos), len(row))
            assert gen.response_ids == row[:length]
            assert len(gen.logprobs) == length
            torch.testing.assert_close(torch.tensor(gen.logprobs), expected[i * n + j, :length], rtol=0, atol=1e-5)
    assert all(lp <= 0 for g in groups for gen in g for lp in gen.logprobs)


def test_responses_of_different_lengths_are_compared(tiny_lm_dir):
    """The comparison above covers both an EOS-ended and a length-cut response (else its cut is untested)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32)
    torch.manual_seed(0)
    groups = HFEngine(lambda: model, tokenizer).generate(_prompts(tiny_lm_dir, tokenizer), n=3,
                                                          max_new_tokens=8, temperature=1.3)
    ends = {gen.finished for g in groups for gen in g}
    assert ends == {True, False}, ends


def test_the_models_own_sampling_defaults_do_not_change_what_the_rollout_samples(tiny_lm_dir):
    """A model's generation_config.json may switch on processors (Qwen2.5-Instruct ships a repetition
    penalty); the rollout samples from ``softmax(logits / T)`` under rollout.* only, so the recorded
    log-probs equal a teacher-forced forward's, and a minimum length it asks for is not imposed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32).eval()
    for field, value in dict(repetition_penalty=3.0, no_repeat_ngram_size=1, min_new_tokens=8, top_k=2,
                             top_p=0.5, temperature=0.1).items():
        setattr(model.generation_config, field, value)
    prompts = _prompts(tiny_lm_dir, tokenizer)
    torch.manual_seed(0)
    groups = HFEngine(lambda: model, tokenizer).generate(prompts, n=3, max_new_tokens=8, temperature=1.3)
    assert any(gen.finished and len(gen.response_ids) < 8 for g in groups for gen in g), "min_new_tokens was imposed"
    for prompt, group in zip(prompts, groups):
        for gen in group:
            ids = torch.tensor([prompt + gen.response_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            expected = torch.log_softmax(logits / 1.3, dim=-1).gather(-1, torch.tensor(gen.response_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(gen.logprobs), expected, rtol=0, atol=1e-5)


def test_a_model_config_processor_that_cannot_be_switched_off_is_refused(tiny_lm_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32)
    model.generation_config.suppress_tokens = [5]
    with pytest.raises(ValueError, match=r"generation_config.json sets suppress_tokens=\[5\].*rollout.engine=vllm"):
        HFEngine(lambda: model, tokenizer).generate(_prompts(tiny_lm_dir, tokenizer), n=2, max_new_tokens=4,
                                                    temperature=1.0)


@pytest.mark.parametrize("greedy", [False, True])
def test_a_static_cache_samples_what_the_dynamic_one_does(tiny_lm_dir, greedy):
    """``rollout.hf_cache=static`` preallocates the KV cache (for compiled decoding on a GPU): the same seed
    gives the same tokens and log-probs, over two calls of different prompt widths; with ``max_cache_len``
    both calls get a cache of that length (one compiled graph for both on a GPU), without it each call's
    own length."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32).eval()
    prompts = _prompts(tiny_lm_dir, tokenizer)
    calls = [prompts, [p + p[-3:] for p in prompts[:2]]]  # a wider second batch
    outputs, caches = {}, set()

    def seen(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        caches.add((type(cache).__name__, cache.get_max_length() if type(cache).__name__ == "StaticCache" else None))

    hook = model.register_forward_pre_hook(seen, with_kwargs=True)
    longest = max(map(len, calls[1])) + 8 + 5  # room to spare: the cache is this long whatever the call
    for cache, size in (("dynamic", None), ("static", None), ("static", longest)):
        caches.clear()
        if hasattr(model, "_previous_max_cache_length"):  # transformers keeps the longest static cache a model had
            del model._previous_max_cache_length
        engine = HFEngine(lambda: model, tokenizer, cache=cache, max_cache_len=size)
        outputs[cache, size] = [engine.generate(batch, n=3, max_new_tokens=8, temperature=1.3, greedy=greedy, seed=k)
                                for k, batch in enumerate(calls)]
        if cache == "dynamic":
            assert caches == {("DynamicCache", None)}, caches
        elif size is None:  # each call's own prompt + 8 (transformers' max_length - 1)
            assert caches == {("StaticCache", max(map(len, b)) + 8 - 1) for b in calls}, caches
        else:
            assert caches == {("StaticCache", longest)}, caches
    hook.remove()
    for static_calls in (outputs["static", None], outputs["static", longest]):
        for dynamic, static in zip(outputs["dynamic", None], static_calls):
            for group_d, group_s in zip(dynamic, static):
                for d, s in zip(group_d, group_s):
                    assert s.response_ids == d.response_ids and s.finished == d.finished
                    torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(d.logprobs), rtol=0, atol=1e-5)


def test_the_static_cache_is_sized_for_the_runs_longest_call():
    from unirl.api import load_config
    from unirl.rollout.sizing import longest_call

    assert longest_call(load_config("text", "tiny", ["data.max_prompt_length=100", "rollout.max_new_tokens=30"])) == 130
    assert longest_call(load_config("text", "tiny", ["data.max_prompt_length=100", "rollout.max_new_tokens=30",
                                                     "rollout.eval_max_new_tokens=50"])) == 150
    assert longest_call(load_config("text", "tiny", ["rollout.max_model_len=512"])) == 512


def test_the_cache_setting_is_the_transformers_engines_only():
    from unirl.api import load_config

    assert load_config("text", "tiny", ["rollout.engine=hf", "rollout.hf_cache=static"]).rollout.hf_cache == "static"
    with pytest.raises(ValueError, match="rollout.hf_cache=static .* rollout.engine=vllm does not use it"):
        load_config("text", "tiny", ["rollout.engine=vllm", "rollout.hf_cache=static"])
