"""The text environment: prompts -> vLLM (or transformers) samples -> rewards -> token log-probs.

Shapes: N = B*G samples, P prompt tokens (left-padded), R response tokens (right-padded).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from unirl.core import kl_divergence, overlong_penalty, rollout_is_weights, rollout_mismatch_metrics
from unirl.env import Environment, Rollout, lora_or_frozen_reference, sharded_state_dict
from unirl.reward_set import RewardSet
from unirl.text.config import CriticConfig, TextConfig
from unirl.text.critic import load_value_model
from unirl.text.data import PromptSampler, load_rows, to_prompt_rows
from unirl.sharding import is_sharded
from unirl.text.distill import check_teacher_positions, load_teacher
from unirl.text.engines import HFEngine, VLLMEngine
from unirl.text.policy_weights import export_sharded, hf_checkpoint_weights, push_weights
from unirl.text.sizing import longest_call
from unirl.text.logprobs import response_logprobs
from unirl.text.rollout_client import ServerEngine
from unirl.text.model_loading import check_lora_targets, check_weight_files, resolve_model_path  # noqa: F401 (unirl.evaluation imports it here)
from unirl.text.held_out import evaluate_held_out
from unirl.text.multiturn import multi_turn_generate
from unirl.text.multiturn_rollout import (build_tools, multi_turn_metrics, overlong_lengths, trajectories_to_rollout,
                                          turn_limits)
from unirl.text.packing import check_packable, pack_shared_prompts, use_packed_attention
from unirl.text.vlm import refuse_images_for_text_model, vlm_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def response_tokens(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """[N, R] every real response token (attention, lengths, padding). A multi-turn rollout stores it
    as ``response_attention_mask`` beside ``response_mask``, the loss mask, which is 0 at tool
    observations; a single-turn rollout's two masks are the same tensor."""
    return tensors.get("response_attention_mask", tensors["response_mask"])


class TextEnvironment(Environment):
    recompute_old_logprobs = True
    left_padded = ("prompt_ids", "prompt_mask")
    takes_images = False  # VLMEnvironment's (unirl/text/vlm_env.py): unirl.text.build_environment picks it

    def __init__(self, cfg: TextConfig):
        # A VLM given to this class directly; local files only (build_environment has asked the hub already).
        if not self.takes_images and vlm_model(cfg.model.name_or_path, fetch=False):
            raise ValueError(f"model.name_or_path={cfg.model.name_or_path!r} is a vision-language model: its "
                             f"environment is a VLMEnvironment (unirl.text.build_environment(cfg) picks it)")
        self.cfg = cfg
        self._model = None
        self.ref = None
        self.teacher = None  # distill.teacher, loaded at setup
        self.engine = None
        self.sampler_model = None  # the transformers engine's own copy, with asynchronous rollouts

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
            if cfg.rollout.engine in ("vllm", "server"):  # the transformers engine samples from this very model
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
        if self.teacher is not None:  # it must place the longest prompt + answer (an IndexError at step 1 otherwise)
            check_teacher_positions(self.teacher.config, cfg, self.longest_prompt)
        self.sampler = PromptSampler(self.train_rows, cfg.trainer.prompts_per_step, seed=cfg.trainer.seed,
                                     shuffle=cfg.data.shuffle, rank=accelerator.process_index,
                                     world_size=accelerator.num_processes)
        # 4. Rewards and the rollout engine.
        self.rewards = RewardSet(cfg.rewards, aggregation=cfg.algo.reward_aggregation, workers=cfg.trainer.reward_workers,
                                 eps=cfg.algo.adv_eps)
        r = cfg.rollout
        if r.engine == "vllm":
            self.engine = VLLMEngine.from_config(
                cfg, self.model_path, seed=cfg.trainer.seed + accelerator.process_index, sleep_level=r.sleep_level,
                sequences=max(cfg.trainer.prompts_per_step * cfg.trainer.group_size, len(self.test_rows)))
        elif cfg.rollout.engine == "server":  # `unirl serve-rollout` in its own process (unirl/text/rollout_server.py)
            self.engine = ServerEngine(cfg.rollout.server_url, timeout_s=cfg.rollout.server_timeout_s,
                                       processes=accelerator.num_processes)
        elif cfg.rollout.max_staleness:  # asynchronous: sample from a copy the trainer's updates do not touch
            self.sampler_model = copy.deepcopy(model).eval().requires_grad_(False).to(accelerator.device)
            self.engine = HFEngine(lambda: self.sampler_model, self.tokenizer, cache=r.hf_cache,
                                   max_cache_len=longest_call(cfg))
        else:
            self.engine = HFEngine(lambda: self.accelerator.unwrap_model(self._model), self.tokenizer,
                                   cache=r.hf_cache, max_cache_len=longest_call(cfg))
        self.tools = build_tools(cfg.rollout, self.tokenizer) if cfg.rollout.tools else None

    def _load_policy(self, auto_class, dtype):  # a VLM loads with another class (unirl/text/vlm_env.py)
        check_weight_files(self.model_path, f"model.name_or_path={self.cfg.model.name_or_path}: weights file")
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

    def _check_images(self, rows: list[dict], source: str) -> None:  # a VLM checks them (unirl/text/vlm_env.py)
        refuse_images_for_text_model(rows, source, self.model_path)

    def with_pictures(self, rows: list[dict]) -> list[dict]:  # a VLM decodes the rows' pictures (unirl/text/vlm_env.py)
        return rows

    def _within_prompt_length(self, rows: list[dict], source: str, which: str) -> list[dict]:
        """Every prompt measured once before training: the rows longer than ``data.max_prompt_length``
        are dropped (``data.filter_overlong_prompts``) or stop the run, named ``file:line``."""
        from unirl.text.data import row_place

        limit = self.cfg.data.max_prompt_length
        lengths = [self._prompt_length(row) for row in rows]
        over = [i for i, n in enumerate(lengths) if n > limit]
        self.longest_prompt = max([getattr(self, "longest_prompt", 0)] + [n for n in lengths if n <= limit])
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

    # ---------------------------------------------------------------- rollout
    def next_prompts(self, step: int) -> list[dict]:
        return self.sampler.batch(step)

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

    @torch.no_grad()
    def rollout(self, rows: list[dict], group_size: int) -> Rollout:
        r = self.cfg.rollout
        prompt_ids = [self.encode_prompt(row, i) for i, row in enumerate(rows)]
        if self.tools is not None:  # multi-turn, with tool calls (unirl/text/multiturn.py)
            fmt, runner = self.tools
            groups = multi_turn_generate(self.engine, self.tokenizer, fmt, runner, prompt_ids, n=group_size,
                                         max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                         top_k=r.top_k, **turn_limits(r))
            return trajectories_to_rollout(rows, groups, self.tokenizer)
        gens = self.engine.generate(prompt_ids, n=group_size, max_new_tokens=r.max_new_tokens,
                                    temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        flat = [(i, g) for i, gs in enumerate(gens) for g in gs]  # N = B*G, grouped by prompt
        return self._to_rollout(rows, prompt_ids, flat)

    def _to_rollout(self, rows, prompt_ids, flat) -> Rollout:
        pad = self.tokenizer.pad_token_id
        P = max(len(prompt_ids[i]) for i, _ in flat)
        R = max(1, max(len(g.response_ids) for _, g in flat))
        N = len(flat)
        prompt = torch.full((N, P), pad, dtype=torch.long)  # [N, P] left-padded
        prompt_mask = torch.zeros((N, P), dtype=torch.long)
        response = torch.full((N, R), pad, dtype=torch.long)  # [N, R] right-padded
        response_mask = torch.zeros((N, R), dtype=torch.float32)
        engine_logp = torch.zeros((N, R), dtype=torch.float32)
        for n, (i, g) in enumerate(flat):
            p, L = prompt_ids[i], len(g.response_ids)
            prompt[n, P - len(p):] = torch.tensor(p)
            prompt_mask[n, P - len(p):] = 1
            if L:
                response[n, :L] = torch.tensor(g.response_ids)
                response_mask[n, :L] = 1
                engine_logp[n, :L] = torch.tensor(g.logprobs)
        columns = {k: [rows[i].get(k) for i, _ in flat] for k in rows[0] if k != "prompt"}
        return Rollout(
            tensors={"prompt_ids": prompt, "prompt_mask": prompt_mask, "response_ids": response,
                     "response_mask": response_mask, "finished": torch.tensor([g.finished for _, g in flat])},
            engine_logp=engine_logp,
            group_ids=torch.tensor([i for i, _ in flat]),
            prompts=[rows[i]["prompt"] for i, _ in flat],
            samples=[g.text for _, g in flat],
            columns=columns,
        )

    def score(self, rollout: Rollout):
        components = self.rewards.components(rollout.samples, prompts=rollout.prompts, columns=rollout.columns)
        rollout.tensors.update({f"score/{k}": v for k, v in components.items()})  # for global metrics
        rewards, metrics = self.rewards.combine(components, rollout.group_ids)
        if self.cfg.overlong.buffer is not None:  # DAPO's soft overlong punishment, on the combined reward
            lengths, max_length = rollout.tensors["response_mask"].sum(-1), self.cfg.rollout.max_new_tokens
            if self.tools is not None:  # the whole multi-turn response against its own maximum, as verl
                lengths, max_length = overlong_lengths(self.cfg.rollout, rollout.tensors)
            penalty = overlong_penalty(lengths, max_length=max_length, buffer=self.cfg.overlong.buffer,
                                       factor=self.cfg.overlong.penalty_factor)  # [N]
            rewards = rewards + penalty
            rollout.tensors["score/overlong_penalty"] = penalty
            metrics["reward/overlong_penalty"] = penalty.mean().item()
        return rewards, metrics

    # ------------------------------------------------------------- log-probs
    def score_actions(self, model, batch: Rollout, columns: slice = slice(None)) -> dict[str, torch.Tensor]:
        """Token log-probs of the stored responses under ``model`` (temperature-scaled like sampling), and
        their entropies in the update's forward (grad enabled; logged as ``actor/entropy``, trained only
        when ``algo.entropy_coef > 0``); ``model.logprob_chunk_size`` tokens at a time, so the
        full-vocabulary logits never exist (``unirl.text.logprobs``)."""
        if columns != slice(None):
            raise ValueError("the text environment scores whole responses (column_slices is one piece)")
        device = self.accelerator.device
        t = {k: v.to(device) for k, v in batch.tensors.items()}
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        tokens = response_tokens(t)  # [n, R] every real token; response_mask may have holes (observations)
        if self.cfg.model.share_prompt:  # one copy of each prompt, no padding (unirl/text/packing.py)
            packed, extra = self._packed_row(model, batch, t, tokens)
            ids, positions, source = packed.input_ids, packed.position_ids, packed.source  # [1, T], [(3,) 1, T], [n, R]
            # The attention is the blocks'; a 4-D mask is taken as given, so transformers builds no [T, T] one.
            attn = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        else:
            ids = torch.cat([t["prompt_ids"], t["response_ids"]], dim=1)  # [n, P+R]
            attn = torch.cat([t["prompt_mask"], tokens.long()], dim=1)
            positions, source, extra = (attn.cumsum(-1) - 1).clamp(min=0), None, None
            positions, extra = self._model_inputs(batch, ids, positions, extra)
        logp, entropy = response_logprobs(model, head, ids, attn, positions, t["response_ids"],
                                          temperature=self.cfg.rollout.temperature,
                                          chunk_size=self.cfg.model.logprob_chunk_size,
                                          with_entropy=torch.is_grad_enabled() or self.cfg.algo.entropy_coef > 0,
                                          entropy_grad=self.cfg.algo.entropy_coef > 0, source=source,
                                          model_kwargs=extra)  # [n, R] each
        out = {"logp": logp, "mask": self._trained_tokens(t)}
        if entropy is not None:
            out["entropy"] = entropy
        return out

    def _model_inputs(self, batch: Rollout, ids: torch.Tensor, positions, extra):
        """The positions and extra model inputs of an unpacked forward over ``ids`` (a VLM: its own)."""
        return positions, extra

    def _packed_row(self, model, batch: Rollout, t: dict[str, torch.Tensor], tokens: torch.Tensor):
        """``batch`` (its tensors ``t`` on the device; ``tokens`` [n, R] its responses' real tokens) as one
        packed row for ``model``, and the extra inputs of its forward (a VLM adds its pictures and 3-D positions)."""
        packed = pack_shared_prompts(t["prompt_ids"], t["prompt_mask"], t["response_ids"], tokens)
        return packed, {"unirl_blocks": packed.blocks}

    def loss_mask(self, batch: Rollout) -> torch.Tensor:
        return self._trained_tokens(batch.tensors)

    def _trained_tokens(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """[n, R] the response tokens, without the truncated responses' with ``overlong.mask_truncated``."""
        mask = tensors["response_mask"]
        if self.cfg.overlong.mask_truncated:
            mask = mask * tensors["finished"].to(mask.dtype).unsqueeze(-1)  # TRL's mask_truncated_completions
        return mask

    # ---------------------------------------------------------------- critic
    def value_model(self, cfg: CriticConfig) -> torch.nn.Module:
        """verl's critic on the policy's architecture or ``cfg.name_or_path`` (``unirl/text/critic.py``)."""
        path = resolve_model_path(cfg.name_or_path) if cfg.name_or_path else self.model_path
        return load_value_model(path, cfg, self.tokenizer, dtype=_DTYPES[self.cfg.model.dtype],
                                share_prompt=self.cfg.model.share_prompt)

    def values(self, model, batch: Rollout) -> torch.Tensor:
        """[n, R] the value head's output at the positions whose hidden states predict the response
        tokens (where ``score_actions`` reads the log-probs), float32; packed as ``score_actions`` packs."""
        device = self.accelerator.device
        t = {k: batch.tensors[k].to(device) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
        R = t["response_ids"].shape[1]
        if self.cfg.model.share_prompt:
            packed = pack_shared_prompts(t["prompt_ids"], t["prompt_mask"], t["response_ids"], t["response_mask"])
            attn = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
            out = model(input_ids=packed.input_ids, attention_mask=attn, position_ids=packed.position_ids,
                        use_cache=False, unirl_blocks=packed.blocks).logits  # [1, L, 1]
            return out.reshape(-1)[packed.source].float()  # [n, R]
        ids = torch.cat([t["prompt_ids"], t["response_ids"]], dim=1)  # [n, P+R]
        attn = torch.cat([t["prompt_mask"], t["response_mask"].long()], dim=1)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False).logits  # [n, P+R, 1]
        return out[:, -R - 1:-1, 0].float()  # [n, R]

    def trim_padding(self, batch: Rollout) -> Rollout:
        """Prompts (left-padded) cut to the batch's longest, and every response-aligned tensor (the
        other 2-D ones: ids, masks, log-probs, per-token advantages, reference outputs) to its
        longest response. The log-probs are the same: pads are masked out of attention and the
        position ids count real tokens only."""
        t = batch.tensors
        P = max(1, int(t["prompt_mask"].sum(-1).max()))
        R = max(1, int(response_tokens(t).sum(-1).max()))

        def trimmed(name: str, v: torch.Tensor) -> torch.Tensor:
            if name in ("prompt_ids", "prompt_mask"):
                return v[:, v.shape[1] - P:]  # [n, P']
            return v[:, :R] if v.ndim >= 2 else v  # [n, R']

        return batch.map_tensors(trimmed)

    def sample_tokens(self, batch: Rollout) -> torch.Tensor:
        return batch.tensors["prompt_mask"].sum(-1) + response_tokens(batch.tensors).sum(-1).long()  # [n]

    @property
    def loss_norm_length(self) -> int:
        return self.cfg.rollout.max_new_tokens  # Dr. GRPO's constant, TRL's max_completion_length

    def kl(self, current, reference):
        algo = self.cfg.algo
        clamp = algo.kl_clamp if algo.kl_estimator in ("k3", "k3+") else None  # verl clamps low_var_kl only
        return kl_divergence(current["logp"], reference["logp"], estimator=algo.kl_estimator, clamp=clamp)

    def reference_model(self):
        return lora_or_frozen_reference(self.accelerator, self._model, self.ref, self.cfg.model.lora.enabled)

    @contextlib.contextmanager
    def teacher_model(self):
        yield self.teacher  # None with distill.teacher null: the trainer asks only when it is set

    def release_rollout_memory(self) -> None:
        if isinstance(self.engine, VLLMEngine):
            self.engine.sleep()  # rollout.sleep_level (0: nothing)

    def sync_weights(self) -> None:
        if isinstance(self.engine, (VLLMEngine, ServerEngine)):  # a sharded policy bucket by bucket (FSDP2)
            push_weights(self.engine, self.accelerator.unwrap_model(self._model), self.cfg.rollout.sync_bucket_mb)
        elif self.sampler_model is not None:
            self.load_policy_snapshot(self.policy_snapshot())

    def policy_snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """A copy of the policy's weights for asynchronous rollouts: HF checkpoint names for vLLM and the
        server, the module's own state for the transformers engine's copy."""
        model = self.accelerator.unwrap_model(self._model)
        if self.sampler_model is not None:
            return [(name, t.detach().clone()) for name, t in model.state_dict().items()]
        return [(name, t.clone()) for name, t in hf_checkpoint_weights(model)]

    def load_policy_snapshot(self, snapshot: list[tuple[str, torch.Tensor]]) -> None:
        if self.sampler_model is not None:
            self.sampler_model.load_state_dict(dict(snapshot))
        else:
            self.engine.load_weights(iter(snapshot))

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        mask = rollout.tensors["response_mask"].bool()
        old_logp = rollout.old_logp.cpu()
        diff = (rollout.engine_logp - old_logp).abs()[mask]
        out = {**self._mismatch_metrics(rollout.engine_logp, old_logp, mask),
               "rollout/logprob_diff_max": diff.max().item() if diff.numel() else 0.0,
               "rollout/logprob_diff_mean": diff.mean().item() if diff.numel() else 0.0,
               "rollout/response_length_mean": rollout.tensors["response_mask"].sum(-1).mean().item()}
        if "turns" in rollout.tensors:  # a multi-turn rollout
            return {**out, **multi_turn_metrics(rollout.tensors)}
        return {**out, "rollout/truncated_frac": 1.0 - rollout.tensors["finished"].float().mean().item()}

    def _mismatch_metrics(self, engine_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict:
        """``rollout/mismatch_kl``, ``rollout/ppl_ratio`` ... (``rollout_mismatch_metrics``) whatever the
        correction mode, and the weights' ``rollout/is_mean`` and ``rollout/is_zero_frac`` when one is on."""
        algo = self.cfg.algo
        weights = None
        if algo.tis_cap is not None:
            weights = rollout_is_weights(old_logp, engine_logp, mask, mode=algo.rollout_is, high=algo.tis_cap,
                                         low=algo.rollout_is_min)
        figures = rollout_mismatch_metrics(old_logp, engine_logp, mask, weights)
        return {f"rollout/{k}": v for k, v in zip(figures, torch.stack(list(figures.values())).tolist())}

    # ------------------------------------------------------------ evaluation
    def evaluation(self, step: int, run_dir: Path) -> dict[str, float]:
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
        if self.engine is not None:
            self.engine.close()
