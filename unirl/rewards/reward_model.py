"""``reward_model``: a learned outcome reward model, the one-number judge of RLHF (verl's and OpenRLHF's RM).

The model is an ``AutoModelForSequenceClassification`` with one label (a decoder such as a Llama or
Qwen2 with a linear ``score`` head), read from ``model=`` (a local directory or a hub id) with its own
tokenizer (``tokenizer=``, default: the same place). For each sample:

1. the prompt and the response are rendered as the reward model's tokenizer wants: through its chat
   template as ``[{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]``
   (``add_generation_prompt=False``, then tokenised without adding special tokens, since the template
   writes them) when it has one; otherwise as the plain concatenation ``prompt + response`` tokenised
   with the tokenizer's own special tokens (a BOS where it adds one). ``chat_template=true`` / ``false``
   forces either;
2. the samples of a slice of ``batch_size`` are padded on the tokenizer's ``padding_side``; position
   ids count real tokens only (``cumsum(mask) - 1``), so a left-padded sample sees the positions it
   would see alone;
3. the backbone runs once and the head is applied to the hidden state of the *last real token*
   (the last 1 of the attention mask): that number is the score.

What the references do, for comparison (facts only):

- verl (``verl/workers/fsdp_workers.py::RewardModelWorker``): loads the RM as
  ``AutoModelForTokenClassification`` with ``num_labels=1`` forced, takes the per-token head output at
  ``argmax(position_ids * attention_mask)`` (the last real token) with position ids from the mask;
  when the policy's tokenizer differs it decodes the response (EOS removed), appends it to the raw
  chat as the assistant turn, applies the RM's chat template with ``add_generation_prompt=False``,
  tokenises without special tokens, right-pads, and truncates on the right (``truncation: right``).
- OpenRLHF (``openrlhf/models/model.py``, the reward model class): the base model plus a bias-free
  ``nn.Linear(hidden, 1)`` named ``score``; the reward is the head's output at
  ``L - 1 - argmax(fliplr(mask))`` (the last 1 of the mask), position ids ``cumsum(mask) - 1``.
  Its RM training appends the EOS token to every sequence (``append_eos=true`` here does the same)
  and its ``serve_rm`` left-pads.

transformers' own ``forward`` of these models pools at the rightmost token that is not the pad id and
counts positions from the first column; this reads at the attention mask's last 1 with positions from
the mask, so the score depends neither on the padding side (absolute position embeddings, as GPT-2's,
would see shifted positions when left-padded) nor on the other samples of the slice, and a text that
ends with the pad token (a pad equal to the EOS that a chat template writes) is read at that token.

The model loads once per process (``ModelReward``: on the first batch in a run, before the port
opens under ``unirl serve-reward``), on ``device``, in ``dtype``, and scores ``batch_size`` samples
per forward pass.
"""

from __future__ import annotations

from typing import Any, Sequence

from unirl.rewards.models import ModelReward
from unirl.rewards.registry import register_reward

_TRUNCATION = ("error", "left", "right")


@register_reward("reward_model", modality="text")
class RewardModel(ModelReward):
    """A learned reward model: a one-label sequence classifier's score at the last token of prompt + response.

    Args:
        model: local directory or hub id of an ``AutoModelForSequenceClassification`` with one label.
        tokenizer: where its tokenizer is; defaults to ``model``.
        max_length: the most tokens of one rendered sample; default: the model's
            ``max_position_embeddings``.
        truncation: a sample longer than ``max_length``: ``error`` (default: a cut sequence is not
            what the RM was trained to score), ``left`` (keep the end, where the score is read) or
            ``right`` (keep the beginning, verl's default).
        chat_template: None (default) uses the tokenizer's chat template when it has one, plain
            concatenation otherwise; true requires one; false always concatenates.
        append_eos: end every sequence with the EOS token (unless it ends with it already), as
            OpenRLHF trains its reward models.
        device, dtype, batch_size: see ``ModelReward``.
    """

    modality = "text"

    def __init__(self, *, model: str | None = None, tokenizer: str | None = None, max_length: int | None = None,
                 truncation: str = "error", chat_template: bool | None = None, append_eos: bool = False,
                 **kwargs: Any):
        super().__init__(**kwargs)
        if not model:
            raise ValueError("reward_model needs kwargs.model: a local directory or hub id of an "
                             "AutoModelForSequenceClassification with num_labels=1")
        if truncation not in _TRUNCATION:
            raise ValueError(f"reward_model: truncation must be one of {_TRUNCATION}, got {truncation!r}")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"reward_model: max_length must be a positive integer, got {max_length!r}")
        if chat_template not in (None, True, False):
            raise ValueError(f"reward_model: chat_template must be true, false or null, got {chat_template!r}")
        self.model_path = str(model)
        self.tokenizer_path = str(tokenizer or model)
        self.max_length = max_length
        self.truncation = truncation
        self.chat_template = chat_template
        self.append_eos = bool(append_eos)

    # ------------------------------------------------------------------------------------------
    # Loading, with the checks that name the model
    # ------------------------------------------------------------------------------------------

    def load(self) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        # 1. The config and the tokenizer first: a wrong head or a tokenizer that cannot pad fails
        #    before the weights are read.
        config = AutoConfig.from_pretrained(self.model_path)
        if config.num_labels != 1:
            raise ValueError(
                f"reward_model: {self.model_path} has a classification head with {config.num_labels} labels "
                f"({dict(config.id2label)}); a reward model has one (a scalar score): expected num_labels=1 in its "
                f"config.json (a config without id2label defaults to 2 labels)")
        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        if tokenizer.pad_token is None:
            raise ValueError(
                f"reward_model: the tokenizer of {self.tokenizer_path} has no pad token; scoring pads a batch, so "
                f"it needs one: set pad_token in its tokenizer_config.json (its EOS token will do: the score is "
                f"read at the attention mask's last 1, not at a pad id)")
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if self.chat_template is True and not has_template:
            raise ValueError(f"reward_model: chat_template=true, but the tokenizer of {self.tokenizer_path} has no "
                             f"chat template (set chat_template=false to score prompt + response concatenated)")
        self.use_chat_template = has_template if self.chat_template is None else self.chat_template
        if self.append_eos and tokenizer.eos_token_id is None:
            raise ValueError(f"reward_model: append_eos=true, but the tokenizer of {self.tokenizer_path} has no EOS token")

        # 2. The weights; the head must be a one-output linear layer read per token.
        model = AutoModelForSequenceClassification.from_pretrained(self.model_path)
        head = getattr(model, "score", None)
        if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
            raise ValueError(
                f"reward_model: {self.model_path} loads as {type(model).__name__}, which has no one-output linear "
                f"`score` head over the last hidden states; expected a decoder's *ForSequenceClassification "
                f"(Llama, Qwen2, Mistral, Gemma, GPT-2, ...) with num_labels=1")
        model.to(self.device, self.torch_dtype).eval().requires_grad_(False)
        self.model, self.backbone, self.head, self.tokenizer = model, model.base_model, head, tokenizer
        if self.max_length is None:
            self.max_length = getattr(config, "max_position_embeddings", None)

    # ------------------------------------------------------------------------------------------
    # Rendering and scoring
    # ------------------------------------------------------------------------------------------

    def encode(self, prompt: str, response: str) -> list[int]:
        """The token ids of one sample, rendered and truncated as configured (see the module doc)."""
        tok = self.tokenizer
        if self.use_chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
            ids = tok(text, add_special_tokens=False).input_ids
        else:
            ids = tok(prompt + response, add_special_tokens=True).input_ids
        if self.append_eos and (not ids or ids[-1] != tok.eos_token_id):
            ids = ids + [tok.eos_token_id]
        if not ids:
            raise ValueError("reward_model: a sample renders to no tokens (an empty prompt and response)")
        if self.max_length is not None and len(ids) > self.max_length:
            if self.truncation == "error":
                raise ValueError(
                    f"reward_model: a sample is {len(ids)} tokens for {self.model_path}, more than "
                    f"max_length={self.max_length}; raise max_length, or set truncation to left or right")
            ids = ids[-self.max_length:] if self.truncation == "left" else ids[:self.max_length]
        return ids

    def score(self, samples: Sequence[str], *, prompts: Sequence[str], **columns: Any):
        import torch

        # (A failing sample is named by score_batch, which re-scores the batch one sample at a time.)
        ids = [self.encode(str(p), str(s)) for p, s in zip(prompts, samples)]
        batch = self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")  # on its padding_side
        input_ids = batch["input_ids"].to(self.device)  # [n, L]
        mask = batch["attention_mask"].to(self.device)  # [n, L]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [n, L] real tokens count from 0 on either side
        hidden = self.backbone(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                               use_cache=False).last_hidden_state  # [n, L, H]
        last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # [n] index of each row's last real token
        rows = torch.arange(len(ids), device=hidden.device)
        return self.head(hidden[rows, last]).squeeze(-1).float().cpu()  # [n, 1] -> [n]
