"""The learned text reward model (``reward_model``) on tiny Qwen2 sequence classifiers built here.

- A seeded random RM (a Qwen2, and a GPT-2 whose absolute positions make left padding matter): its score equals transformers' own head output at the last token of the
  sample scored alone (no padding), for left- and right-padding tokenizers, with and without a chat
  template; a batch of 1 equals a batch of N; served over HTTP equals in-process; the model loads
  once per process; truncation; the clear errors (two labels, no pad token, no chat template).
- A constructed RM whose score is a closed form of how often the character "5" appears in the
  rendered sample (checked by hand), which then drives a short GRPO run on the tiny text model
  through the CLI: the reward rises.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml

from unirl.rewards.loading import load_reward
from unirl.rewards.registry import RewardError
from unirl.rewards.remote import make_server
from unirl.rewards.scoring import score_batch

REPO = Path(__file__).resolve().parents[1]

# A chat template written with characters of the tiny tokenizer's alphabet; it ends every
# conversation with the EOS token, the token the score is read at.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n"
            "{% else %}A: {{ m['content'] }}{% endif %}{% endfor %}<|endoftext|>")

PROMPTS = ["1+2=?", "3+4=?", "0+0=?", "2+2=?", "4+1=?", "What is two plus two?"]
RESPONSES = ["#### 3", "#### 77", "", "four", "#### 5 because 4 plus 1 is 5", "#### 4"]  # lengths differ: padding


def _rendered(prompt: str, response: str, chat: bool) -> str:
    """The text the RM must score, written out by hand from TEMPLATE (not through jinja)."""
    return f"Q: {prompt}\nA: {response}<|endoftext|>" if chat else prompt + response


def _save_tokenizer(path: Path, *, padding_side: str = "right", chat: bool = True, pad: bool = True) -> str:
    from unirl.text.tiny import build_tokenizer

    from transformers import AutoTokenizer

    tokenizer = build_tokenizer()
    if chat:
        tokenizer.chat_template = TEMPLATE
    if not pad:
        tokenizer.pad_token = None
    tokenizer.save_pretrained(path)
    # The padding side is saved from the loading arguments, not from the attribute: load it so.
    AutoTokenizer.from_pretrained(path, padding_side=padding_side).save_pretrained(path)
    return str(path)


def _tiny_classifier(num_labels: int = 1, seed: int = 0, **config):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from unirl.text.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    settings = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=96,
                    num_labels=num_labels, pad_token_id=tokenizer.pad_token_id,
                    initializer_range=0.2)  # larger than the default 0.02, so that scores differ visibly
    settings.update(config)
    torch.manual_seed(seed)
    return Qwen2ForSequenceClassification(Qwen2Config(**settings)).eval()


def _gpt2_classifier(seed: int):
    """A GPT-2 RM: learned absolute position embeddings, so a left-padded sample scores right only
    with position ids counted from its first real token."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from unirl.text.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=96, num_labels=1,
                        pad_token_id=tokenizer.pad_token_id, initializer_range=0.2)
    return GPT2ForSequenceClassification(config).eval()


def _saved_rm(root: Path, arch: str, seed: int):
    """A seeded random RM saved under ``root`` with tokenizers beside it: right/left padding with
    the chat template, and right padding without one."""
    model = _tiny_classifier(seed=seed) if arch == "qwen2" else _gpt2_classifier(seed)
    model.save_pretrained(root / "model")
    _save_tokenizer(root / "model")  # the model's own tokenizer: right padding, chat template
    paths = {"model": str(root / "model"),
             "left": _save_tokenizer(root / "left", padding_side="left"),
             "plain": _save_tokenizer(root / "plain", chat=False)}
    return model, paths


@pytest.fixture(scope="module", params=[("qwen2", 0), ("gpt2", 1)], ids=["qwen2", "gpt2"])
def random_rm(request, tmp_path_factory):
    """A Qwen2 RM (RoPE) and a GPT-2 RM (absolute positions), different seeds."""
    arch, seed = request.param
    return _saved_rm(tmp_path_factory.mktemp(f"rm_{arch}"), arch, seed)


def _reference(model, tokenizer_path: str, chat: bool, prompts=PROMPTS, responses=RESPONSES) -> list[float]:
    """transformers' own forward of each sample alone (no padding): the head at its last token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    out = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses):
            ids = tokenizer(_rendered(prompt, response, chat), add_special_tokens=not chat, return_tensors="pt").input_ids
            out.append(model(input_ids=ids).logits[0, 0].item())  # [1, num_labels=1]
    return out


@pytest.mark.parametrize("tokenizer", ["model", "left", "plain"], ids=["right-padded", "left-padded", "no-template"])
def test_score_is_the_head_at_the_last_real_token(random_rm, tokenizer):
    model, paths = random_rm
    chat = tokenizer != "plain"
    reward = load_reward("reward_model", model=paths["model"], tokenizer=paths[tokenizer], batch_size=len(PROMPTS),
                         device="cpu")
    scores = score_batch(reward, RESPONSES, name="reward_model", prompts=PROMPTS)
    assert reward.use_chat_template is chat
    assert reward.tokenizer.padding_side == ("left" if tokenizer == "left" else "right")
    expected = _reference(model, paths[tokenizer], chat)
    assert len(set(round(e, 4) for e in expected)) == len(expected)  # the samples score differently
    assert scores == pytest.approx(expected, abs=1e-5)


def test_left_padding_needs_positions_from_the_mask(tmp_path):
    """Why the reward passes position ids of its own: on the GPT-2 RM, transformers' pooled forward
    of the same left-padded batch (positions counted from the padding) scores a padded sample
    differently from the sample alone. (RoPE depends only on relative positions: Qwen2 does not care.)"""
    from transformers import AutoTokenizer

    model, paths = _saved_rm(tmp_path, "gpt2", seed=2)
    tokenizer = AutoTokenizer.from_pretrained(paths["left"])
    texts = [_rendered(p, r, chat=True) for p, r in zip(PROMPTS, RESPONSES)]
    batch = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        pooled = model(**batch).logits[:, 0].tolist()  # [n]
    alone = _reference(model, paths["left"], chat=True)
    shortest = min(range(len(texts)), key=lambda i: len(texts[i]))
    assert abs(pooled[shortest] - alone[shortest]) > 1e-3
    reward = load_reward("reward_model", model=paths["model"], tokenizer=paths["left"], batch_size=len(PROMPTS), device="cpu")
    assert reward(RESPONSES, prompts=PROMPTS) == pytest.approx(alone, abs=1e-5)


@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_batch_of_one_equals_batch_of_n(random_rm, batch_size):
    _, paths = random_rm
    whole = load_reward("reward_model", model=paths["model"], batch_size=len(PROMPTS), device="cpu")
    sliced = load_reward("reward_model", model=paths["model"], batch_size=batch_size, device="cpu")
    assert sliced(RESPONSES, prompts=PROMPTS) == pytest.approx(whole(RESPONSES, prompts=PROMPTS), abs=1e-5)


def _count_loads(monkeypatch) -> list[str]:
    """Every ``AutoModelForSequenceClassification.from_pretrained`` call from now on."""
    from transformers import AutoModelForSequenceClassification

    calls: list[str] = []
    original = AutoModelForSequenceClassification.from_pretrained.__func__

    def counting(cls, path, *args, **kwargs):
        calls.append(str(path))
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", classmethod(counting))
    return calls


def test_served_equals_in_process_and_loads_once(random_rm, monkeypatch):
    _, paths = random_rm
    loads = _count_loads(monkeypatch)
    kwargs = {"model": paths["model"], "batch_size": 4, "device": "cpu"}

    local = load_reward("reward_model", **kwargs)
    in_process = [score_batch(local, RESPONSES, name="reward_model", prompts=PROMPTS) for _ in range(3)]
    assert in_process[0] == in_process[1] == in_process[2]
    assert loads == [paths["model"]]  # once for three batches

    server = make_server("reward_model", "127.0.0.1", 0, kwargs)  # loads before the port opens
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        remote = load_reward(url, timeout=30)
        served = [score_batch(remote, RESPONSES, name=url, prompts=PROMPTS) for _ in range(3)]
        half = score_batch(remote, RESPONSES[:3], name=url, prompts=PROMPTS[:3])
    finally:
        server.shutdown()
        server.server_close()
    assert served[0] == served[1] == served[2] == in_process[0]  # the same slices, the same numbers
    assert half == pytest.approx(in_process[0][:3], abs=1e-5)
    assert loads == [paths["model"]] * 2  # once in-process, once in the server, for four requests


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncation_keeps_the_configured_end(random_rm, truncation):
    model, paths = random_rm
    prompt, response = "What is two plus two?", "#### 4 because two and two make four"
    text = _rendered(prompt, response, chat=True)
    limit = len(text) - 15  # characters are tokens here; the EOS is one token
    reward = load_reward("reward_model", model=paths["model"], max_length=limit, truncation=truncation, device="cpu")
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(paths["model"])(text, add_special_tokens=False).input_ids
    kept = ids[-limit:] if truncation == "left" else ids[:limit]
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([kept])).logits[0, 0].item()
    assert reward([response], prompts=[prompt]) == pytest.approx([expected], abs=1e-5)


def test_too_long_sample_is_an_error_by_default(random_rm):
    _, paths = random_rm
    reward = load_reward("reward_model", model=paths["model"], max_length=12, device="cpu")
    with pytest.raises(RewardError, match=r"a sample is 2\d tokens for .*model, more than max_length=12; raise max_length, "
                                          r"or set truncation to left or right.* \(prompt '1\+2=\?'\)"):
        score_batch(reward, ["#### 3 it is"], name="reward_model", prompts=["1+2=?"])


def test_more_than_one_label_is_a_clear_error(tmp_path):
    path = tmp_path / "two_labels"
    _tiny_classifier(num_labels=2).save_pretrained(path)
    _save_tokenizer(path)
    reward = load_reward("reward_model", model=str(path), device="cpu")  # cheap: nothing loads yet
    with pytest.raises(RewardError, match=rf"could not load its model: ValueError: reward_model: {re.escape(str(path))} has a classification "
                                          r"head with 2 labels .*expected num_labels=1 in its config.json"):
        score_batch(reward, ["#### 3"], name="reward_model", prompts=["1+2=?"])
    with pytest.raises(RewardError, match=rf"{re.escape(str(path))} has a classification head with 2 labels"):
        make_server("reward_model", "127.0.0.1", 0, {"model": str(path), "device": "cpu"})  # before the port opens


def test_tokenizer_without_pad_token_is_a_clear_error(random_rm, tmp_path):
    _, paths = random_rm
    no_pad = _save_tokenizer(tmp_path / "no_pad", pad=False)
    reward = load_reward("reward_model", model=paths["model"], tokenizer=no_pad, device="cpu")
    with pytest.raises(RewardError, match=rf"the tokenizer of {re.escape(no_pad)} has no pad token; scoring pads a batch, so it needs "
                                          r"one: set pad_token in its tokenizer_config.json"):
        reward(["#### 3"], prompts=["1+2=?"])


def test_append_eos_ends_the_plain_text_with_eos(random_rm):
    model, paths = random_rm
    reward = load_reward("reward_model", model=paths["model"], tokenizer=paths["plain"], append_eos=True,
                         batch_size=len(PROMPTS), device="cpu")
    with_eos = [p + r + "<|endoftext|>" for p, r in zip(PROMPTS, RESPONSES)]  # the reference reads the EOS as text
    expected = _reference(model, paths["plain"], chat=False, prompts=with_eos, responses=[""] * len(PROMPTS))
    assert reward(RESPONSES, prompts=PROMPTS) == pytest.approx(expected, abs=1e-5)


def test_model_without_a_score_head_is_a_clear_error(tmp_path):
    """An encoder classifier (BERT: pooler + ``classifier``) has no per-token ``score`` head to read."""
    from transformers import BertConfig, BertForSequenceClassification

    from unirl.text.tiny import build_tokenizer

    path = tmp_path / "bert"
    config = BertConfig(vocab_size=len(build_tokenizer()), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, num_labels=1)
    BertForSequenceClassification(config).save_pretrained(path)
    _save_tokenizer(path)
    reward = load_reward("reward_model", model=str(path), device="cpu")
    with pytest.raises(RewardError, match=rf"{re.escape(str(path))} loads as BertForSequenceClassification, which has no "
                                          r"one-output linear `score` head"):
        reward(["#### 3"], prompts=["1+2=?"])


def test_settings_are_checked(random_rm):
    _, paths = random_rm
    with pytest.raises(RewardError, match="reward_model needs kwargs.model"):
        load_reward("reward_model")
    with pytest.raises(RewardError, match="truncation must be one of"):
        load_reward("reward_model", model=paths["model"], truncation="middle")
    with pytest.raises(RewardError, match="has no parameter 'max_len'. Did you mean 'max_length'"):
        load_reward("reward_model", model=paths["model"], max_len=3)
    forced = load_reward("reward_model", model=paths["model"], tokenizer=paths["plain"], chat_template=True, device="cpu")
    with pytest.raises(RewardError, match=rf"chat_template=true, but the tokenizer of {re.escape(paths['plain'])} has no chat template"):
        forced(["#### 3"], prompts=["1+2=?"])


# ----------------------------------------------------------------------------------------------
# A constructed RM that rewards the character "5", and GRPO on it
# ----------------------------------------------------------------------------------------------

REWARDED = "5"  # sampled by the warm-started tiny model in about 1 answer in 7; never in a prompt (operands 0..4)
SCALE = 20.0  # one "5" in a ~20-token sample scores about 1


def _five_counter(path: Path) -> str:
    """A one-layer Qwen2 RM whose score is ``SCALE * f / sqrt(1 + f^2)`` (for a sample ending in a
    token other than "5", such as the template's EOS), f = the share of "5" tokens in the sample.

    The weights are set by hand (hidden size H = 32), everything not named below is zero:
    - embeddings: channel 2 is 1 for every token (a constant), channel 0 is 1 for "5";
    - attention: q and k are zero, so every query attends uniformly to its whole causal prefix
      (RoPE rotates zeros to zeros). The input RMSNorm maps a "5" (channels 0 and 2 at 1) to
      channel 0 = 1 / sqrt(2 / H) = 4; v reads channel 0 times 1/4, o writes it to channel 1: at
      the last token, channel 1 of the residual stream gains the mean of 1["5"] over the sample, f;
    - the MLP's down projection is zero: the MLP adds nothing;
    - the last token's hidden state is h = (0, f, 1, 0, ...): the final RMSNorm gives
      h / sqrt((1 + f^2) / H), and the score head reads channel 1 times SCALE / sqrt(H).
    """
    from unirl.text.tiny import build_tokenizer

    model = _tiny_classifier(num_hidden_layers=1)
    hidden = model.config.hidden_size
    five = build_tokenizer().convert_tokens_to_ids(REWARDED)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.model.norm, model.model.layers[0].input_layernorm, model.model.layers[0].post_attention_layernorm):
            norm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight  # [V, H]
        embed[:, 2] = 1.0
        embed[five, 0] = 1.0
        attn = model.model.layers[0].self_attn
        attn.v_proj.weight[0, 0] = 1.0 / math.sqrt(hidden / 2)
        attn.o_proj.weight[1, 0] = 1.0
        model.score.weight[0, 1] = SCALE / math.sqrt(hidden)
    model.save_pretrained(path)
    return _save_tokenizer(path)


def test_constructed_rm_scores_the_share_of_fives(tmp_path):
    path = _five_counter(tmp_path / "fives")
    reward = load_reward("reward_model", model=path, device="cpu")
    prompts = ["1+4=?", "1+4=?", "2+3=?", "0+0=?"]
    responses = ["#### 5", "#### 55", "#### 6", "5 5 5"]
    scores = reward(responses, prompts=prompts)
    for score, prompt, response in zip(scores, prompts, responses):
        text = _rendered(prompt, response, chat=True)
        n_tokens = len(text) - len("<|endoftext|>") + 1  # one token per character, plus the EOS
        f = text.count(REWARDED) / n_tokens
        # The RMSNorm epsilons (1e-6 against mean squares of about 0.06 and 0.03) move it by < 1e-4.
        assert score == pytest.approx(SCALE * f / math.sqrt(1 + f * f), rel=1e-4), (prompt, response)
    assert scores[2] == pytest.approx(0.0, abs=1e-6) and scores[1] > scores[0] > 0


def test_reward_model_drives_grpo_and_the_reward_rises(tmp_path, tiny_lm_dir):
    """GRPO on the tiny text model with only the constructed RM as its reward, through the CLI with
    a config file, as a user runs it: the mean reward of the last steps beats the first steps'."""
    rm = _five_counter(tmp_path / "fives")
    config = yaml.safe_load((REPO / "configs" / "text" / "tiny.yaml").read_text())
    config["rewards"] = [{"name": "reward_model", "kwargs": {"model": rm, "batch_size": 64, "device": "cpu"}}]
    config["rollout"]["engine"] = "hf"
    config["trainer"].update(total_steps=10, prompts_per_step=8, group_size=8, mini_batch_size=64,
                             micro_batch_size=64, eval_every=0, save_every=0, progress=False)
    (tmp_path / "rm_grpo.yaml").write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "text", "--config", str(tmp_path / "rm_grpo.yaml"),
                           "--output-dir", str(run)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward/reward_model"] for m in rows if "reward/reward_model" in m]
    assert len(rewards) == 10
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.3, f"reward did not rise: first 3 steps {first:.3f}, last 3 {last:.3f} ({rewards})"
