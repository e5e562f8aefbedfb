"""Running a typed training config: the one path behind ``unirl train`` and ``unirl.train``.

1. The offline checks (``unirl.preflight``): a dry run stops here; then the paths found from the
   working directory are made absolute, so the saved ``config.yaml`` works from any directory.
2. The environment and the loop, with the libraries' start-up output sent to ``RUN/run.log``
   (``unirl.logs.RunOutput``) unless ``verbose``.
3. One start line before and one end line after (steps, first and last reward, evaluation figures,
   where the checkpoint, the curves and the log are); the per-step metrics come back as a ``TrainResult``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from unirl.config.environments import ENVIRONMENTS, import_object

@dataclass
class TrainResult:
    """What a finished run leaves: its per-step metrics, its evaluations and where its files are."""

    #: One dict per training step (``step``, ``reward/mean``, ``loss/policy``, ``time/step`` ...).
    metrics: list[dict[str, float]]
    #: The evaluation rows of ``metrics.jsonl`` (step 0 and every ``trainer.eval_every`` steps).
    evals: list[dict[str, float]]
    run_dir: Path
    #: The last ``checkpoints/step_N/`` directory (None when none was written).
    checkpoint: Path | None
    config: Any = field(repr=False)

    @property
    def rewards(self) -> list[float]:
        """``reward/mean`` of each step."""
        return [m["reward/mean"] for m in self.metrics]


def new_run_dir(output_dir: str | Path) -> Path:
    """A fresh directory beside ``output_dir``: ``<output_dir>-YYYYmmdd-HHMMSS`` (``-2``, ``-3`` ... when taken)."""
    base = Path(output_dir).expanduser().absolute()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate = base.with_name(f"{base.name}-{stamp}")
    k = 2
    while candidate.exists():
        candidate = base.with_name(f"{base.name}-{stamp}-{k}")
        k += 1
    return candidate


def train_config(env_name: str, cfg: Any, *, config_file: str | Path | None = None, label: str = "",
                 dry_run: bool = False, verbose: bool = False) -> TrainResult | None:
    """Train ``cfg`` (the environment's typed config), or only check it with ``dry_run``.

    ``config_file``: the YAML ``cfg`` came from (relative paths in it were looked up beside it);
    ``label``: how the start line names the config. Raises ``PreflightError`` listing every problem
    found before anything loads; ``Preempted`` when SIGTERM/SIGINT stopped the run after a checkpoint."""
    from unirl.config import absolute_paths, config_to_dict
    from unirl.preflight import PreflightError, preflight

    # 1. The offline checks (on the paths as written: their messages say where each was looked for).
    report = preflight(cfg, env_name, config_file)
    if dry_run:
        import yaml

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        print(report.format(), end="")
        from unirl.rollout.sources import describe_source

        print(f"# batch source (unirl/rollout/sources.py): {describe_source(cfg.source)}\n"
              "# step plan (unirl/trainer/plan.py), after the batch source:\n"
              + "\n".join("#" + line for line in step_plan(cfg).describe().splitlines()))
    if report.problems:
        raise PreflightError(report.problems)
    if dry_run:
        return None
    # 2. Paths found from the working directory made absolute, so the saved config.yaml works from anywhere.
    absolute_paths(cfg)
    cfg.output_dir = str(Path(cfg.output_dir).expanduser().absolute())
    if Path(cfg.model.name_or_path).expanduser().is_dir():  # a local model directory, not a hub name or a toy
        cfg.model.name_or_path = str(Path(cfg.model.name_or_path).expanduser().absolute())
    return _train(env_name, cfg, label or (str(config_file) if config_file else "(in code)"), verbose)


def step_plan(cfg: Any):
    """The step plan a run of ``cfg`` takes (``unirl.trainer.plan.build_plan``), from the config alone."""
    from unirl.core import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    from unirl.trainer.plan import build_plan

    distill = getattr(cfg, "distill", None)
    return build_plan(cfg.algo, cfg.trainer,
                      critic=bool(getattr(ADVANTAGE_ESTIMATORS.get(cfg.algo.adv_estimator), "reads_values", False)),
                      distill=bool(distill is not None and distill.teacher),
                      reads_logprobs=POLICY_LOSSES.get(cfg.policy_loss_name()).reads_logprobs)


def _train(env_name: str, cfg: Any, label: str, verbose: bool) -> TrainResult:
    from unirl import logs
    from unirl.trainer.loop import Trainer

    logs.configure(verbose=verbose)  # the CLI did at its start; a Python caller has not
    run_dir = Path(cfg.output_dir)
    main = int(os.environ.get("RANK", "0")) == 0
    if main:
        print(f"unirl: training {env_name} with config {label}, model {cfg.model.name_or_path} -> {run_dir}", flush=True)
    start = time.perf_counter()
    with logs.RunOutput(run_dir, verbose=verbose) as output:
        env = import_object(ENVIRONMENTS[env_name][1])(cfg)
        # The environment's set-up loads the models and starts vLLM: their C-level notices
        # (NUMA binding, Triton, loading bars) are written past Python's logging, so the file
        # descriptors themselves point at the log while it runs.
        env.setup = output.quiet(env.setup)
        trainer = Trainer.from_config(env, cfg)
        history = trainer.train()
        trainer.leave()
    result = collect_result(run_dir, history, cfg)
    if main:
        print(end_line(result, time.perf_counter() - start, output.path if not verbose else None), flush=True)
    return result


def collect_result(run_dir: Path, history: list[dict], cfg: Any) -> TrainResult:
    from unirl.trainer.checkpoints import checkpoint_dirs

    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    checkpoints = checkpoint_dirs(run_dir)
    return TrainResult(metrics=history, evals=evals, run_dir=run_dir, checkpoint=checkpoints[-1] if checkpoints else None,
                       config=cfg)


def end_line(result: TrainResult, seconds: float, log_file: Path | None) -> str:
    """The end-of-run summary, a few short lines (a path is the longest thing on one)::

        unirl: done, 150 steps in 46 s
          reward/mean    0.100 -> 0.640 (first and last 10 steps)
          eval/accuracy  0.120 -> 0.600 (steps 0 -> 150)
          checkpoint     RUN/checkpoints/step_000150
          curves         RUN/metrics.jsonl (unirl plot RUN)
          library log    RUN/run.log
    """
    rows = []
    rewards = result.rewards
    if rewards:
        k = min(10, max(1, len(rewards) // 2))
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        rows.append(("reward/mean", f"{first:.3f} -> {last:.3f} (first and last {k} step{'s' * (k > 1)})"))
    if result.evals:
        a, b = result.evals[0], result.evals[-1]
        steps = f"step {b['step']}" if a is b else f"steps {a['step']} -> {b['step']}"
        rows += [(key, f"{a[key]:.3f} -> {b[key]:.3f} ({steps})" if key in a and a is not b else f"{b[key]:.3f} ({steps})")
                 for key in b if key.startswith("eval/") and isinstance(b[key], (int, float))]
    rows.append(("checkpoint", str(result.checkpoint)) if result.checkpoint else ("checkpoint", "none"))
    rows.append(("curves", f"{result.run_dir / 'metrics.jsonl'} (unirl plot {result.run_dir})"))
    if log_file is not None:
        rows.append(("library log", str(log_file)))
    width = max(len(name) for name, _ in rows)
    return "\n".join([f"unirl: done, {len(result.metrics)} steps in {seconds:.0f} s"]
                     + [f"  {name:<{width}}  {text}" for name, text in rows])
