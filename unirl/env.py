"""The small interface between the one training loop and an environment (text, diffusion).

Shape legend used across unirl: B prompts per step, G samples per prompt (the group),
N = B*G samples, T tokens (text) or trained denoising steps (diffusion).

The loop owns the algorithm (advantages, old/reference log-probs, clipped update, KL penalty,
optimizer, logging, checkpoints); the environment owns everything modality-specific: how to
sample, how to reward, and how to compute the log-probability of stored actions under a model.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch


class StateError(ValueError):
    """A checkpoint object's saved state that the object cannot take (its ``load_state_dict`` or
    ``check_resumed`` says what is wrong: the item, the field, what it should hold). The checkpoint module puts
    the file in front, and resume skips that checkpoint with one line (``unirl.trainer.checkpoints``)."""


#: The loop's own per-sample tensors on ``Rollout`` (each None until its stage writes it).
LOOP_FIELDS = ("rewards", "advantages", "returns", "values", "old_logp", "engine_logp", "policy_version", "token_version",
               "teacher_logp")


@dataclass
class Rollout:
    """N sampled trajectories: what the loop's stages write (typed fields) and what the environment
    needs to score them again (``tensors``, its extras). torchtune's ``Trajectory``
    (``torchtune/rlhf/_types.py``) is the model.

    Written by the environment at rollout:

    * ``group_ids`` [N] long: samples with the same id answer the same prompt;
    * ``prompts`` [N], ``samples`` [N] (what the reward sees: strings or PIL images), ``columns``
      (the dataset's fields, name -> [N], passed to rewards as keyword arguments);
    * ``tensors``: the environment's extras, name -> [N, ...] (text: token ids and masks; diffusion:
      latents, sigmas, conditioning; ``score/<name>`` [N]: each reward's scores, for global figures);
    * ``engine_logp`` [N, T]: the sampler's log-probs when it is not the trainer (text's engine);
    * ``old_logp`` [N, T]: the old policy's log-probs, when the sampler's are the policy's own
      (diffusion); otherwise the loop's ``old_logprobs`` stage writes them.

    Written by the loop (``unirl.trainer``):

    * ``policy_version`` [N] long: the optimizer steps of the weights that sampled each sample
      (``Trainer.optimizer_steps`` at rollout time; with ``source.max_staleness`` those of the older
      weights the producer sampled with, ``unirl.rollout.sources``); ``rollout/staleness_*`` reads it;
      with ``token_version``, the oldest of the sample's tokens;
    * ``token_version`` [N, T] long: the optimizer steps of the weights that sampled each token, -1 where
      nothing was sampled (prompt, observations, padding); set where a sample's tokens may come from
      several versions (streamed episodes and agent sessions, ``unirl.rollout.stream``), else None:
      every token then carries its sample's ``policy_version``;
    * ``rewards`` [N]; ``advantages`` [N] (one per sample) or [N, T] (per token);
    * ``values`` [N, T] (the critic's) and ``returns`` [N, T] (its target), with a critic;
    * ``old`` and ``ref``: the old policy's and the reference's ``Environment.score_actions`` outputs,
      name -> [N, T] (``logp``, diffusion's ``mean`` ...), for the KL in the reward and in the loss;
    * ``teacher_logp`` [N, T]: the distillation teacher's log-probs of the sampled tokens
      (``distill.teacher``; ``unirl.core.distill``).

    ``cache`` holds what an environment derives from this batch and reuses between its pieces (e.g.
    device copies scored one column at a time); never selected or copied: ``select`` and
    ``map_tensors`` start an empty one (not an __init__ argument).
    """

    tensors: dict[str, torch.Tensor]
    group_ids: torch.Tensor  # [N] long
    prompts: list[str]  # [N]
    samples: list[Any]  # [N]
    columns: dict[str, list] = field(default_factory=dict)  # name -> [N]
    rewards: torch.Tensor | None = None  # [N]
    advantages: torch.Tensor | None = None  # [N] or [N, T]
    returns: torch.Tensor | None = None  # [N, T]
    values: torch.Tensor | None = None  # [N, T]
    old_logp: torch.Tensor | None = None  # [N, T]
    engine_logp: torch.Tensor | None = None  # [N, T]
    policy_version: torch.Tensor | None = None  # [N] long
    token_version: torch.Tensor | None = None  # [N, T] long
    teacher_logp: torch.Tensor | None = None  # [N, T]
    old: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N, T]
    ref: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N, T]
    cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.prompts)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every per-sample tensor with its name: the extras by theirs, the loop's fields by the field's,
        ``old`` and ``ref`` outputs as ``old/<name>`` and ``ref/<name>``."""
        yield from self.tensors.items()
        for name in LOOP_FIELDS:
            value = getattr(self, name)
            if value is not None:
                yield name, value
        for prefix in ("old", "ref"):
            for name, value in getattr(self, prefix).items():
                yield f"{prefix}/{name}", value

    def map_tensors(self, fn: Callable[[str, torch.Tensor], torch.Tensor], **lists) -> "Rollout":
        """A rollout with ``fn(name, tensor)`` for every per-sample tensor (names as ``named_tensors``);
        ``lists`` replace ``group_ids``, ``prompts``, ``samples`` or ``columns``."""
        fields = {name: fn(name, value) for name, value in self.named_tensors()}
        old = {k[len("old/"):]: v for k, v in fields.items() if k.startswith("old/")}
        ref = {k[len("ref/"):]: v for k, v in fields.items() if k.startswith("ref/")}
        kwargs = dict(tensors={k: fields[k] for k in self.tensors}, group_ids=self.group_ids, prompts=self.prompts,
                      samples=self.samples, columns=self.columns, old=old, ref=ref,
                      **{name: fields.get(name) for name in LOOP_FIELDS})
        return Rollout(**{**kwargs, **lists})

    def select(self, index: torch.Tensor | Sequence[int]) -> "Rollout":
        """Sub-batch by sample indices (used for mini- and micro-batches)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        ids = idx.tolist()
        if ids == list(range(len(self))):  # all of it, in order (one micro-batch): the same tensors, no copy
            return self.map_tensors(lambda name, v: v, prompts=list(self.prompts), samples=list(self.samples),
                                    columns={k: list(v) for k, v in self.columns.items()})
        return self.map_tensors(
            lambda name, v: v[idx.to(v.device)],
            group_ids=self.group_ids[idx.to(self.group_ids.device)],
            prompts=[self.prompts[i] for i in ids],
            samples=[self.samples[i] for i in ids],
            columns={k: [v[i] for i in ids] for k, v in self.columns.items()},
        )


def concat_rollouts(parts: Sequence[Rollout], left_padded: Sequence[str] = ()) -> Rollout:
    """Several rollouts as one (dynamic sampling keeps groups from several generation batches).

    A tensor whose second dim differs between parts (text: prompt and response widths) is padded
    with zeros to the widest: on the left for the names in ``left_padded`` (left-padded prompts), on
    the right for the others; masks are among the tensors, so the padding is masked out. Group ids
    are offset so the parts' groups stay apart."""
    if not parts:
        raise ValueError("concat_rollouts: no rollouts to join")
    named = [dict(p.named_tensors()) for p in parts]

    def joined(name: str, _) -> torch.Tensor:
        values = [n[name] for n in named]
        if values[0].ndim >= 2:
            width = max(v.shape[1] for v in values)
            left = name in left_padded
            values = [torch.nn.functional.pad(v.movedim(1, -1), (width - v.shape[1], 0) if left else (0, width - v.shape[1]))
                      .movedim(-1, 1) for v in values]
        return torch.cat(values)

    ids, offset = [], 0
    for p in parts:
        local = torch.unique(p.group_ids, return_inverse=True)[1]  # [n] 0..k-1
        ids.append(local + offset)
        offset += int(local.max()) + 1 if len(local) else 0
    return parts[0].map_tensors(joined, group_ids=torch.cat(ids), prompts=[x for p in parts for x in p.prompts],
                                samples=[x for p in parts for x in p.samples],
                                columns={k: [x for p in parts for x in p.columns[k]] for k in parts[0].columns})


class Actions:
    """The forward of stored samples, what the update and the log-probs stages call: ``score_actions`` returns
    a dict with at least ``logp`` [N, T] and ``mask`` [N, T] (1 where the step is trained, or None when every
    position is); anything else it returns (e.g. the Gaussian mean for diffusion) is what ``kl`` needs to
    compare a model with the reference, or what the environment's policy loss reads."""

    #: If False the log-probs recorded at sampling time (``rollout.old_logp``) are the policy's own and are
    #: used as the PPO "old" log-probs; if True the loop recomputes them with the trainer (text: the engine's
    #: log-probs differ numerically from the trainer's).
    recompute_old_logprobs: bool = True
    #: The constant length ``seq-mean-token-sum-norm`` divides by (Dr. GRPO; TRL's ``max_completion_length``):
    #: text sets it to ``rollout.max_new_tokens`` so the normaliser does not change with the longest response
    #: of a step. None: the width of the loss mask.
    loss_norm_length: int | None = None
    #: The tensors padded on the left (text: the prompts), for ``concat_rollouts``.
    left_padded: tuple[str, ...] = ()
    #: The registered policy loss (``unirl.core.policy_losses``) these outputs feed, or None for the
    #: algorithm's ratio loss (``clipped``, or ``gspo`` with ``algo.level: sequence``). DiffusionNFT's rollout
    #: keeps clean samples and no log-probs: its loss is ``nft``, which reads the velocities it returns.
    policy_loss: str | None = None

    def score_actions(self, model: torch.nn.Module, batch: Rollout, columns: slice = slice(None)
                      ) -> dict[str, torch.Tensor]:
        """The forward of the stored actions under ``model`` (not held-out evaluation): ``logp`` [n, T],
        ``mask`` [n, T] (or None when every position is trained: the losses then skip the masking), extras
        (what ``kl`` and the policy loss read). ``columns``: only these of the T columns (one of
        ``column_slices``); outputs are [n, T'] then."""
        raise NotImplementedError

    def sampled_outputs(self, batch: Rollout) -> dict[str, torch.Tensor] | None:
        """The policy's own ``score_actions`` outputs for ``batch`` as its sampler kept them, where they equal a
        re-scoring's (the same weights and forward): the old-policy pass of the KL in the reward then runs no
        model. None (the default): the loop re-scores the batch."""
        return None

    def loss_mask(self, batch: Rollout) -> torch.Tensor:
        """[n, T] mask of the trained tokens / steps, without running a model (``score_actions``'s, or all True
        where ``score_actions`` returns None)."""
        raise NotImplementedError

    def kl(self, current: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-step KL penalty [n, T] between the policy's and the reference's ``score_actions`` outputs."""
        raise NotImplementedError

    def column_slices(self, batch: Rollout) -> list[slice]:
        """The pieces of the T columns the update may score and backpropagate one after another, so that
        only one piece's autograd graph is alive at a time. Default: all T at once (text: a sequence is one
        forward). Diffusion: one denoising step a piece, FlowGRPO's order, so memory does not grow with the
        number of trained steps."""
        return [slice(None)]

    def trim_padding(self, batch: Rollout) -> Rollout:
        """``batch`` without the padding none of its samples needs (text: prompts and responses cut to the
        batch's longest), so a micro-batch is padded only to its own longest sample; ``score_actions`` then
        returns [n, T'] with T' <= T and the loop pads back. Default: the batch as is."""
        return batch

    def sample_tokens(self, batch: Rollout) -> torch.Tensor:
        """[n] what a forward spends on each sample (text: prompt + response tokens), by which
        ``trainer.micro_batch_tokens`` packs micro-batches. Default: every sample costs the T columns."""
        n, width = self.loss_mask(batch).shape[:2]
        return torch.full((n,), width, dtype=torch.long)

    def values(self, model: torch.nn.Module, batch: Rollout) -> torch.Tensor:
        """A value model's values [n, T] at the positions ``score_actions``'s log-probs have (PPO's critic)."""
        raise ValueError(f"{type(self).__name__} has no value model (critic): choose an advantage estimator "
                         "that reads no values (algo.adv_estimator)")


class Sampler(Protocol):
    """Sampling: G completions for each of B rows (N = B*G), the weights of the engine it samples with, and the
    figures of a rollout once its old log-probs are known."""

    def rollout(self, rows: list[dict], group_size: int) -> Rollout: ...

    def sync_weights(self) -> None:
        """Push the trainer's weights to the rollout engine (nothing when sampling uses the trainer's model)."""

    def release_memory(self) -> None:
        """After the rollout, before the trainer's passes: free what sampling holds on the device (text:
        vLLM's sleep, ``rollout.sleep_level``); the next ``sync_weights`` brings it back."""

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        """Per-step figures about the rollout (lengths, engine-vs-trainer log-prob gap ...), once
        ``rollout.old_logp`` holds the trainer's log-probs."""


class Scorer(Protocol):
    """Rewards: ``score(rollout)`` -> rewards [N] (float32) and per-component figures (``reward/<name>``)."""

    def score(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, float]]: ...


@dataclass
class Models:
    """The models beside the trained policy: the frozen reference (``reference()`` yields it: a copy, or the
    policy with its LoRA disabled), on-policy distillation's teacher (``teacher()``, text's
    ``distill.teacher``), a new value model for PPO's critic (``value_model(cfg)``), and ``frozen``: the frozen
    copies the backend lays out like the policy (name -> module)."""

    reference: Callable[[], Any]
    teacher: Callable[[], Any] | None = None
    value_model: Callable[[Any], torch.nn.Module] | None = None
    frozen: dict[str, torch.nn.Module] = field(default_factory=dict)


class Environment(ABC):
    """What the loop needs from a modality, as the parts it names (``unirl/text/env.py``,
    ``unirl/diffusion/env.py``): the trained ``model``; ``models`` (reference, teacher, value model);
    ``prompts`` (``unirl.prompts.Prompts``: the rows of each step and the held-out ones); ``sampler``;
    ``scorer``; ``actions`` (the forward of stored samples); held-out ``evaluation``; saving the policy as its
    library loads it; the stateful objects a checkpoint saves; a hook after each optimizer step; ``close``."""

    @abstractmethod
    def setup(self, accelerator) -> None:
        """Load models, tokenizers/pipelines, data and the rewards; build the parts. Called once."""

    @property
    @abstractmethod
    def model(self) -> torch.nn.Module:
        """The trainable module (its trainable parameters go to the optimizer); the trainer replaces it by the
        backend-prepared one (the setter)."""

    @model.setter
    @abstractmethod
    def model(self, module: torch.nn.Module) -> None: ...

    models: Models
    prompts: Any  # unirl.prompts.Prompts
    sampler: Sampler
    scorer: Scorer
    actions: Actions

    def evaluation(self, step: int, run_dir: Path) -> tuple[dict[str, float], dict]:
        """Held-out evaluation (greedy for text, deterministic ODE for diffusion): ``(eval/* figures, media)``,
        media what the trackers show: ``{"images": {key: PIL image}, "tables": {key: (columns, rows)}}``."""
        return {}, {}

    @abstractmethod
    def save_pretrained(self, directory: Path) -> None:
        """Save the policy so the upstream library loads it as is (HF ``save_pretrained``, LoRA ...).

        Called on every process (gathering a sharded model's state dict is collective); only the main
        process writes."""

    def checkpoint_objects(self) -> dict[str, Any]:
        """Extra stateful objects (``state_dict``/``load_state_dict``) saved with checkpoints by name, e.g.
        ``{"ema": ...}``. A ``load_state_dict`` that finds its state damaged raises ``StateError``; an object with
        ``check_resumed(loop_state)`` checks what it took against the checkpoint's ``loop.json`` (the batch
        source does)."""
        return {}

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        """Called after every optimizer step with the number of optimizer steps done so far (1, 2,
        ...), e.g. to update an EMA of the weights on FlowGRPO's schedule."""

    def close(self) -> None:
        """Release engines and worker pools."""


def sharded_state_dict(accelerator, model: torch.nn.Module) -> dict | None:
    """The full state dict of an FSDP-sharded ``model``, gathered from every process (a collective:
    call it on all of them; the main process gets the tensors), or None when the model is whole on
    each process (single process, DDP), where ``save_pretrained`` reads the module itself."""
    from accelerate.utils import DistributedType

    from unirl.sharding import full, is_sharded, resharded

    unwrapped = accelerator.unwrap_model(model)
    if is_sharded(unwrapped):  # trainer.strategy=fsdp2: one tensor gathered at a time, kept by the main process only
        out = {}
        for name, tensor in resharded(unwrapped).state_dict().items():
            whole = full(tensor.detach())
            if accelerator.is_main_process:
                out[name] = whole.cpu()
            del whole
        return out if accelerator.is_main_process else None
    if accelerator.distributed_type != DistributedType.FSDP:
        return None
    return accelerator.get_state_dict(model)


@contextlib.contextmanager
def lora_or_frozen_reference(accelerator, model: torch.nn.Module, frozen: torch.nn.Module | None,
                             lora: bool) -> Iterator[torch.nn.Module]:
    """The reference policy both environments use: with LoRA, the trained model itself with its
    adapter disabled (no second copy in memory); otherwise the frozen copy made at setup."""
    if lora:
        with accelerator.unwrap_model(model).disable_adapter():
            yield model
    else:
        if frozen is None:
            raise RuntimeError("no reference model: algo.kl_coef is 0")
        yield frozen
