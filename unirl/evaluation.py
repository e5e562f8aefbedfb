"""Scoring a checkpoint on held-out prompts: ``unirl eval`` and ``unirl.evaluate`` (this module is not
named ``evaluate``, so that ``unirl.evaluate`` stays the function once it is imported).

``unirl eval text|diffusion --config NAME --checkpoint DIR [--output-dir D] [--n N] [key=value ...]``.

Text scores a policy without training it: the config's held-out split (``data.test``, ``data.eval_size``)
and rewards, through the config's rollout engine (vLLM; ``rollout.engine=hf`` for transformers).

The summary gives ``reward``, the weighted total of the config's rewards (as a run's
``reward/mean``), and ``reward/<name>``, each reward's mean. With one reward:

* ``--n 1`` (default): greedy answers; ``accuracy`` is the share that get the reward's full score
  (1 for ``gsm8k``), as a run's ``eval/accuracy``.
* ``--n N``: N answers per prompt sampled at ``rollout.temperature``; ``pass@k`` for k = 1 and N (and
  any ``--k``) with the unbiased estimator of Chen et al. 2021 (https://arxiv.org/abs/2107.03374):
  ``1 - C(n - c, k) / C(n, k)`` per prompt with c correct answers, averaged over prompts.

With several rewards no answer is "correct" as a whole, so ``accuracy`` and ``pass@k`` are left out.

``--checkpoint`` takes a run's ``checkpoints/step_N/`` (a full model, LoRA runs save the merged model
there too), a LoRA adapter directory (``adapter_config.json``: merged into ``model.name_or_path``
first), or any model directory or hub name ``from_pretrained`` loads. It writes ``samples.jsonl``
(one line per answer) and ``summary.json`` to the output directory and prints one summary line.

Diffusion samples the held-out prompts with the deterministic ODE sampler (``eval_num_steps``,
``guidance_scale``, fixed seeds, as a run's evaluation) and scores them with the config's rewards.
``--checkpoint`` takes a run's ``checkpoints/step_N/`` (a LoRA in diffusers' format, loaded into
``model.name_or_path`` with ``load_lora_weights``; or a full fine-tune's ``transformer/``) or a
diffusers pipeline directory. It writes ``samples.jsonl`` (prompt and rewards per image),
``grid.png`` and ``summary.json``.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): ``1 - C(n-c, k) / C(n, k)``.

    >>> pass_at_k(4, 0, 1), pass_at_k(4, 4, 2), round(pass_at_k(4, 1, 2), 4)
    (0.0, 1.0, 0.5)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def run_config_file(checkpoint: str | Path) -> Path | None:
    """The saved ``config.yaml`` of the run a checkpoint lies in (``RUN/checkpoints/step_N`` -> ``RUN/config.yaml``)."""
    path = Path(checkpoint).expanduser()
    for run in (path.parent.parent, path.parent.parent.parent):  # step_N/, or step_N/adapter/
        if path.is_dir() and (run / "checkpoints").is_dir() and path.resolve().is_relative_to((run / "checkpoints").resolve()):
            return run / "config.yaml" if (run / "config.yaml").is_file() else None
    return None


def choose_config(checkpoint: str | Path, config, use_run_config: bool = True, default: str | None = None) -> tuple[object, str]:
    """``(config, which)``: the config to score with and a line saying which it is. A checkpoint of a
    run is scored with that run's saved config (its rewards, test split and prompt format) unless
    ``use_run_config`` is False or ``config`` is a mapping or config object (scoring a run trained on
    one reward with a config naming another reported that other: ``reward/gsm8k 0.0``); otherwise
    ``config``, or ``default`` when it is None."""
    saved = run_config_file(checkpoint)
    if saved is not None and use_run_config and (config is None or isinstance(config, (str, Path))):
        same = config is not None and Path(config).is_file() and Path(config).resolve() == Path(saved).resolve()
        instead = "" if config is None or same else f"; not {config}: --no-run-config (run_config=False) scores with that"
        return str(saved), f"config: {saved} (the run's saved config{instead})"
    config = default if config is None else config
    if config is None:
        raise ValueError(f"--checkpoint {checkpoint} is not in a run directory with a saved config.yaml: "
                         f"give --config")
    return config, f"config: {config}" if isinstance(config, (str, Path)) else "config: the one given"


def check_checkpoint_path(checkpoint: str) -> Path | None:
    """The checkpoint's path when it is one on disk; None for a hub name (``org/name`` or ``name``). A
    path that does not exist (absolute, relative with a folder in it, ``~`` or ``.``) is one error, not
    the hub's "Repo id must be ..." or a failed connection."""
    path = Path(checkpoint).expanduser()
    if path.exists():
        check_safetensors(path)
        return path
    hub_like = not checkpoint.startswith(("/", ".", "~")) and checkpoint.count("/") <= 1 and not checkpoint.endswith("/")
    if hub_like:
        return None
    raise FileNotFoundError(f"--checkpoint {checkpoint} does not exist")


def check_safetensors(path: Path) -> None:
    """Each ``.safetensors`` file of a checkpoint (the directory, its subdirectories one level down, or
    the file) holds the bytes its header promises; a truncated or garbled one is named, before a
    library fails on it with a traceback. Reads the headers only."""
    files = [path] if path.is_file() else [*path.glob("*.safetensors"), *path.glob("*/*.safetensors")]
    for file in files:
        if file.suffix != ".safetensors":
            continue
        size = file.stat().st_size
        try:
            with open(file, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                if not 2 <= length <= size - 8:
                    raise ValueError(f"header of {length} bytes")
                header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise ValueError(f"checkpoint file {file} is not a readable safetensors file ({err})") from None
        if 8 + length + end > size:
            raise ValueError(f"checkpoint file {file} is truncated: {size} bytes, its header needs {8 + length + end}")


def resolve_text_checkpoint(checkpoint: str, base: str, work: Path) -> str:
    """A directory vLLM and transformers load: a LoRA adapter is merged into ``base`` (in ``work``); a
    named model (``unirl models list``) is its prepared directory."""
    from unirl.models.named import MODELS, resolve

    if checkpoint in MODELS:
        return resolve(checkpoint)
    path = check_checkpoint_path(checkpoint)
    if path is None:
        return checkpoint  # a hub name: from_pretrained resolves it (or says it cannot)
    if (path / "config.json").exists():
        return str(path)
    adapter = path if (path / "adapter_config.json").exists() else path / "adapter"
    if not (adapter / "adapter_config.json").exists():
        raise FileNotFoundError(
            f"--checkpoint {checkpoint}: neither a model directory (config.json) nor a LoRA adapter "
            f"(adapter_config.json); a run's checkpoints/step_N/ directory is both")
    from peft import AutoPeftModelForCausalLM, PeftConfig, PeftModel
    from transformers import AutoTokenizer

    from unirl.text.env import resolve_model_path
    from unirl.text.vlm import vlm_model

    base_path = resolve_model_path(base)
    if vlm_model(base_path):  # the adapter's base loads with the image-text class, and the processor comes along
        from transformers import AutoModelForImageTextToText

        from unirl.text.vlm import VLMProcessor

        model = AutoModelForImageTextToText.from_pretrained(PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path)
        merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        VLMProcessor.from_pretrained(base_path).save_files(base_path, work)
    else:
        merged = AutoPeftModelForCausalLM.from_pretrained(str(adapter)).merge_and_unload()
    merged.save_pretrained(work, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_path).save_pretrained(work)
    return str(work)


def evaluate_text(cfg, checkpoint: str, output_dir: str | Path, n: int = 1, ks: list[int] | None = None) -> dict:
    """Score ``checkpoint`` on ``cfg``'s held-out prompts; returns the summary (also written to disk).
    A LoRA checkpoint is merged into a temporary directory, removed when done. The answers come from the
    path the run's own evaluation takes (``unirl.text.held_out``: the environment's engine and tools)."""
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    if any(k > n for k in ks or []):
        raise ValueError(f"--k {max(ks)} is larger than --n {n}")
    if not cfg.data.test:
        raise ValueError("data.test is null: this config has no held-out prompts to evaluate on")
    from unirl.text import held_out

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="unirl-eval-") as work:
        env = _text_environment(cfg, checkpoint, Path(work), n)  # 1. the policy's engine, tokenizer, held-out rows
        try:
            rows = env.test_rows
            answers = held_out.answer(env, rows, n=n, greedy=n == 1)  # 2. greedy for n = 1, sampled otherwise
        finally:
            env.close()
    # 3. Scores, per answer and per prompt.
    texts, flat_rows, comps, judged, total = _score_answers(cfg, rows, answers)
    flat = [a for per_prompt in answers for a in per_prompt]
    # accuracy and pass@k count an answer correct when it gets the reward's full score (1 for gsm8k);
    # with several rewards there is no one "correct", so only the weighted total and each reward are given.
    correct = (next(iter(comps.values())) >= 1.0).view(len(rows), n) if len(comps) == 1 else None  # [prompts, n]
    pictures = _save_pictures(out, rows)  # a VLM's held-out pictures, written beside the answers
    records = []
    with open(out / "samples.jsonl", "w") as f:
        for i, (row, text) in enumerate(zip(flat_rows, texts)):
            records.append({"index": i // n, "prompt": row["prompt"], **({"images": pictures[i // n]} if pictures else {}),
                            "response": text, "reward": float(total[i]),
                            **{f"reward/{k}": float(v[i]) for k, v in comps.items()},
                            **{f"judge/{k}": v[i] for k, v in judged.items()},
                            **({"correct": bool(correct.view(-1)[i])} if correct is not None else {}),
                            **({"tool_calls": flat[i].tool_calls, "tool_errors": flat[i].tool_errors}
                               if flat[i].tool_calls is not None else {})})
            f.write(json.dumps(records[-1]) + "\n")
    if pictures:
        from unirl.text.vlm import samples_markdown

        (out / "samples.md").write_text(samples_markdown(records, rows))
    summary = {"checkpoint": str(checkpoint), "prompts": len(rows), "n": n, "reward": total.mean().item(),
               **{f"reward/{k}": v.nanmean().item() for k, v in comps.items()}}
    if correct is not None:
        for k in sorted({1, n, *(ks or [])}):
            summary[f"pass@{k}"] = sum(pass_at_k(n, int(c), k) for c in correct.sum(-1)) / max(1, len(rows))
        summary["accuracy"] = correct.float().mean().item()
    if flat and flat[0].tool_calls is not None:
        summary["tool_calls_mean"] = sum(a.tool_calls for a in flat) / len(flat)
    summary["seconds"] = round(time.perf_counter() - start, 2)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _save_pictures(out: Path, rows: list[dict]) -> list[list[str]] | None:
    """Each held-out row's images as ``out/images/<row>_<k>.png`` (paths relative to ``out``), or None when
    no row has any (a text policy)."""
    from unirl.text.vlm import IMAGES_KEY, save_images

    if not any(row.get(IMAGES_KEY) for row in rows):
        return None
    return [[f"images/{name}" for name in save_images(row.get(IMAGES_KEY) or [], out / "images", f"{i:04d}")]
            for i, row in enumerate(rows)]


def _text_environment(cfg, checkpoint: str, work: Path, n: int):
    """The config's text environment set up for evaluation only (``TextEnvironment.setup_evaluation``): the
    checkpoint's tokenizer, the held-out rows, the config's engine over the checkpoint, the run's tools."""
    from accelerate import Accelerator

    from unirl.rollout.engines import engine_loads_weights
    from unirl.text import build_environment

    env = build_environment(cfg)  # a VLMEnvironment for a vision-language model (unirl/text/vlm_env.py)
    # An engine that loads the model directory itself (vLLM) leaves the device to itself.
    accelerator = Accelerator(cpu=True) if engine_loads_weights(env.engine_name) else Accelerator()
    env.setup_evaluation(accelerator, resolve_text_checkpoint(checkpoint, cfg.model.name_or_path, work),
                         answers_per_prompt=n)
    return env


def _score_answers(cfg, rows: list[dict], answers: list) -> tuple:
    """``(texts, their rows, each reward's scores, a judge reward's answers, the weighted total)``, one per answer."""
    import torch

    from unirl.reward_set import RewardSet
    from unirl.text import held_out

    # The weighted sum of the raw rewards (normalize_then_sum's group normalisation is for advantages).
    rewards = RewardSet(cfg.rewards, aggregation="sum_then_normalize")
    try:
        flat_rows, texts, comps, judged = held_out.score(rewards, rows, answers)
        total, _ = rewards.combine(comps, torch.arange(len(texts)))  # [answers], each in a group of its own
    finally:
        rewards.close()
    return texts, flat_rows, comps, judged, total


def evaluate_diffusion(cfg, checkpoint: str, output_dir: str | Path) -> dict:
    """Sample and score ``checkpoint`` on ``cfg``'s held-out prompts; returns the summary (also on disk)."""
    import torch

    from unirl.diffusion.frames import write_grid

    if not cfg.data.test:
        raise ValueError("data.test is null: this config has no held-out prompts to evaluate on")
    path = check_checkpoint_path(checkpoint)
    kind = _diffusion_checkpoint_kind(checkpoint, path)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    base = {"pipeline": str(path), "hub": checkpoint}.get(kind, cfg.model.name_or_path)
    env = _diffusion_env(cfg, base)
    try:
        _load_diffusion_weights(env, path, kind)  # 2. the checkpoint's weights
        # 3. Images and scores.
        prompts = [row["prompt"] for row in env.test_rows]
        with torch.no_grad():
            images = env.sample_deterministic(env.test_rows)
        columns = {c: [row.get(c) for row in env.test_rows] for c in env.test_rows[0] if c != "prompt"}
        judged: dict[str, list[str]] = {}  # a judge reward's answers, by reward
        comps = env.rewards.components(images, prompts=prompts, columns=columns, texts=judged)
        total, _ = env.rewards.combine(comps, torch.arange(len(prompts)))
    finally:
        env.close()
    with open(out / "samples.jsonl", "w") as f:
        for i, prompt in enumerate(prompts):
            f.write(json.dumps({"index": i, "prompt": prompt, "reward": float(total[i]),
                                **{f"reward/{k}": float(v[i]) for k, v in comps.items()},
                                **{f"judge/{k}": v[i] for k, v in judged.items()}}) + "\n")
    k = cfg.data.grid_size
    captions = [f"{p}\n" + " ".join(f"{name}={float(v[i]):.3f}" for name, v in comps.items()) for i, p in enumerate(prompts[:k])]
    write_grid(images[:k], captions, out / "grid.png", fps=cfg.video.fps)  # videos: also grid.gif
    summary = {"checkpoint": str(checkpoint), "prompts": len(prompts), "n": 1, "reward": total.mean().item(),
               **{f"reward/{name}": v.nanmean().item() for name, v in comps.items()},
               "seconds": round(time.perf_counter() - start, 2)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _diffusion_checkpoint_kind(checkpoint: str, path: Path | None) -> str:
    """``lora`` (diffusers' LoRA file), ``full`` (a fine-tuned ``transformer/``), ``pipeline`` (a
    diffusers pipeline directory) or ``hub`` (a name to download)."""
    if path is None:
        return "hub"
    if path.is_dir() and any(path.glob("pytorch_lora_weights.*")):
        return "lora"
    if path.is_dir() and (path / "model_index.json").exists():
        return "pipeline"
    if path.is_dir() and (path / "transformer" / "config.json").exists():
        return "full"
    raise FileNotFoundError(
        f"--checkpoint {checkpoint}: neither a LoRA (pytorch_lora_weights.safetensors), a fine-tuned "
        f"transformer (transformer/config.json) nor a diffusers pipeline (model_index.json)")


def _diffusion_env(cfg, name_or_path: str):
    """1. The base pipeline without an adapter of its own, no EMA, no reference, inline scoring."""
    import dataclasses

    from accelerate import Accelerator

    from unirl.diffusion.env import DiffusionEnvironment

    model = dataclasses.replace(cfg.model, lora=dataclasses.replace(cfg.model.lora, enabled=False),
                                name_or_path=str(name_or_path))
    cfg = dataclasses.replace(cfg, model=model, ema=dataclasses.replace(cfg.ema, enabled=False),
                              algo=dataclasses.replace(cfg.algo, kl_coef=0.0),
                              trainer=dataclasses.replace(cfg.trainer, reward_workers=0))
    env = DiffusionEnvironment(cfg)
    env.setup(Accelerator())
    return env


def _load_diffusion_weights(env, path: Path | None, kind: str) -> None:
    """A LoRA into ``pipe.transformer`` (the module the environment samples with), or a fine-tuned
    transformer in its place; a pipeline or hub checkpoint is already the base."""
    if kind == "lora":
        from diffusers.utils import logging as diffusers_logging

        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # "no LoRA keys for the text encoders": there are none
        try:
            env.pipe.load_lora_weights(str(path))
        finally:
            diffusers_logging.set_verbosity(verbosity)
    elif kind == "full":
        transformer = type(env.pipe.transformer).from_pretrained(path / "transformer", dtype=env.pipe.transformer.dtype)
        env.pipe.transformer = env.model = transformer.to(env.accelerator.device).eval()


def summary_line(summary: dict) -> str:
    parts = [f"{summary['prompts']} prompts x {summary['n']}"]
    parts += [f"{k} {summary[k]:.4f}" for k in ("accuracy", "reward") if k in summary]
    parts += [f"{k} {v:.4f}" for k, v in summary.items() if k.startswith("pass@")]
    parts += [f"{k} {v:.4f}" for k, v in summary.items() if k.startswith("reward/")]
    parts += [f"tool calls per answer {summary['tool_calls_mean']:.2f}"] if "tool_calls_mean" in summary else []
    return f"eval {summary['checkpoint']}: " + ", ".join(parts) + f" ({summary['seconds']:.1f} s)"
