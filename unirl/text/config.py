"""Config of a text GRPO run (``unirl train text --config NAME``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from unirl.config import FILE_SPEC, PATH
from unirl.schema import AlgoConfig, OptimConfig, RewardConfig, TrainerConfig


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class ModelConfig:
    #: A hub name, a local directory, or ``tiny`` for the embedded tiny Qwen2-style model.
    name_or_path: str = "tiny"
    #: Trainer dtype: float32, bfloat16, float16.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    #: Tokens per chunk of the trainer's log-prob pass: the sampled tokens' log-probs (and entropies)
    #: come from the last hidden states chunk by chunk, in forward and backward, so only chunk x vocab
    #: float32 logits exist at a time (1024 x 151936 x 4 B = 0.6 GB for Qwen2.5) instead of the
    #: micro-batch's [n, R, vocab]. null: the model's full logits (needed when the output head is not
    #: a plain linear layer, e.g. LoRA on lm_head, or the model changes the logits after it).
    logprob_chunk_size: Optional[int] = 1024
    #: Responses to the same prompt share one copy of it in the trainer's forward passes: each
    #: micro-batch becomes one row of its real tokens (each prompt once, then its responses; no
    #: padding), the linear layers run over those tokens only, and attention runs per block (a response
    #: sees its prompt and its own earlier tokens, at the positions of its padded row), so the log-probs
    #: are the padded layout's (unirl/text/packing.py). Needs sdpa attention and no sliding window
    #: (checked at setup); false: one padded row per sample.
    share_prompt: bool = True


@dataclass
class DataConfig:
    #: A local .jsonl/.json/.parquet file (a relative path not found from the working directory is
    #: looked up beside the config file; ``unirl://NAME`` is a bundled file), a ``datasets`` hub name,
    #: or ``tiny`` (the tiny model's addition task, generated with the model).
    train: str = field(default="tiny", metadata=PATH)
    #: Held-out split for evaluation (same forms); null disables evaluation.
    test: Optional[str] = field(default="tiny", metadata=PATH)
    #: Hub config name and split names when ``train``/``test`` are hub names.
    hub_config: Optional[str] = None
    train_split: str = "train"
    test_split: str = "test"
    #: How a row becomes a prompt: ``gsm8k`` (question + verl's instruction, gold from ``#### N``)
    #: or ``plain`` (the ``prompt_key`` column as is).
    adapter: Literal["gsm8k", "plain"] = "gsm8k"
    prompt_key: str = "question"
    #: Apply the tokenizer's chat template when it has one.
    chat_template: bool = True
    #: Prompts longer than this (tokens) are an error.
    max_prompt_length: int = 256
    #: Number of held-out rows used per evaluation (null: all).
    eval_size: Optional[int] = None
    shuffle: bool = True


@dataclass
class ToolConfig:
    """One tool the policy may call (unirl/tools/): a registered name, ``path/file.py:function``,
    ``package.module:function`` or ``http://host:port``, with settings for it."""

    name: str = field(default="search", metadata=FILE_SPEC)
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutConfig:
    #: ``vllm`` (colocated, weights synced every step) or ``hf`` (transformers ``generate``).
    engine: Literal["vllm", "hf"] = "vllm"
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    #: vLLM settings for GPUs (ignored by the CPU build where they do not apply).
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    #: vLLM dtype; "auto" follows the trainer's dtype.
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    #: Greedy decoding length for evaluation (null: max_new_tokens).
    eval_max_new_tokens: Optional[int] = None
    #: Tools the policy may call (empty: one generation per sample). With tools, a rollout is
    #: multi-turn: generate until a call or the end, run the calls, append the observation, go on.
    tools: list[ToolConfig] = field(default_factory=list)
    #: How calls and observations are written: ``search_r1`` (<search>/<information>/<answer> tags)
    #: or ``hermes`` (the chat template's <tool_call> and tool messages); see unirl/tools/formats.py.
    call_format: Literal["search_r1", "hermes"] = "search_r1"
    #: Generation turns per sample at most (Search-R1 trains with max_turns=2 on NQ + HotpotQA).
    max_turns: int = 4
    #: Prompt + all turns + observations, in tokens, at most (null: no limit beyond max_new_tokens
    #: per turn); a sample that reaches it is truncated and counted in rollout/truncated_frac.
    max_total_tokens: Optional[int] = None
    #: Seconds a tool call may take before the model is shown an error observation.
    tool_timeout_s: float = 30.0
    #: Tool calls of one turn of the batch run at most this many at once.
    tool_concurrency: int = 32
    #: The observation a failed call shows (``{error}``: what went wrong).
    tool_error_text: str = "Error: {error}"


@dataclass
class TextConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig()])
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    #: Where the run directory goes (``--output-dir`` overrides).
    output_dir: str = "runs/text"

    def __post_init__(self):
        if not self.rewards:
            raise ValueError("rewards: at least one reward is needed")
        if self.model.logprob_chunk_size is not None and self.model.logprob_chunk_size < 1:
            raise ValueError(f"model.logprob_chunk_size must be >= 1 or null, got {self.model.logprob_chunk_size}")
        if self.rollout.temperature <= 0:
            raise ValueError("rollout.temperature must be > 0 for sampling (evaluation is greedy by itself)")
