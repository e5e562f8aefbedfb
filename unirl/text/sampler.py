"""The text environment's sampling and scoring (``unirl.env.Sampler`` and ``Scorer``): prompts to the engine
(``rollout.engine``, built from ``unirl.rollout``'s registry), one turn or many with tools, the samples as a
``Rollout``; the weights published into the engine; the rollout's figures; the rewards with DAPO's overlong
penalty.

Shapes: N = B*G samples, P prompt tokens (left-padded), R response tokens (right-padded).
"""

from __future__ import annotations

import torch

from unirl.core import overlong_penalty, rollout_is_weights, rollout_mismatch_metrics
from unirl.env import Rollout
from unirl.rollout import EngineContext
from unirl.rollout.weights import publish
from unirl.text.multiturn import multi_turn_generate
from unirl.text.multiturn_rollout import multi_turn_metrics, overlong_lengths, trajectories_to_rollout, turn_limits


class TextSampler:
    """The text environment's ``sampler`` over its engine (``env``: the ``TextEnvironment`` that owns it: its
    config, tokenizer, prompt encoding and tools). ``engine`` is set at the environment's setup, and replaced by
    a batch source that needs another (``unirl.rollout.sources``)."""

    def __init__(self, env):
        self.env = env
        self.engine = None

    #: The registered engine (``unirl.rollout.ENGINES``) this sampler uses: ``rollout.engine`` (a VLM's: ``vlm``).
    @property
    def engine_name(self) -> str:
        return self.env.engine_name

    def engine_context(self, model_path: str, **kwargs) -> EngineContext:
        return self.env.engine_context(model_path, **kwargs)

    @torch.no_grad()
    def rollout(self, rows: list[dict], group_size: int) -> Rollout:
        r = self.env.cfg.rollout
        if self.env.episodes is not None:  # an environment's episodes (unirl/agents/episodes.py)
            return self.env.episodes.rollout(self.engine, rows, group_size)
        prompt_ids = [self.env.encode_prompt(row, i) for i, row in enumerate(rows)]
        if self.env.tools is not None:  # multi-turn, with tool calls (unirl/text/multiturn.py)
            fmt, runner = self.env.tools
            groups = multi_turn_generate(self.engine, self.env.tokenizer, fmt, runner, prompt_ids, n=group_size,
                                         max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                         top_k=r.top_k, **turn_limits(r))
            return trajectories_to_rollout(rows, groups, self.env.tokenizer)
        gens = self.engine.generate(prompt_ids, n=group_size, max_new_tokens=r.max_new_tokens,
                                    temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        flat = [(i, g) for i, gs in enumerate(gens) for g in gs]  # N = B*G, grouped by prompt
        return self._to_rollout(rows, prompt_ids, flat)

    def _to_rollout(self, rows, prompt_ids, flat) -> Rollout:
        pad = self.env.tokenizer.pad_token_id
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

    def release_memory(self) -> None:
        self.engine.sleep()  # vLLM's rollout.sleep_level (0, and the other engines: nothing)

    def sync_weights(self) -> None:
        """The policy's weights into the engine (``unirl.rollout.weights.publish``; a sharded policy bucket
        by bucket, ``rollout.sync_bucket_mb``)."""
        publish(self.engine, self.env.accelerator.unwrap_model(self.env.model), self.env.cfg.rollout.sync_bucket_mb)

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        mask = rollout.tensors["response_mask"].bool()
        old_logp = rollout.old_logp.cpu()
        diff = (rollout.engine_logp - old_logp).abs()[mask]
        out = {**self._mismatch_metrics(rollout.engine_logp, old_logp, mask),
               "rollout/logprob_diff_max": diff.max().item() if diff.numel() else 0.0,
               "rollout/logprob_diff_mean": diff.mean().item() if diff.numel() else 0.0,
               "rollout/response_length_mean": rollout.tensors["response_mask"].sum(-1).mean().item()}
        if "turns" in rollout.tensors:  # a multi-turn rollout: tool calls, or an environment's episodes
            episodes = self.env.episodes
            return {**out, **(episodes.metrics(rollout) if episodes else multi_turn_metrics(rollout.tensors))}
        return {**out, "rollout/truncated_frac": 1.0 - rollout.tensors["finished"].float().mean().item()}

    def _mismatch_metrics(self, engine_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict:
        """``rollout/mismatch_kl``, ``rollout/ppl_ratio`` ... (``rollout_mismatch_metrics``) whatever the
        correction mode, and the weights' ``rollout/is_mean`` and ``rollout/is_zero_frac`` when one is on."""
        algo = self.env.cfg.algo
        weights = None
        if algo.tis_cap is not None:
            weights = rollout_is_weights(old_logp, engine_logp, mask, mode=algo.rollout_is, high=algo.tis_cap,
                                         low=algo.rollout_is_min)
        figures = rollout_mismatch_metrics(old_logp, engine_logp, mask, weights)
        return {f"rollout/{k}": v for k, v in zip(figures, torch.stack(list(figures.values())).tolist())}



class TextScorer:
    """The text environment's ``scorer``: the run's rewards (``unirl.reward_set.RewardSet``) and DAPO's soft
    overlong penalty."""

    def __init__(self, env):
        self.env = env

    def score(self, rollout: Rollout):
        components = self.env.rewards.components(rollout.samples, prompts=rollout.prompts, columns=rollout.columns)
        rollout.tensors.update({f"score/{k}": v for k, v in components.items()})  # for global metrics
        rewards, metrics = self.env.rewards.combine(components, rollout.group_ids)
        if self.env.cfg.overlong.buffer is not None:  # DAPO's soft overlong punishment, on the combined reward
            lengths, max_length = rollout.tensors["response_mask"].sum(-1), self.env.cfg.rollout.max_new_tokens
            if self.env.tools is not None or self.env.episodes is not None:  # the whole multi-turn response, as verl
                lengths, max_length = overlong_lengths(self.env.cfg.rollout, rollout.tensors)
            penalty = overlong_penalty(lengths, max_length=max_length, buffer=self.env.cfg.overlong.buffer,
                                       factor=self.env.cfg.overlong.penalty_factor)  # [N]
            rewards = rewards + penalty
            rollout.tensors["score/overlong_penalty"] = penalty
            metrics["reward/overlong_penalty"] = penalty.mean().item()
        return rewards, metrics
