"""Glue between the multi-turn rollout (``multiturn.py``) and the text environment: the config's tools
built once, trajectories turned into a ``Rollout``, and the ``rollout/...`` tool metrics."""

from __future__ import annotations

import torch

from unirl.env import Rollout
from unirl.text.multiturn import Trajectory


def build_tools(rollout_cfg, tokenizer):
    """``(call format, ToolRunner)`` for ``rollout.tools`` (each loaded with its kwargs, named as the
    model calls it)."""
    from unirl.tools import load_tool, tool_name
    from unirl.tools.calling import ToolRunner
    from unirl.tools.formats import check_callable, resolve_call_format

    tools = {}
    for spec in rollout_cfg.tools:
        tool = load_tool(spec.name, **spec.kwargs)
        name = tool.info()["name"] if spec.name.startswith(("http://", "https://")) else tool_name(spec.name)
        if name in tools:
            raise ValueError(f"rollout.tools: two tools are called {name!r}")
        tools[name] = tool
    fmt_cls = resolve_call_format(rollout_cfg.call_format)
    check_callable(fmt_cls, list(tools), rollout_cfg.call_format)
    fmt = fmt_cls(tokenizer)
    runner = ToolRunner(tools, timeout_s=rollout_cfg.tool_timeout_s, max_concurrency=rollout_cfg.tool_concurrency,
                        error_text=rollout_cfg.tool_error_text)
    return fmt, runner


def turn_limits(rollout_cfg) -> dict:
    """``multi_turn_generate``'s limits from ``rollout``, the same for training, the run's held-out
    evaluation and ``unirl eval``: turns, total tokens, and how an observation is cut."""
    return dict(max_turns=rollout_cfg.max_turns, max_total_tokens=rollout_cfg.max_total_tokens,
                max_observation_tokens=rollout_cfg.max_observation_tokens,
                truncated_text=rollout_cfg.observation_truncated_text)


def trajectories_to_rollout(rows: list[dict], groups: list[list[Trajectory]], tokenizer) -> Rollout:
    """N = B*G samples: prompts left-padded [N, P], responses right-padded [N, R] with the loss mask's
    holes at observations; per-sample turns, calls, errors, latency and observation tokens [N] for the
    metrics; the trajectory's final answer, turns and calls as columns the rewards may read."""
    flat = [(i, t) for i, g in enumerate(groups) for t in g]
    pad = tokenizer.pad_token_id
    N = len(flat)
    P = max(len(t.prompt_ids) for _, t in flat)
    R = max(1, max(len(t.ids) for _, t in flat))
    prompt = torch.full((N, P), pad, dtype=torch.long)
    prompt_mask = torch.zeros((N, P), dtype=torch.long)
    response = torch.full((N, R), pad, dtype=torch.long)
    tokens = torch.zeros((N, R), dtype=torch.float32)
    loss = torch.zeros((N, R), dtype=torch.float32)
    engine_logp = torch.zeros((N, R), dtype=torch.float32)
    for n, (_, t) in enumerate(flat):
        p, L = t.prompt_ids, len(t.ids)
        prompt[n, P - len(p):] = torch.tensor(p)
        prompt_mask[n, P - len(p):] = 1
        if L:
            response[n, :L] = torch.tensor(t.ids)
            tokens[n, :L] = 1
            loss[n, :L] = torch.tensor(t.loss_mask, dtype=torch.float32)
            engine_logp[n, :L] = torch.tensor(t.logprobs)
    per_sample = lambda f, dtype=torch.float32: torch.tensor([f(t) for _, t in flat], dtype=dtype)  # noqa: E731
    columns = {k: [rows[i].get(k) for i, _ in flat] for k in rows[0] if k != "prompt"}
    columns.update(final_answer=[t.answer for _, t in flat], turns=[t.turns for _, t in flat],
                   tool_calls=[t.tool_calls for _, t in flat])
    return Rollout(
        tensors={"prompt_ids": prompt, "prompt_mask": prompt_mask, "response_ids": response, "response_mask": loss,
                 "response_attention_mask": tokens,
                 "finished": per_sample(lambda t: not t.truncated, torch.bool),
                 "turns": per_sample(lambda t: t.turns), "tool_calls": per_sample(lambda t: len(t.tool_calls)),
                 "tool_errors": per_sample(lambda t: t.tool_errors), "tool_latency_s": per_sample(lambda t: t.tool_latency_s),
                 "observation_tokens": per_sample(lambda t: t.observation_tokens),
                 "observations_truncated": per_sample(lambda t: t.observations_truncated)},
        engine_logp=engine_logp,
        group_ids=torch.tensor([i for i, _ in flat]),
        prompts=[rows[i]["prompt"] for i, _ in flat],
        samples=[tokenizer.decode(t.ids, skip_special_tokens=True) for _, t in flat],
        columns=columns,
    )


def overlong_lengths(rollout_cfg, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | int]:
    """``(lengths [N], max_length)`` for DAPO's overlong penalty of a multi-turn rollout, a length and a
    maximum that count the same tokens. With ``max_total_tokens``, as verl measures them: the whole response
    (observations included: verl's attention mask) against the most the response may hold,
    ``max_total_tokens`` less its prompt ([N]). Without it nothing bounds the observations, so the generated
    tokens (the loss mask) against the generated budget ``max_turns * max_new_tokens`` (counting the
    observations in the length but not in that maximum penalised a response for its tool results). (All
    turns' tokens against one turn's ``max_new_tokens`` reached -11 for a factor of 1.)"""
    if rollout_cfg.max_total_tokens is not None:
        lengths = tensors["response_attention_mask"].sum(-1)  # [N] every response token
        return lengths, rollout_cfg.max_total_tokens - tensors["prompt_mask"].sum(-1)  # [N]
    generated = tensors["response_mask"].sum(-1)  # [N] the sampled tokens only
    return generated, rollout_cfg.max_turns * rollout_cfg.max_new_tokens


def multi_turn_metrics(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """The issue's ``rollout/...`` figures: means per sample, errors as a count, latency per call."""
    calls = tensors["tool_calls"].sum()
    return {
        "rollout/turns_mean": tensors["turns"].mean().item(),
        "rollout/tool_calls_mean": tensors["tool_calls"].mean().item(),
        "rollout/tool_errors": tensors["tool_errors"].sum().item(),
        "rollout/tool_latency_s": (tensors["tool_latency_s"].sum() / calls.clamp_min(1)).item(),
        "rollout/truncated_frac": 1.0 - tensors["finished"].float().mean().item(),
        "rollout/observation_tokens_mean": tensors["observation_tokens"].mean().item(),
        "rollout/observations_truncated": tensors["observations_truncated"].sum().item(),
    }
