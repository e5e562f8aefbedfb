"""Evaluation protocols: which held-out prompts, how many answers to each and how they are sampled, and which
figures are reported, pinned by name so that runs (and papers) can be compared.

A text config evaluates its default set (``data.test``, greedy, logged ``eval/accuracy`` and
``eval/reward/<name>``) and each protocol of ``eval.protocols`` (logged ``eval/<name>/accuracy``,
``eval/<name>/pass@k`` ...), every ``trainer.eval_every`` steps; ``unirl eval`` applies the same ones to a
checkpoint (``unirl/evaluation.py``), through the one held-out path (``unirl/text/held_out.py``).

A protocol is a shipped one by name (``eval.protocols: [gsm8k_verl]``; ``unirl config protocols`` lists
them), a shipped one with keys replaced (``{shipped: tiny_sampled, n: 16}``) or one of your own
(``{name: hard, data: hard.jsonl, n: 8, temperature: 0.6, metrics: [avg@8, pass@8]}``). Every key left
null comes from the shipped protocol, else from the run's config (``data.test``, ``rollout.*``), else the
default its comment gives (``resolve_protocol``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from unirl.config import PATH
from unirl.config.schema import check_range
from unirl.registry import Registry

#: A metric a protocol may ask for beside ``accuracy`` and the rewards: ``avg@K`` (K = n) or ``pass@K`` (K <= n).
METRIC = re.compile(r"^(avg|pass)@([1-9][0-9]*)$")
#: Names a protocol's figures cannot take: they are the default set's own (``eval/reward/<name>`` ...).
RESERVED_NAMES = ("accuracy", "default", "reward", "samples", "tool_calls_mean")


@dataclass
class EvalProtocol:
    """One held-out evaluation (module docstring). A bare string names a shipped protocol."""

    config_shorthand = "shipped"

    #: Its figures' name, ``eval/<name>/...`` (letters, digits, ``_``, ``-``, ``.``); null: the shipped one's.
    name: Optional[str] = None
    #: A shipped protocol (``unirl config protocols``) whose keys this one starts from.
    shipped: Optional[str] = None
    #: The prompts, in ``data.test``'s forms (a file, ``unirl://NAME``, a hub name, ``tiny``); null: the run's
    #: ``data.test`` with its split, hub config, adapter, prompt key and ``eval_size``.
    data: Optional[str] = field(default=None, metadata=PATH)
    #: Split of a hub data set; null: ``test`` (``data.test_split`` when ``data`` is null).
    split: Optional[str] = None
    #: Hub config name; null: none (``data.hub_config`` when ``data`` is null).
    hub_config: Optional[str] = None
    #: How a row becomes a prompt (``data.adapter``'s choices); null: ``data.adapter``.
    adapter: Optional[Literal["gsm8k", "geo3k", "plain"]] = None
    #: The prompt column; null: found (``prompt``, else ``question``), or ``data.prompt_key`` when ``data`` is null.
    prompt_key: Optional[str] = None
    #: The first ``size`` rows; null: all (``data.eval_size`` when ``data`` is null).
    size: Optional[int] = None
    #: Answers per prompt; null: 1.
    n: Optional[int] = None
    #: 0: greedy (verl's validation default: ``val_kwargs.temperature: 0``, ``do_sample: False``); > 0:
    #: sampled at this temperature. null: 0.
    temperature: Optional[float] = None
    #: Nucleus sampling threshold; null: 1 (off).
    top_p: Optional[float] = None
    #: Top-k sampling; null: -1 (off).
    top_k: Optional[int] = None
    #: The sampling seed: the answers are a function of the weights, the prompts and this seed (each
    #: request's own generator), never of the run's random state. null: 0.
    seed: Optional[int] = None
    #: Longest answer (each turn, with tools); null: ``rollout.eval_max_new_tokens``, else ``rollout.max_new_tokens``.
    max_new_tokens: Optional[int] = None
    #: Figures beside ``accuracy``, ``reward`` and ``reward/<name>``: ``avg@K`` (K = n: the mean over all
    #: answers) and ``pass@K`` (K <= n, the unbiased estimator, unirl/core/eval_metrics.py); null: none.
    metrics: Optional[list[str]] = None
    #: A row column: each of its values also gets the figures, as ``eval/<name>/<column>=<value>/...``
    #: (verl groups by ``data_source``); null: none.
    group_by: Optional[str] = None
    #: The reward whose full score (>= 1) makes an answer right for ``accuracy``, ``avg@K`` and ``pass@K``;
    #: null: the first of ``rewards``.
    correct: Optional[str] = None

    def __post_init__(self):
        if self.name is not None and (not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name) or self.name in RESERVED_NAMES):
            raise ValueError(f"name {self.name!r}: a protocol's name is letters, digits, '_', '-' or '.', and not one "
                             f"of {', '.join(RESERVED_NAMES)} (the default set's figures)")
        check_range(self, "size", low=1, optional=True)
        check_range(self, "n", low=1, optional=True)
        check_range(self, "temperature", low=0, optional=True)
        check_range(self, "top_p", low=0, high=1, low_open=True, optional=True)
        check_range(self, "max_new_tokens", low=1, optional=True)
        if self.top_k is not None and self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        for metric in self.metrics or []:
            if not METRIC.match(metric):
                raise ValueError(f"metrics: {metric!r} is not avg@K or pass@K (K a whole number >= 1)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def prefix(self, base: str) -> str:
        """Where its figures go: ``base`` itself for the default set (no name), else ``base<name>/``."""
        return base if self.name is None else f"{base}{self.name}/"


#: The shipped protocols, by name (``unirl config protocols``).
PROTOCOLS: Registry[EvalProtocol] = Registry("evaluation protocol")


def ship(protocol: EvalProtocol) -> EvalProtocol:
    PROTOCOLS.add(protocol.name, protocol)
    return protocol


# The tiny addition task (configs/text/tiny.yaml): its first 100 held-out questions (tiny.yaml's eval_size).
ship(EvalProtocol(name="tiny", data="tiny", adapter="plain", size=100, n=1, temperature=0.0, max_new_tokens=8))
# The same questions, 8 answers each at the training temperature (tiny.yaml's 1.0, group size 8): how often a
# sample is right (avg@8) and how often one of 8 is (pass@8), what GRPO can learn from.
ship(EvalProtocol(name="tiny_sampled", data="tiny", adapter="plain", size=100, n=8, temperature=1.0, top_p=1.0,
                  seed=0, max_new_tokens=8, metrics=["avg@8", "pass@1", "pass@8"]))
# The tiny search task (configs/text/tiny_search.yaml): its 16 held-out names, greedy, with the run's tools.
ship(EvalProtocol(name="tiny_search", data="unirl://tiny_search/test", adapter="plain", n=1, temperature=0.0,
                  max_new_tokens=24))
# The generated arithmetic task of the small real model (configs/text/smollm2_math.yaml, smollm2_judge.yaml): its
# first 100 test questions with verl's GSM8K instruction (the gsm8k adapter), greedy, 64 tokens.
ship(EvalProtocol(name="arithmetic", data="unirl://arithmetic/test?n=200&seed=0&max_operand=9", adapter="gsm8k",
                  prompt_key="question", size=100, n=1, temperature=0.0, max_new_tokens=64))
# The tiny game (configs/text/tiny_game.yaml, an agents environment): its held-out boards, greedy episodes.
ship(EvalProtocol(name="tiny_game", data="unirl://tiny_game/test", adapter="plain", n=1, temperature=0.0,
                  max_new_tokens=4))
# The words walk game (configs/text/smollm2_game.yaml): its held-out start/goal pairs (none trained on), greedy
# episodes of up to 16 tokens a turn.
ship(EvalProtocol(name="walk_words", data="unirl://walk_words/test", adapter="plain", n=1, temperature=0.0,
                  max_new_tokens=16))
# GSM8K as verl validates it (examples/data_preprocess/gsm8k.py: the whole openai/gsm8k "main" test split,
# 1319 questions, with the instruction the gsm8k adapter appends; rollout.val_kwargs: n 1, temperature 0,
# do_sample False, i.e. greedy; the answer as long as training's, data.max_response_length 1024 in
# examples/grpo_trainer/run_qwen2-7b.sh). verl logs val-core/openai/gsm8k/reward/mean@1: the mean of its
# gsm8k score, 1 right and 0 otherwise (format_score 0), which is eval/gsm8k_verl/accuracy here with the
# gsm8k reward (method strict) of configs/text/gsm8k.yaml.
ship(EvalProtocol(name="gsm8k_verl", data="openai/gsm8k", split="test", hub_config="main", adapter="gsm8k",
                  prompt_key="question", n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=1024,
                  metrics=["avg@1"]))
# The same questions sampled (not verl's default, which is greedy): 8 answers each at temperature 1 (the
# training temperature of verl's GSM8K examples), for avg@8 and pass@k.
ship(EvalProtocol(name="gsm8k_sampled", data="openai/gsm8k", split="test", hub_config="main", adapter="gsm8k",
                  prompt_key="question", n=8, temperature=1.0, top_p=1.0, top_k=-1, seed=0, max_new_tokens=1024,
                  metrics=["avg@8", "pass@1", "pass@8"]))


def default_protocol(cfg) -> EvalProtocol:
    """The default set of the text config ``cfg`` (``data.test``, greedy), logged without a name."""
    return resolve_protocol(EvalProtocol(), cfg)


def resolve_protocol(protocol: EvalProtocol, cfg) -> EvalProtocol:
    """``protocol`` with every null key filled: from its shipped protocol, then from ``cfg`` (a text config),
    then the defaults (``EvalProtocol``'s comments); checked as a whole (``ValueError`` naming the protocol)."""
    base = PROTOCOLS.get(protocol.shipped) if protocol.shipped is not None else EvalProtocol()
    given = {f.name: getattr(protocol, f.name) for f in dataclasses.fields(EvalProtocol)}
    merged = {k: v if v is not None else getattr(base, k) for k, v in given.items()}
    merged["shipped"] = protocol.shipped
    data, r = cfg.data, cfg.rollout
    if merged["data"] is None:  # the run's own held-out set, as it reads it
        merged["data"] = data.test
        for key, value in (("split", data.test_split), ("hub_config", data.hub_config), ("adapter", data.adapter),
                           ("prompt_key", data.prompt_key), ("size", data.eval_size)):
            merged[key] = value if merged[key] is None else merged[key]
    defaults = dict(split="test", adapter=data.adapter, n=1, temperature=0.0, top_p=1.0, top_k=-1, seed=0,
                    max_new_tokens=r.eval_max_new_tokens or r.max_new_tokens, metrics=[])
    merged.update({k: v for k, v in defaults.items() if merged[k] is None})
    resolved = EvalProtocol(**merged)
    _check_resolved(resolved, [reward.name for reward in cfg.rewards])
    return resolved


def _check_resolved(p: EvalProtocol, rewards: list[str]) -> None:
    what = f"eval protocol {p.name or '(the default set, data.test)'}"
    if p.data is None:
        raise ValueError(f"{what}: no prompts: set its data (data.test is null)")
    if p.greedy and p.n > 1:
        raise ValueError(f"{what}: n={p.n} greedy answers (temperature 0) are one answer {p.n} times; "
                         f"set a temperature > 0 or n: 1")
    for metric in p.metrics:
        kind, k = METRIC.match(metric).groups()
        if kind == "avg" and int(k) != p.n or kind == "pass" and int(k) > p.n:
            raise ValueError(f"{what}: {metric} needs {'k = n' if kind == 'avg' else 'k <= n'}, n={p.n}")
    if p.correct is not None and p.correct not in rewards:
        raise ValueError(f"{what}: correct={p.correct!r} is not one of the rewards ({', '.join(rewards)})")


def run_protocols(cfg, names: list[str] | None = None) -> list[EvalProtocol]:
    """The protocols a run of ``cfg`` evaluates, resolved: the default set (when ``data.test`` is set), then
    ``eval.protocols`` in order. ``names`` (``unirl eval --protocol``): only these, each the config's own
    protocol of that name, else a shipped one (``default``: the default set)."""
    own = [resolve_protocol(p, cfg) for p in cfg.eval.protocols]
    if names is None:
        return ([default_protocol(cfg)] if cfg.data.test else []) + own
    by_name = {p.name: p for p in own}
    chosen = []
    for name in names:
        if name == "default":
            chosen.append(default_protocol(cfg))
        elif name in by_name:
            chosen.append(by_name[name])
        elif name in PROTOCOLS:
            chosen.append(resolve_protocol(EvalProtocol(shipped=name), cfg))
        else:
            raise ValueError(f"--protocol {name}: neither one of this config's eval.protocols "
                             f"({', '.join(by_name) or 'none'}), 'default', nor a shipped protocol "
                             f"({', '.join(PROTOCOLS)})")
    return chosen


@dataclass
class EvalConfig:
    """Held-out evaluation beyond the default set (``data.test``, greedy): protocols evaluated with it every
    ``trainer.eval_every`` steps and by ``unirl eval``, each logged under its name (docs/evaluation.md)."""

    #: Shipped protocols by name (``unirl config protocols``) or your own (``EvalProtocol``'s keys).
    protocols: list[EvalProtocol] = field(default_factory=list)

    def check(self, cfg) -> None:
        """Every protocol resolves against ``cfg``, and no two share a name."""
        names = []
        for i, protocol in enumerate(self.protocols):
            try:
                resolved = resolve_protocol(protocol, cfg)
            except (KeyError, ValueError) as err:
                raise ValueError(f"eval.protocols[{i}]: {err.args[0]}") from None
            if resolved.name is None:
                raise ValueError(f"eval.protocols[{i}]: give it a name (its figures go to eval/<name>/...)")
            names.append(resolved.name)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"eval.protocols: the name {twice[0]!r} is used twice; figures are logged by name")
