"""What a diffusion step saves by reusing what it has (issue 49, item 4), each option on and off in one process.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/step_reuse.py --steps 12

For each option, two trainers of ``configs/diffusion/tiny_colour.yaml`` (FlowGRPO; same seed) differ only in
it, and their steps alternate (off, on, off, on, ...) so a change of machine load hits both alike; printed:
the median ``time/step`` and the stage the option touches, off and on, and on/off. The first ``--warmup``
steps of each are left out.

* ``prompt_cache``: ``sampling.prompt_cache_size`` 0 vs 64 (``time/rollout``: the text encoders run in it);
* ``old_logprobs``: with ``trainer.ppo_epochs=2`` (off-policy: the old log-probs are needed before the
  update) the trainer's recompute (``recompute_old_logprobs`` forced true on the run's actions: what a
  trainer does without rollout correction) vs the sampler's own log-probs (FlowGRPO's default);
* ``sampler_old_means``: with the KL in the reward, ``sampling.sampler_old_means`` false vs true
  (``time/old_logprobs``: the old policy's pass it skips);
* ``reward_pool``: the async reward within a step, ``trainer.reward_workers`` 0 (every chunk scored after
  sampling, inline) vs 1 (each chunk but the last scored in the pool while the next chunk samples), with
  ``colour_share`` behind ``--reward-latency-ms`` of waiting per image (a reward model on another machine,
  an OCR server: the toy's own reward takes microseconds) and 2 chunks of 16 a rollout (``time/rollout``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

#: option -> (overrides of both runs, of the "off" run, of the "on" run, the stage timer it touches,
#: whether "off" forces the trainer's recompute of the old log-probs).
OPTIONS = {
    "prompt_cache": ([], ["sampling.prompt_cache_size=0"], ["sampling.prompt_cache_size=64"], "time/rollout", False),
    "old_logprobs": (["trainer.ppo_epochs=2"], [], [], "time/old_logprobs", True),
    "sampler_old_means": (["algo.use_kl_in_reward=true", "algo.kl_ctrl.kl_coef=0.1"], ["sampling.sampler_old_means=false"],
                          ["sampling.sampler_old_means=true"], "time/old_logprobs", False),
    "reward_pool": (["rewards.0.name=colour_share_remote", "sampling.chunk_size=16"], ["trainer.reward_workers=0"],
                    ["trainer.reward_workers=1"], "time/rollout", False),
}


def register_remote_reward(latency_ms: float) -> None:
    """``colour_share_remote``: ``colour_share`` after ``latency_ms`` of waiting per image (the scores are
    ``colour_share``'s: both runs of ``reward_pool`` learn alike)."""
    from unirl.rewards import register_reward
    from unirl.rewards.image import colour_share

    @register_reward("colour_share_remote", modality="image")
    def colour_share_remote(images, *, prompts, **kwargs):
        """colour_share behind a network's latency (benchmarks/step_reuse.py)."""
        time.sleep(latency_ms / 1e3 * len(images))
        return colour_share(images, prompts=prompts, **kwargs)


def make_trainer(overrides: list[str], work: Path):
    from unirl.cli import load_run_config
    from unirl.diffusion import build_environment
    from unirl.trainer.loop import Trainer

    cfg = load_run_config("diffusion", str(REPO / "configs/diffusion/tiny_colour.yaml"),
                          [*overrides, "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false"],
                          output_dir=str(work))
    trainer = Trainer.from_config(build_environment(cfg), cfg)
    trainer.setup()
    return trainer


def measure(option: str, steps: int, warmup: int, work: Path) -> dict[str, dict[str, float]]:
    """Median step and stage seconds of the option off and on, steps alternating."""
    both, off, on, stage, force_recompute = OPTIONS[option]
    runs = {"off": make_trainer([*both, *off], work / f"{option}-off"), "on": make_trainer([*both, *on], work / f"{option}-on")}
    if force_recompute:
        runs["off"].env.actions.recompute_old_logprobs = True  # the trainer's pass, as without rollout correction
    times = {name: {"step": [], "stage": []} for name in runs}
    try:
        for i in range(warmup + steps):
            for name, trainer in runs.items():
                metrics = trainer.train_step()
                if i >= warmup:
                    times[name]["step"].append(metrics["time/step"])
                    times[name]["stage"].append(metrics.get(stage, 0.0))
    finally:
        for trainer in runs.values():
            trainer.env.close()
    return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reward-latency-ms", type=float, default=10.0, help="reward_pool: waiting per image")
    args = parser.parse_args(argv)
    register_remote_reward(args.reward_latency_ms)
    print(f"torch threads {torch.get_num_threads()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    print("| option | stage | stage off (ms) | stage on (ms) | step off (ms) | step on (ms) | step on/off |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for option in args.options.split(","):
            r = measure(option, args.steps, args.warmup, Path(work))
            print(f"| {option} | {OPTIONS[option][3]} | {1e3 * r['off']['stage']:.1f} | {1e3 * r['on']['stage']:.1f} "
                  f"| {1e3 * r['off']['step']:.1f} | {1e3 * r['on']['step']:.1f} "
                  f"| {r['on']['step'] / r['off']['step']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
