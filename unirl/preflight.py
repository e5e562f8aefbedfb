"""What can be checked about a run before any model loads, offline: ``unirl train ... --dry-run``.

``preflight(cfg, env_name, config_file)`` returns a ``Report`` listing every problem at once (each
names its field), notes (not errors: a hub name missing from the local cache, a remote reward not
contacted) and what passed:

1. data: every data file exists (a relative path is looked for from the working directory, then
   beside the config file; the error names every place) and its rows parse in the environment's
   format (the same loaders a run uses); generated and bundled ``unirl://`` sources resolve; a hub
   dataset is looked for in the local cache;
2. rewards: every spec resolves (a ``file.py:function`` file exists and has the function, a
   registered name is known, a missing optional package is named) and its kwargs are parameters;
3. batch arithmetic (samples per step, optimizer steps, micro-batches);
4. the output directory can be written and holds no earlier run unless ``trainer.resume`` (nothing is created);
5. the model: a local directory, a toy model built at start-up, or a hub name in the local cache.

A real run calls it too, before loading anything, and stops on a problem (``PreflightError``).
Not checked here: model downloads, GPU memory and speed, reward model weights (loaded on first use),
and whether hub or ``http://`` reward servers can be reached.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from unirl.config import ConfigError
from unirl.data.paths import generated_prompts, is_generated, is_scheme, locate, makes_rows
from unirl.models.named import MODELS

#: What the dry run leaves to the run itself.
NOT_CHECKED = (
    "model downloads and weights", "GPU memory and speed", "reward model weights (loaded on first use)",
    "network access to the hub and to http:// rewards",
)
#: The kind of samples each environment's rewards score.
SAMPLE_MODALITY = {"text": "text", "diffusion": "image"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TEXT_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class PreflightError(ConfigError):
    """Problems found before a run loads anything; ``problems`` lists them, each naming its field."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{len(problems)} problem(s) before loading anything:\n" + "\n".join(f"  {p}" for p in problems))


@dataclass
class Report:
    """The preflight's findings, one line each, in the order checked."""

    passed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    not_checked: tuple[str, ...] = NOT_CHECKED

    def format(self) -> str:
        """The report as YAML comment lines (so the dry run's stdout stays valid YAML)."""
        lines = ["# unirl preflight (offline checks)"]
        lines += [f"# ok      {line}" for line in self.passed]
        lines += [f"# note    {line}" for line in self.notes]
        lines += [f"# PROBLEM {line}" for line in self.problems]
        lines.append(f"# not checked: {', '.join(self.not_checked)}")
        return "\n".join(lines) + "\n"


def preflight(cfg: Any, env_name: str, config_file: str | Path | None = None) -> Report:
    """Check what can be checked offline about ``cfg`` (an environment's config) without loading models."""
    report = Report()
    config_dir = Path(config_file).expanduser().resolve().parent if config_file is not None else None
    # 1. Data (the environment's own format), 2. rewards, 3. batch, 4. output, 5. model and GPU.
    DATA_CHECKS[env_name](cfg, config_dir, report)
    _check_rewards(cfg, SAMPLE_MODALITY[env_name], config_dir, report)
    if getattr(getattr(cfg, "rollout", None), "tools", None):
        _check_tools(cfg.rollout.tools, config_dir, report)
        _check_call_format(cfg.rollout.call_format, config_dir, report, cfg.rollout.tools)
    _check_batch(cfg, report)
    _check_output_dir(cfg.output_dir, report, resume=cfg.trainer.resume)
    _check_model(cfg.model.name_or_path, report)
    _check_gpu(cfg, report)
    known_estimator = _check_adv_estimator(cfg.algo.adv_estimator, report)
    critic = getattr(cfg, "critic", None)
    if known_estimator and critic is not None and critic.name_or_path and _trains_a_critic(cfg.algo.adv_estimator):
        _check_model(critic.name_or_path, report, what="critic.name_or_path")
    teacher = getattr(getattr(cfg, "distill", None), "teacher", None)
    if teacher:
        _check_model(teacher, report, what="distill.teacher")
    return report


# ----------------------------------------------------------------------------------------------
# 1. Data
# ----------------------------------------------------------------------------------------------


def _diffusion_data(cfg: Any, config_dir: Path | None, report: Report) -> None:
    """Prompt files: ``tiny``, ``unirl://`` (bundled or generated), ``.txt`` or ``.jsonl``; for a model family
    that takes an input image per prompt, every row's ``image`` file too."""
    from unirl.diffusion.families import FAMILIES

    image = FAMILIES.get(cfg.model.family).conditioning_image
    for split in ("train", "test"):
        what, source = f"data.{split}", getattr(cfg.data, split)
        if source is None:
            report.notes.append(f"{what}: null, so no evaluation")
            continue
        if source == "tiny" and image:
            report.problems.append(f"{what}: tiny has no input images, which model.family={cfg.model.family!r} takes; "
                                   f"give a .jsonl whose rows name an 'image' file")
            continue
        if source == "tiny":
            report.passed.append(f"{what}: tiny (prompts built in code)")
            continue
        rows = _load(what, source, config_dir, report, _diffusion_rows(split, image))
        if rows is not None:
            report.passed.append(f"{what}: {source} -> {len(rows)} prompts (first: {_short(rows[0]['prompt'])})")
            _check_sizes(cfg, split, len(rows), report)


def _diffusion_rows(split: str, image: bool) -> Callable[[str], list[dict]]:
    def load(path: str) -> list[dict]:
        from unirl.diffusion.prompts import load_prompt_rows

        return load_prompt_rows(path, split, image=image)

    return load


def _text_data(cfg: Any, config_dir: Path | None, report: Report) -> None:
    """Rows from a ``.jsonl``/``.json``/``.parquet`` file, a hub dataset, or ``tiny``; every row must
    become a prompt with the configured adapter (a bad one is named ``file:line``)."""
    from unirl.text.data import load_rows, to_prompt_rows

    data = cfg.data
    for split, hub_split in (("train", data.train_split), ("test", data.test_split)):
        what, source = f"data.{split}", getattr(data, split)
        if source is None:
            report.notes.append(f"{what}: null, so no evaluation")
            continue
        if source == "tiny":
            if cfg.model.name_or_path in ("tiny", "tiny_vlm"):
                report.passed.append(f"{what}: tiny (the {cfg.model.name_or_path} model's task, built with it at start-up)")
            else:
                report.problems.append(f"{what}: 'tiny' needs model.name_or_path: tiny (the task ships with the tiny model)")
            continue
        looks_like_file = is_scheme(source) or source.endswith(_TEXT_FILE_SUFFIXES) or locate(source, config_dir).path
        if not looks_like_file:
            _check_hub(what, source, "dataset", report, extra=f" (config {data.hub_config}, split {hub_split})")
            continue

        def load(path: str) -> list[dict]:
            rows = load_rows(path)
            if not rows:
                raise ValueError(f"{path}: no rows")
            to_prompt_rows(rows, adapter=data.adapter, prompt_key=data.prompt_key, source=path)  # every row
            return rows

        rows = _load(what, source, config_dir, report, load)
        if rows is not None:
            report.passed.append(f"{what}: {source} -> {len(rows)} rows; the first ones parse with adapter {data.adapter}")
            _check_sizes(cfg, split, len(rows), report)


def _load(what: str, source: str, config_dir: Path | None, report: Report, load: Callable[[str], list]) -> list | None:
    """``load`` the file (or generated source) ``source`` names; a problem naming ``what`` when it cannot."""
    if is_generated(source):
        try:
            return load(source) if makes_rows(source) else [{"prompt": p} for p in generated_prompts(source)]
        except ValueError as err:
            report.problems.append(f"{what}: {err}")
            return None
    located = locate(source, config_dir)
    if located.path is None:
        report.problems.append(located.message(what))
        return None
    try:
        rows = load(str(located.path))
    except (ValueError, KeyError, OSError) as err:
        report.problems.append(f"{what}: {source}: {err}")
        return None
    if not rows:
        report.problems.append(f"{what}: {source} has no prompts")
        return None
    return rows


def _check_sizes(cfg: Any, split: str, n: int, report: Report) -> None:
    if split == "train" and n < cfg.trainer.prompts_per_step:
        report.notes.append(f"data.train: {n} prompts < trainer.prompts_per_step={cfg.trainer.prompts_per_step}: "
                            "a step repeats prompts")
    eval_size = getattr(cfg.data, "eval_size", None)
    if split == "test" and eval_size is not None and eval_size > n:
        report.notes.append(f"data.eval_size={eval_size} > the {n} test rows: evaluation uses all {n}")


# ----------------------------------------------------------------------------------------------
# 2. Rewards
# ----------------------------------------------------------------------------------------------


def _check_rewards(cfg: Any, modality: str, config_dir: Path | None, report: Report) -> None:
    from unirl.rewards import RewardError, load_reward, reward_info

    ok = True
    for i, reward in enumerate(cfg.rewards):
        what, spec = f"rewards[{i}].name", reward.name
        if spec.startswith(("http://", "https://")):
            report.notes.append(f"{what}: {spec} is a remote reward; the server is not contacted by the dry run")
            continue
        where, sep, attr = spec.rpartition(":")
        if sep and (where.endswith(".py") or "/" in where):
            located = locate(where, config_dir)
            if located.path is None:
                report.problems.append(located.message(f"{what} (reward file)"))
                ok = False
                continue
            spec = f"{located.path}:{attr}"
        try:
            load_reward(spec, **reward.kwargs)
        except RewardError as err:
            report.problems.append(f"{what}: {err}")
            ok = False
            continue
        if ":" not in spec:
            info = reward_info(spec)
            report.passed.append(f"{what}: {spec} ({info.modality} reward, {info.source})")
            if info.modality != modality:
                report.notes.append(f"{what}: {spec} is registered as a {info.modality} reward; this run's samples are {modality}s")
        else:
            report.passed.append(f"{what}: {reward.name} resolves")
    if ok:  # the checks a run makes over the whole list (duplicate names, weights)
        from unirl.reward_set import RewardSet

        try:
            names = RewardSet(cfg.rewards, aggregation=cfg.algo.reward_aggregation, eps=cfg.algo.adv_eps).names
        except (ValueError, RewardError) as err:
            report.problems.append(str(err) if str(err).startswith("rewards:") else f"rewards: {err}")
        else:
            _check_filter_metric(cfg, names, report)


def _check_filter_metric(cfg: Any, names: list[str], report: Report) -> None:
    """Dynamic sampling's metric must be one of the run's raw reward components."""
    groups = cfg.algo.filter_groups
    if groups.enabled and groups.metric not in names:
        report.problems.append(f"algo.filter_groups.metric: {groups.metric!r} is not a reward of this run "
                               f"(its raw components: {names})")
    elif groups.enabled:
        report.passed.append(f"algo.filter_groups.metric: {groups.metric} is a raw reward component")


def _check_tools(tools: list, config_dir: Path | None, report: Report) -> None:
    """``rollout.tools``: each spec resolves and its kwargs fit, as for rewards; a tool class is not
    built (a search index over a large corpus takes a while) but its ``check(**kwargs)`` runs when it
    has one (the search tool's: the corpus file exists)."""
    import inspect

    from unirl.plugins import check_kwargs
    from unirl.tools import ToolError, resolve_tool

    for i, tool in enumerate(tools):
        what, spec = f"rollout.tools[{i}].name", tool.name
        if spec.startswith(("http://", "https://")):
            report.notes.append(f"{what}: {spec} is a served tool; the server is not contacted by the dry run")
            continue
        where, sep, attr = spec.rpartition(":")
        if sep and (where.endswith(".py") or "/" in where):
            located = locate(where, config_dir)
            if located.path is None:
                report.problems.append(located.message(f"{what} (tool file)"))
                continue
            spec = f"{located.path}:{attr}"
        try:
            obj = resolve_tool(spec)
            check_kwargs(spec, obj, tool.kwargs, kind="tool", error=ToolError, skip_first=inspect.isclass(obj))
            if hasattr(obj, "check"):
                obj.check(**tool.kwargs)
        except (ToolError, TypeError) as err:
            report.problems.append(f"{what}: {err}")
            continue
        report.passed.append(f"{what}: {tool.name} resolves")


def _check_call_format(spec: str, config_dir: Path | None, report: Report, tools: list = ()) -> None:
    """``rollout.call_format``: a registered format, or a file's or module's ``CallFormat`` subclass,
    that can call each tool of ``rollout.tools`` (a served tool's name is the server's: not checked)."""
    from unirl.tools import ToolError, tool_name
    from unirl.tools.formats import check_callable, resolve_call_format

    where, sep, attr = spec.rpartition(":")
    if sep and (where.endswith(".py") or "/" in where):
        located = locate(where, config_dir)
        if located.path is None:
            report.problems.append(located.message("rollout.call_format (format file)"))
            return
        spec = f"{located.path}:{attr}"
    try:
        check_callable(resolve_call_format(spec), [tool_name(t.name) for t in tools
                                                   if not t.name.startswith(("http://", "https://"))], spec)
    except ToolError as err:
        report.problems.append(str(err))
        return
    report.passed.append(f"rollout.call_format: {spec} resolves")


# ----------------------------------------------------------------------------------------------
# 3.-5. Batch, output directory, model
# ----------------------------------------------------------------------------------------------


def _check_batch(cfg: Any, report: Report) -> None:
    """The loaded config already enforces divisibility; this states the arithmetic it implies."""
    t = cfg.trainer
    n = t.prompts_per_step * t.group_size
    report.passed.append(
        f"trainer: {t.prompts_per_step} prompts x {t.group_size} samples = {n} samples per step and process; "
        f"{n // t.mini_batch_size * t.ppo_epochs} optimizer step(s) of {t.mini_batch_size}, "
        f"{t.mini_batch_size // t.micro_batch_size} micro-batch(es) of {t.micro_batch_size} each"
    )


def _check_output_dir(output_dir: str, report: Report, resume: bool = False) -> None:
    path = Path(output_dir).expanduser().absolute()
    if path.exists():
        if not path.is_dir():
            report.problems.append(f"output_dir: {path} exists and is not a directory")
        elif not os.access(path, os.W_OK | os.X_OK):
            report.problems.append(f"output_dir: {path} is not writable")
        elif existing_run_problem(output_dir, resume):
            report.problems.append(existing_run_problem(output_dir, resume))
        elif (path / "metrics.jsonl").exists():
            report.passed.append(f"output_dir: {path} holds a run that trainer.resume=true continues")
        else:
            report.passed.append(f"output_dir: {path} exists and is writable")
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        report.problems.append(f"output_dir: {path} cannot be created: {parent} is not a writable directory")
    else:
        report.passed.append(f"output_dir: {path} can be created")


def existing_run_problem(output_dir: str, resume: bool) -> str | None:
    """What the loop refuses (``Trainer._guard_run_dir``): a directory holding a run, without ``trainer.resume``."""
    path = Path(output_dir).expanduser().absolute()
    if resume or not (path / "metrics.jsonl").exists():
        return None
    return (f"output_dir: {path} already holds a run (metrics.jsonl); pass trainer.resume=true to continue it, "
            f"--new-run (unirl.train(..., new_run=True)) for a fresh directory beside it, or another --output-dir")


def _check_adv_estimator(name: str, report: Report) -> bool:
    """A config built in code (``unirl.train(config=...)``) may set a name the loader never saw."""
    from unirl.config.schema import check_adv_estimator

    try:
        check_adv_estimator(name)
    except ValueError as err:
        report.problems.append(f"algo.{err}")
        return False
    return True


def _trains_a_critic(adv_estimator: str) -> bool:
    from unirl.core import ADVANTAGE_ESTIMATORS  # the loop's own test (Trainer._build_critic)

    return bool(getattr(ADVANTAGE_ESTIMATORS.get(adv_estimator), "reads_values", False))


def _check_model(name: str, report: Report, what: str = "model.name_or_path") -> None:
    if Path(name).expanduser().is_dir():
        report.passed.append(f"{what}: {name} is a local directory")
    elif name in ("tiny", "tiny_search", "tiny_game", "tiny_teacher", "tiny_vlm") or name.startswith("tiny-"):
        report.passed.append(f"{what}: {name} (a toy model built locally at start-up, cached under $UNIRL_CACHE)")
    elif name in MODELS:
        _check_named_model(what, name, report)
    elif _HUB_ID.match(name):
        _check_hub(what, name, "model", report)
    else:
        report.problems.append(f"{what}: {name!r} is neither a local directory, a toy model name nor a hub name (org/name)")


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (torch is imported, no model is loaded)."""
    import torch

    return torch.cuda.is_available()


def _check_gpu(cfg: Any, report: Report) -> None:
    """Half-precision settings are written for a GPU: without one the run trains on the CPU, slowly (a
    note); flash-attn's kernels run on CUDA only (a problem). torch is asked only when one is set."""
    flash = getattr(cfg.model, "attn_implementation", None) == "flash_attention_2"
    half = [f"{key}={value}" for key, value in (("model.dtype", getattr(cfg.model, "dtype", None)),
                                                ("trainer.mixed_precision", cfg.trainer.mixed_precision),
                                                ("rollout.dtype", getattr(getattr(cfg, "rollout", None), "dtype", None)))
            if value in ("bf16", "fp16", "bfloat16", "float16")]
    if not (flash or half) or cuda_available():
        return
    if flash:
        report.problems.append("model.attn_implementation: flash_attention_2 runs on CUDA only and torch sees no GPU; "
                               "use sdpa")
    if half:
        report.notes.append(f"this config expects a GPU ({', '.join(half)}) and torch sees none: it would run on the "
                            f"CPU, slowly")


def _check_named_model(what: str, name: str, report: Report) -> None:
    """A named model (unirl/models/named.py): prepared, or its package installed so the run prepares it."""
    from unirl.models.named import ModelNotAvailableError, find_gguf, is_prepared, model_dir

    if is_prepared(name):
        report.passed.append(f"{what}: {name} is prepared in {model_dir(name)}")
        return
    try:
        report.passed.append(f"{what}: {name} is not prepared yet; the run imports {find_gguf(name)} first (~40 s)")
    except ModelNotAvailableError as e:
        report.problems.append(f"{what}: {e}")


def _check_hub(what: str, repo_id: str, repo_type: str, report: Report, extra: str = "") -> None:
    """A note saying whether the hub repo is in the local cache (not an error: it may be downloaded)."""
    from huggingface_hub import constants

    caches = [Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}" / "snapshots"]
    if repo_type == "dataset":  # ``datasets`` keeps its prepared copies apart
        root = os.environ.get("HF_DATASETS_CACHE") or os.path.join(constants.HF_HOME, "datasets")
        caches.append(Path(root) / repo_id.replace("/", "___"))
    cached = next((c for c in caches if c.is_dir() and any(c.iterdir())), None)
    if cached is not None:
        report.passed.append(f"{what}: hub {repo_type} {repo_id}{extra} is in the local cache ({cached})")
        return
    offline = " HF_HUB_OFFLINE is set, so the run would fail." if constants.HF_HUB_OFFLINE else ""
    report.notes.append(f"{what}: hub {repo_type} {repo_id}{extra} is not in the local cache "
                        f"({', '.join(map(str, caches))}); the run downloads it (network needed).{offline}")


def _short(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[: n - 3] + "...")


#: Each environment's data check (its own file formats).
DATA_CHECKS: dict[str, Callable[[Any, Path | None, Report], None]] = {"text": _text_data, "diffusion": _diffusion_data}
