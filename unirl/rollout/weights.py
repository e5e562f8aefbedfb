"""The one way the policy's weights reach a rollout engine: ``policy_weights`` gives them as named tensors in
buckets, in the names the engine takes (``Engine.weights_format``): Hugging Face checkpoint names with LoRA
merged in (vLLM, the rollout server; whole via ``hf_checkpoint_weights``, or for an FSDP2-sharded policy
gathered a bucket at a time via ``sharded_checkpoint_weights``), or the policy module's own state names
(the transformers engine's private copy). ``publish`` pushes them into an engine (the synchronous step);
``snapshot`` keeps a copy as a ``WeightVersion`` that a batch source loads into its engine later
(asynchronous rollouts, the rollout server's producer); both iterate the same buckets. ``export_sharded``
writes a sharded policy as a plain model directory from the same buckets."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch



def hf_checkpoint_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under HF checkpoint names (LoRA merged in), for ``VLLMEngine.load_weights``.

    With peft, the adapter is merged for the duration of the copy and unmerged afterwards.
    """
    peft_model = getattr(model, "peft_config", None) is not None
    if peft_model:
        model.merge_adapter()
    try:
        state = model.state_dict()
        out = []
        for name, tensor in state.items():
            if peft_model:
                if "lora_" in name:
                    continue
                name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            # The merged LoRA weights are unmerged below, so the engine needs copies; plain weights are
            # read by the engine before the trainer changes them again (no copy, ~90 MB a step saved
            # on the 22.6M-parameter benchmark model).
            out.append((name, tensor.detach().clone() if peft_model else tensor.detach()))
    finally:
        if peft_model:
            model.unmerge_adapter()
    return iter(out)


def sharded_checkpoint_weights(model: torch.nn.Module, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """An FSDP2-sharded policy's weights under HF checkpoint names, in buckets of about ``bucket_bytes``
    gathered whole one at a time (``unirl.sharding.gathered_state``): every process must iterate to
    the end. With peft, each adapted layer's merged weight ``W + scaling * B @ A`` is formed from its
    gathered pieces (the sharded model itself is not merged and unmerged, so its weights stay bit for
    bit what they were); the adapter's own tensors are not sent."""
    from unirl.sharding import gathered_state

    peft_model = getattr(model, "peft_config", None) is not None
    held: dict[str, torch.Tensor] = {}  # an adapted layer's base weight and lora_A, until its lora_B arrives
    for bucket in gathered_state(model, bucket_bytes):
        out = []
        for name, tensor in bucket:
            if peft_model:
                layer, kind = _lora_part(name)
                if kind is not None:
                    held[f"{layer}.{kind}"] = tensor
                    if kind != "lora_B":
                        continue
                    merged = _merged(model, layer, held.pop(f"{layer}.base"), held.pop(f"{layer}.lora_A"), tensor)
                    name, tensor = f"{layer}.weight", merged
                name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            out.append((name, tensor))
        if out:
            yield out


def _lora_part(name: str) -> tuple[str, str | None]:
    """``(layer, 'base' | 'lora_A' | 'lora_B')`` for an adapted layer's weight, else ``(name, None)``."""
    for marker, kind in ((".lora_A.", "lora_A"), (".lora_B.", "lora_B")):
        if marker in name:
            return name.split(marker)[0], kind
    if name.endswith(".base_layer.weight"):
        return name.removesuffix(".base_layer.weight"), "base"
    return name, None


def _merged(model: torch.nn.Module, layer: str, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """peft's merge of one ``nn.Linear`` LoRA layer (``get_delta_weight``: ``B @ A * scaling``, one adapter)."""
    module = model.get_submodule(layer)
    (adapter,) = module.active_adapters
    if getattr(module, "fan_in_fan_out", False):
        raise ValueError(f"{layer}: a fan_in_fan_out LoRA layer cannot be synced from shards; use trainer.strategy=ddp")
    delta = (b.float() @ a.float()) * module.scaling[adapter]
    return (base.float() + delta).to(base.dtype)


WEIGHT_FORMATS = ("hf_checkpoint", "module_state")


def policy_weights(model: torch.nn.Module, fmt: str, bucket_mb: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The policy's (unwrapped) weights as buckets of named tensors in ``fmt``: ``hf_checkpoint`` (HF names,
    LoRA merged) or ``module_state`` (the module's ``state_dict`` names). A whole model is one bucket; a
    sharded one (FSDP2) is gathered ``bucket_mb`` MB at a time, a collective every process iterates to the end."""
    from unirl.sharding import gathered_state, is_sharded

    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weights format {fmt!r}: an engine takes one of {', '.join(WEIGHT_FORMATS)}")
    if not is_sharded(model):
        if fmt == "hf_checkpoint":
            yield list(hf_checkpoint_weights(model))
        else:
            yield [(name, t.detach()) for name, t in model.state_dict().items()]
        return
    buckets = sharded_checkpoint_weights if fmt == "hf_checkpoint" else gathered_state
    yield from buckets(model, bucket_mb << 20)


def publish(engine, model: torch.nn.Module, bucket_mb: int) -> None:
    """The policy's weights into ``engine`` now (the synchronous step's sync), bucket by bucket, each freed
    once the engine has it; then the engine is woken (vLLM's KV cache comes back after the weights,
    ``rollout.sleep_level``). An engine that samples from the live policy (``shares_policy``) needs none."""
    if not getattr(engine, "shares_policy", False):
        for bucket in policy_weights(model, engine.weights_format, bucket_mb):
            engine.load_weights(bucket)
            del bucket
    engine.wake_up()


class WeightVersion:
    """A copy of the policy's weights in an engine's format, taken after ``optimizer_steps`` optimizer steps,
    for a batch source to load into its engine while the trainer goes on updating."""

    def __init__(self, model: torch.nn.Module, fmt: str, bucket_mb: int, optimizer_steps: int):
        self.format, self.optimizer_steps = fmt, optimizer_steps
        self.buckets = [[(name, t.detach().clone()) for name, t in bucket]
                        for bucket in policy_weights(model, fmt, bucket_mb)]

    def load_into(self, engine) -> None:
        if engine.weights_format != self.format:
            raise ValueError(f"a {self.format} weight version cannot load into an engine taking {engine.weights_format}")
        for bucket in self.buckets:
            engine.load_weights(iter(bucket))
        engine.wake_up()


def export_sharded(model: torch.nn.Module, directory: Path, *, main: bool, bucket_mb: int) -> None:
    """An FSDP2-sharded policy written as a plain Hugging Face directory, piece by piece: the weights
    vLLM would receive (``sharded_checkpoint_weights``: HF names, LoRA merged), gathered one bucket
    at a time and written by the main process (``main``) as ``model-<k>.safetensors`` with
    ``model.safetensors.index.json``, then the config; no process ever holds the whole model. With peft,
    the adapter's own tensors (small) go to ``adapter/`` as peft saves them. Every process must call it."""
    import json

    from safetensors.torch import save_file

    from unirl.sharding import full, resharded

    peft_model = getattr(model, "peft_config", None) is not None
    base = model.get_base_model() if peft_model else model
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    weight_map: dict[str, str] = {}
    total = 0
    for k, bucket in enumerate(sharded_checkpoint_weights(model, bucket_mb << 20)):
        if main:
            # The head tied to the embedding is not written, as save_pretrained leaves it out.
            tensors = {name: t.detach().cpu().contiguous() for name, t in bucket if not (tied and name == "lm_head.weight")}
            file = f"model-{k + 1:05d}.safetensors"
            save_file(tensors, str(directory / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        del bucket
    adapter = {}
    if peft_model:  # gathered on every process (a collective), kept by the main one
        adapter = {name: full(t.detach()).cpu() for name, t in resharded(model).state_dict().items() if "lora_" in name}
    if not main:
        return
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    base.config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    if peft_model:
        model.save_pretrained(directory / "adapter", state_dict=adapter)
