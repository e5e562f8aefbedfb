"""Episodes as a text run's rollout: the config's environment loaded once, its episodes played by the
runner, turned into a ``Rollout`` the trainer trains on, and their ``env/...`` figures.

What the trainer reads of an episode (N = B*G samples, P prompt tokens, R response tokens):

* ``response_mask`` [N, R], the loss mask: 1 on generated tokens, 0 on observations, and 0 on every
  token of an episode whose environment failed or timed out (its outcome says nothing about the policy);
* ``engine_logp`` [N, R]: the engine's log-probs of the generated tokens;
* ``turn_rewards``, ``turn_ends`` [N, R] and ``turn_discount`` [N]: each turn's reward on its last
  token, for the token-reward estimators (``unirl.core.turns``; the trainer's advantages stage);
* the column ``episode_return`` [N] (the sum of the per-turn rewards), which the ``episode_return``
  reward hands to the reward set: the sample's reward the outcome estimators (GRPO) read.

An episode lives inside one rollout call: a checkpoint never holds a live one, so resuming replays
the next batch from the saved RNG like any other rollout (with ``source.max_staleness`` the queued
batches are finished rollouts, handled as today's).
"""

from __future__ import annotations

import torch

from unirl.agents.protocol import load_environment
from unirl.agents.runner import EpisodeTrace, run_episodes
from unirl.env import Rollout


def episode_rollout(cfg, tokenizer, encode) -> "EpisodeRollout | None":
    """The text run ``cfg``'s ``EpisodeRollout``, or None when ``rollout.environment.name`` is null."""
    if cfg.rollout.environment.name is None:
        return None
    return EpisodeRollout(cfg.rollout, tokenizer, encode, chat_template=cfg.data.chat_template)


class EpisodeRollout:
    """The run's environment (``rollout.environment``): ``rollout`` for training, ``play`` for greedy
    evaluation, ``metrics`` for the step's figures. ``encode(text)`` makes prompt ids of a first
    observation (the text environment's chat template and prompt-length check)."""

    def __init__(self, rollout_cfg, tokenizer, encode, *, chat_template: bool):
        env = rollout_cfg.environment
        self.cfg, self.env_cfg, self.tokenizer, self.encode = rollout_cfg, env, tokenizer, encode
        self.make = load_environment(env.name, env.kwargs)
        self.wrap = chat_observation(tokenizer) if chat_template and getattr(tokenizer, "chat_template", None) else None

    def play(self, engine, rows: list[dict], *, n: int, greedy: bool = False, max_new_tokens: int | None = None
             ) -> list[list[EpisodeTrace]]:
        r, env = self.cfg, self.env_cfg
        return run_episodes(engine, self.tokenizer, self.make, rows, encode=self.encode, n=n, greedy=greedy,
                            max_new_tokens=max_new_tokens or r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p, top_k=r.top_k, max_turns=r.max_turns, max_total_tokens=r.max_total_tokens,
                            max_observation_tokens=r.max_observation_tokens,
                            truncated_text=r.observation_truncated_text, step_timeout_s=env.step_timeout_s,
                            concurrency=env.concurrency, wrap_observation=self.wrap,
                            stop=getattr(self.make, "stop", None), name=f"environment {env.name}")

    def rollout(self, engine, rows: list[dict], group_size: int) -> Rollout:
        return traces_to_rollout(rows, self.play(engine, rows, n=group_size), self.tokenizer,
                                 turn_discount=self.env_cfg.turn_discount)

    def metrics(self, rollout: Rollout) -> dict[str, float]:
        return episode_metrics(rollout.tensors)

    def close(self) -> None:  # every episode is closed by the call that played it
        pass


def traces_to_rollout(rows: list[dict], groups: list[list[EpisodeTrace]], tokenizer, *, turn_discount: float) -> Rollout:
    """N = B*G samples: prompts left-padded [N, P], responses right-padded [N, R] with the loss mask's
    holes at observations; the turn rewards on their tokens; per-episode figures [N]; the episode's
    return, turns and outcome as columns the rewards may read."""
    flat = [(i, t) for i, g in enumerate(groups) for t in g]
    pad, N = tokenizer.pad_token_id, len(flat)
    P = max(len(t.prompt_ids) for _, t in flat)
    R = max(1, max(len(t.ids) for _, t in flat))
    prompt = torch.full((N, P), pad, dtype=torch.long)  # [N, P]
    prompt_mask = torch.zeros((N, P), dtype=torch.long)
    response = torch.full((N, R), pad, dtype=torch.long)  # [N, R]
    tokens, loss, engine_logp = (torch.zeros((N, R), dtype=torch.float32) for _ in range(3))
    turn_rewards, turn_ends = torch.zeros((N, R), dtype=torch.float32), torch.zeros((N, R), dtype=torch.float32)
    for n, (_, t) in enumerate(flat):
        p, L = t.prompt_ids, len(t.ids)
        prompt[n, P - len(p):] = torch.tensor(p)
        prompt_mask[n, P - len(p):] = 1
        if L:
            response[n, :L] = torch.tensor(t.ids)
            tokens[n, :L] = 1
            loss[n, :L] = 0.0 if t.error is not None else torch.tensor(t.loss_mask, dtype=torch.float32)
            engine_logp[n, :L] = torch.tensor(t.logprobs)
        for reward, end in zip(t.turn_rewards, t.turn_ends):
            if end >= 0:  # a turn that generated nothing leaves its reward to the rest (unirl.core.turns)
                turn_rewards[n, end] += reward
                turn_ends[n, end] = 1.0
    per = lambda f, dtype=torch.float32: torch.tensor([f(t) for _, t in flat], dtype=dtype)  # noqa: E731
    columns = {k: [rows[i].get(k) for i, _ in flat] for k in rows[0] if k != "prompt"}
    columns.update(episode_return=[t.episode_return for _, t in flat], turns=[t.turns for _, t in flat],
                   episode_done=[t.done for _, t in flat], episode_info=[t.info for _, t in flat])
    return Rollout(
        tensors={"prompt_ids": prompt, "prompt_mask": prompt_mask, "response_ids": response, "response_mask": loss,
                 "response_attention_mask": tokens, "finished": per(lambda t: not t.truncated, torch.bool),
                 "turn_rewards": turn_rewards, "turn_ends": turn_ends,
                 "turn_discount": torch.full((N,), float(turn_discount)),
                 "turns": per(lambda t: t.turns), "episode_return": per(lambda t: t.episode_return),
                 "episode_done": per(lambda t: t.done), "env_errors": per(lambda t: t.error is not None or t.close_error is not None),
                 "env_timeouts": per(lambda t: t.timed_out), "env_seconds": per(lambda t: t.env_seconds),
                 "env_steps": per(lambda t: t.steps), "observation_tokens": per(lambda t: t.observation_tokens),
                 "observations_truncated": per(lambda t: t.observations_truncated)},
        engine_logp=engine_logp,
        group_ids=torch.tensor([i for i, _ in flat]),
        prompts=[t.prompt for _, t in flat],
        samples=[tokenizer.decode(t.ids, skip_special_tokens=True) for _, t in flat],
        columns=columns,
    )


def episode_metrics(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """``env/...``: means per episode, errors and timeouts as counts, seconds per environment call."""
    steps = tensors["env_steps"].sum()
    return {
        "env/return_mean": tensors["episode_return"].mean().item(),
        "env/turns_mean": tensors["turns"].mean().item(),
        "env/done_frac": tensors["episode_done"].mean().item(),
        "env/errors": tensors["env_errors"].sum().item(),
        "env/timeouts": tensors["env_timeouts"].sum().item(),
        "env/step_latency_s": (tensors["env_seconds"].sum() / steps.clamp_min(1)).item(),
        "rollout/turns_mean": tensors["turns"].mean().item(),
        "rollout/truncated_frac": 1.0 - tensors["finished"].float().mean().item(),
        "rollout/observation_tokens_mean": tensors["observation_tokens"].mean().item(),
        "rollout/observations_truncated": tensors["observations_truncated"].sum().item(),
    }


def chat_observation(tokenizer):
    """``wrap(text, eos)``: an observation as the chat template writes a user message after the
    assistant's turn (``<|im_start|>user ... <|im_start|>assistant`` for ChatML), found by rendering a
    short conversation and keeping what follows the assistant's text. When the turn ended with EOS, the
    template's own end of the assistant message (the same token) is not written twice."""
    marker, asked = "\u2063ASSISTANT\u2063", "\u2063USER\u2063"
    convo = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker},
             {"role": "user", "content": asked}]
    text = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    after = text[text.index(marker) + len(marker):]
    head, tail = after.split(asked, 1)
    eos = tokenizer.eos_token or ""

    def wrap(observation: str, ended_with_eos: bool) -> str:
        start = head[len(eos):] if ended_with_eos and eos and head.startswith(eos) else head
        return start + observation + tail

    return wrap
