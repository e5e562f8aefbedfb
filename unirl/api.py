"""unirl from Python: ``unirl.train``, ``unirl.load_config`` and ``unirl.evaluate``.

    import unirl

    def short(samples, **kwargs):
        return [1.0 if len(s) < 20 else 0.0 for s in samples]

    result = unirl.train("text", "tiny", {"trainer.total_steps": 20}, rewards=[short],
                         train_data=[{"prompt": "2+3=?"}, {"prompt": "4+1=?"}])
    result.rewards, result.run_dir, result.checkpoint

These are the command line's own code paths (``unirl.runner.train_config``, ``unirl.evaluation``), so
a config, its seed and its overrides give the same run from either. What Python adds is what a
command line cannot pass: reward callables and in-memory datasets.

- Rewards (``docs/rewards.md``'s contract) may be callables, named by their ``__name__`` (the
  metric is ``reward/<name>``), ``(name, fn)`` or ``(name, fn, weight)`` tuples, spec strings
  (``gsm8k``, ``my_rewards.py:fn``), ``RewardConfig``s or ``{"name": ..., "weight": ...}`` dicts.
  A callable is registered under its name for the run and unregistered afterwards; the saved
  ``config.yaml`` names it, so that file runs from the command line only where the name is
  registered (or written as ``file.py:function``).
- Datasets (``datasets.Dataset``, a list of dicts, a list of prompt strings) are written to
  ``RUN/data/train.jsonl`` / ``test.jsonl`` and the config points at them; a path is used as is. A
  row's ``images`` (a vision-language policy's, docs/vlm.md) may be PIL images, bytes or file paths:
  the pictures are written as PNGs under ``RUN/data/train_images/`` and paths made absolute.
- Repeated calls in one process work: each run closes its vLLM engine and process group. Ctrl-C
  (a notebook's interrupt) ends the current step, saves a checkpoint and raises ``Preempted``, as
  the CLI does. vLLM runs inside the calling process, so a *script* (not a notebook) that trains
  with the vLLM engine needs ``if __name__ == "__main__":`` when it is started with a spawn-based
  launcher; a notebook or ``python script.py`` does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from unirl.config.environments import config_class
from unirl.runner import TrainResult, new_run_dir, train_config

__all__ = ["TrainResult", "evaluate", "load_config", "train"]

#: The kind of samples each environment's rewards score (a callable is registered with it).
_MODALITY = {"text": "text", "diffusion": "image"}


def load_config(env: str, config: Any = "tiny", overrides: Iterable[str] | Mapping[str, Any] = (), *,
                recipe: str | None = None):
    """The environment's typed config from a shipped name, a YAML path, a mapping or a config object,
    with a ``recipe``'s keys (``unirl.config.recipes``) and then ``overrides`` (``key=value`` strings or
    ``{"key": value}``) applied. Errors are the CLI's (``ConfigError`` naming the key)."""
    from unirl.config import config_to_dict, load_config as load, resolve_config_path
    from unirl.config.recipes import recipe_overrides

    cls = config_class(env)
    items = recipe_overrides(recipe) + _override_strings(overrides)
    if isinstance(config, cls):
        return load(cls, config_to_dict(config), items)
    if isinstance(config, Mapping):
        return load(cls, config, items)
    if isinstance(config, (str, Path)):
        return load(cls, resolve_config_path(env, config), items)
    raise TypeError(f"config must be a {env} config name, a YAML path, a mapping or a {cls.__name__}, "
                    f"got {type(config).__name__}")


def train(env: str, config: Any = "tiny", overrides: Iterable[str] | Mapping[str, Any] = (), *,
          rewards: Sequence[Any] | None = None, train_data: Any = None, test_data: Any = None,
          output_dir: str | Path | None = None, new_run: bool = False, progress: bool = True,
          verbose: bool = False, recipe: str | None = None) -> TrainResult:
    """Train ``env`` (``text`` or ``diffusion``) on ``config`` as ``unirl train`` does; returns a ``TrainResult``.

    ``rewards`` replaces the config's rewards; ``train_data``/``test_data`` its data files;
    ``output_dir`` its run directory (``new_run``: a fresh, time-stamped directory beside it);
    ``progress=False`` hides the progress bar; ``verbose`` shows the libraries' start-up output;
    ``recipe`` (``dr_grpo``, ``gspo``, ``rloo``: ``unirl.config.recipes``) sets its keys before ``overrides``."""
    from unirl.config import resolve_config_path
    from unirl.preflight import PreflightError, existing_run_problem

    cfg = load_config(env, config, overrides, recipe=recipe)
    if output_dir is not None:
        cfg.output_dir = str(output_dir)
    if new_run:
        cfg.output_dir = str(new_run_dir(cfg.output_dir))
    cfg.trainer.progress = progress
    reward_configs, callables = _reward_configs(rewards, env) if rewards is not None else (cfg.rewards, [])
    cfg.rewards = reward_configs
    # The rewards and the run directory are checked before the in-memory data is written into it.
    problem = existing_run_problem(cfg.output_dir, cfg.trainer.resume)
    if problem:
        raise PreflightError([problem])
    config_file = resolve_config_path(env, config) if isinstance(config, (str, Path)) else None
    label = str(config) if isinstance(config, (str, Path)) else f"({type(config).__name__})"
    with _registered(callables, _MODALITY[env]):
        run_dir = Path(cfg.output_dir).expanduser().absolute()
        if train_data is not None:
            cfg.data.train = _data_file(train_data, run_dir / "data" / "train.jsonl", "train_data")
        if test_data is not None:
            cfg.data.test = _data_file(test_data, run_dir / "data" / "test.jsonl", "test_data")
        return train_config(env, cfg, config_file=config_file, label=label, verbose=verbose)


def evaluate(env: str, config: Any = None, overrides: Iterable[str] | Mapping[str, Any] = (), *,
             checkpoint: str | Path, output_dir: str | Path | None = None, n: int = 1, ks: Sequence[int] = (),
             protocols: Sequence[str] | None = None, rewards: Sequence[Any] | None = None, test_data: Any = None,
             verbose: bool = False, run_config: bool = True) -> dict:
    """Score ``checkpoint`` on the config's held-out prompts as ``unirl eval`` does; returns the summary
    (``reward``: the weighted total's mean, ``reward/<name>`` each reward's; for text ``accuracy``, ``pass@k``
    with ``n > 1``, and each evaluation protocol's figures under ``<name>/``; ``protocols``: only these,
    ``unirl.evaluation.evaluate_text``), also written to ``output_dir/summary.json`` (default
    ``CHECKPOINT/eval``). The libraries' output goes to ``output_dir/eval.log`` unless ``verbose``.
    A checkpoint of a run is scored with the run's saved ``config.yaml`` unless ``run_config=False``
    (``config`` then, default ``tiny``); the summary's ``config`` says which."""
    from unirl import logs
    from unirl.evaluation import check_checkpoint_path, choose_config, evaluate_diffusion, evaluate_text

    check_checkpoint_path(str(checkpoint))  # before anything is written: a missing one is one line
    if protocols and env != "text":
        raise ValueError("--protocol: evaluation protocols are text's (diffusion evaluates its data.test)")
    config, which = choose_config(checkpoint, config, run_config, default="tiny")
    cfg = load_config(env, config, overrides)
    logs.configure(verbose=verbose)  # imports transformers and diffusers: after the checks, which need neither
    out = Path(output_dir) if output_dir is not None else _default_eval_dir(checkpoint)
    if test_data is not None:
        cfg.data.test = _data_file(test_data, out / "data" / "test.jsonl", "test_data")
    reward_configs, callables = _reward_configs(rewards, env) if rewards is not None else (cfg.rewards, [])
    cfg.rewards = reward_configs
    with _registered(callables, _MODALITY[env]), logs.RunOutput(out, verbose=verbose, name="eval.log") as output:
        if env == "text":
            summary = output.quiet(evaluate_text)(cfg, str(checkpoint), out, n=n, ks=list(ks),
                                                  protocols=None if protocols is None else list(protocols))
        else:
            summary = output.quiet(evaluate_diffusion)(cfg, str(checkpoint), out)
    return {**summary, "config": which.removeprefix("config: ")}


def _default_eval_dir(checkpoint: str | Path) -> Path:
    path = Path(checkpoint)
    return (path / "eval") if path.is_dir() else Path("eval") / path.name


# ----------------------------------------------------------------------------------------------
# Overrides, data, rewards
# ----------------------------------------------------------------------------------------------


def _override_strings(overrides: Iterable[str] | Mapping[str, Any]) -> list[str]:
    """``{"trainer.total_steps": 5}`` -> ``["trainer.total_steps=5"]`` (JSON values are YAML); strings as they are."""
    if isinstance(overrides, Mapping):
        return [f"{key}={json.dumps(_plain(value))}" for key, value in overrides.items()]
    if isinstance(overrides, str):
        raise TypeError(f"overrides must be key=value strings or a dict, got the string {overrides!r}")
    return list(overrides)


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _data_file(data: Any, path: Path, what: str) -> str:
    """A path as it is; a ``datasets.Dataset``, a list of dicts or of prompt strings written to ``path`` (JSON lines)."""
    if isinstance(data, (str, Path)):
        return str(data)
    rows = list(data) if hasattr(data, "__iter__") and not isinstance(data, Mapping) else None
    if rows is None:
        raise TypeError(f"{what}: expected a datasets.Dataset, a list of dicts, a list of prompt strings or a path, "
                        f"got {type(data).__name__}")
    if not rows:
        raise ValueError(f"{what}: no rows")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            if isinstance(row, str):
                row = {"prompt": row}
            if not isinstance(row, Mapping):
                raise TypeError(f"{what}: row {i} is a {type(row).__name__}; expected a dict of columns or a prompt string")
            if row.get("images") is not None:  # pictures in memory become PNG files beside the data file
                from unirl.text.vlm import portable_images

                row = portable_images(dict(row), i, path.parent / f"{path.stem}_images", f"row{i:05d}")
            try:
                f.write(json.dumps(dict(row)) + "\n")
            except TypeError as err:
                raise TypeError(f"{what}: row {i} has a value JSON cannot hold ({err})") from None
    return str(path)


def _reward_configs(rewards: Sequence[Any], env: str) -> tuple[list, list[tuple[str, Callable]]]:
    """The ``RewardConfig`` list and the ``(name, callable)`` pairs to register for the run."""
    from unirl.config.schema import RewardConfig

    if isinstance(rewards, (str, Mapping)) or callable(rewards):
        rewards = [rewards]
    configs, callables = [], []
    for i, item in enumerate(rewards):
        if isinstance(item, RewardConfig):
            configs.append(dataclasses.replace(item))
        elif isinstance(item, str):
            configs.append(RewardConfig(name=item))
        elif isinstance(item, Mapping):
            configs.append(RewardConfig(**item))
        elif isinstance(item, tuple) and len(item) in (2, 3) and isinstance(item[0], str) and callable(item[1]):
            configs.append(RewardConfig(name=item[0], weight=float(item[2]) if len(item) == 3 else 1.0))
            callables.append((item[0], item[1]))
        elif callable(item):
            name = getattr(item, "__name__", "")
            if not name.isidentifier():
                raise ValueError(f"rewards[{i}]: {item!r} has no usable name ({name!r}); pass it as (name, fn) "
                                 f"or (name, fn, weight)")
            configs.append(RewardConfig(name=name))
            callables.append((name, item))
        else:
            raise TypeError(f"rewards[{i}]: expected a callable, (name, fn[, weight]), a spec string, a RewardConfig "
                            f"or a dict, got {type(item).__name__}")
    if not configs:
        raise ValueError("rewards: the list is empty; pass at least one reward")
    return configs, callables


@contextlib.contextmanager
def _registered(callables: list[tuple[str, Callable]], modality: str):
    """Register each ``(name, fn)`` as a reward for the duration of the run, then unregister it.

    A name already registered for another object (a built-in such as ``gsm8k``) is an error that
    says how to rename it."""
    from unirl.rewards.loading import list_rewards
    from unirl.rewards.registry import REWARDS, register_reward, unregister_reward

    if callables:
        list_rewards()  # the built-ins and entry points first, so a clash with one of them shows now
    added = []
    try:
        for name, fn in callables:
            if name in REWARDS and REWARDS.get(name) is fn:
                continue  # registered by the user already (@register_reward)
            if name in REWARDS:
                raise ValueError(f"reward name {name!r} is taken by a registered reward; pass the function as "
                                 f"('another_name', fn) or ('another_name', fn, weight)")
            register_reward(name, modality=modality)(fn)
            added.append(name)
        yield
    finally:
        for name in added:
            unregister_reward(name)
