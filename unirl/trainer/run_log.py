"""What a run writes besides checkpoints: ``config.yaml``, ``metrics.jsonl`` (one JSON row per step
and per evaluation), the trackers (wandb, tensorboard) with the evaluation's images and tables, and
the progress bar on the console. Only the main process writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unirl.config.schema import TrainerConfig


class RunLog:
    def __init__(self, accelerator, run_dir: Path, cfg: TrainerConfig):
        self.accelerator, self.run_dir, self.cfg = accelerator, Path(run_dir), cfg

    def start(self, config_dict: dict[str, Any]) -> None:
        """Create the run directory, write ``config.yaml`` and start the trackers (main process)."""
        if not self.accelerator.is_main_process:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_yaml(self.run_dir / "config.yaml", config_dict)
        if self.cfg.log_with:
            # Every tracker writes under the run directory (tensorboard: <run>/<project>/).
            self.accelerator.init_trackers(self.cfg.project, config=flatten(config_dict), init_kwargs={
                "wandb": {"dir": str(self.run_dir), "name": self.run_dir.name}})

    def log(self, metrics: dict[str, float]) -> None:
        """One row of ``metrics.jsonl`` and the trackers (a row with nothing but its step is skipped)."""
        if not self.accelerator.is_main_process or len(metrics) <= 1:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.cfg.log_with:
            self.accelerator.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])

    def log_media(self, media: dict, step: int) -> None:
        """The evaluation's images and tables to the trackers (metrics.jsonl keeps only numbers)."""
        if not (self.cfg.log_with and self.accelerator.is_main_process):
            return
        import numpy as np

        for tracker in self.accelerator.trackers:
            for key, image in media.get("images", {}).items():
                if tracker.name == "tensorboard":  # add_images takes a batch: [1, H, W, 3]
                    tracker.log_images({key: np.asarray(image.convert("RGB"))[None]}, step=step,
                                       dataformats="NHWC")
                else:
                    tracker.log_images({key: [image]}, step=step)
            for key, (columns, rows) in media.get("tables", {}).items():
                if tracker.name == "wandb":
                    tracker.log_table(key, columns=columns, data=rows, step=step)
                elif tracker.name == "tensorboard":  # no tables there: one markdown table as text
                    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                    lines += ["| " + " | ".join(str(v).replace("|", "/").replace("\n", " ") for v in row) + " |"
                              for row in rows]
                    tracker.writer.add_text(key, "\n".join(lines), global_step=step)

    def finish(self) -> None:
        for tracker in self.accelerator.trackers:  # not end_training: the process group is the caller's
            tracker.finish()


class Progress:
    """One console line: steps done, elapsed and time left (tqdm's estimate), reward, KL when it is on."""

    def __init__(self, cfg: TrainerConfig, start: int, main: bool):
        self.bar = None
        if cfg.progress and main:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.total_steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                            leave=True)

    def update(self, metrics: dict[str, float]) -> None:
        if self.bar is None:
            return
        fields = {"reward": f"{metrics['reward/mean']:.3f}"}
        if "loss/kl" in metrics:
            fields["kl"] = f"{metrics['loss/kl']:.2e}"
        # The postfix first: update() redraws the line, so setting it after (without a refresh) showed
        # the previous step's reward beside this step's count.
        self.bar.set_postfix(fields, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def wandb_login_problem() -> str | None:
    """Why a wandb tracker would fail at the run's start (after the model loaded, with a 49-line traceback),
    or None: no ``WANDB_MODE`` that needs no login (offline, disabled), no ``WANDB_API_KEY`` or identity token
    file, and no entry for wandb's host in the netrc file that ``wandb login`` writes. Reads files only."""
    import netrc
    import os
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or \
            os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true") or \
            os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    file = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        if netrc.netrc(str(file)).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (f"trainer.log_with: wandb has no login on this machine (no WANDB_API_KEY, no {host} entry in {file}): run "
            f"`wandb login` once, or set WANDB_MODE=offline to write the run under the run directory (`wandb sync` "
            f"uploads it later)")


def write_yaml(path: Path, data: dict) -> None:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested config keys as dotted ones, values the trackers take (others as strings)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out
