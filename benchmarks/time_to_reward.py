"""Time to reward: each diffusion RL method trains the toy tasks; held-out reward against wall time
and against transformer forwards.

    PYTHONPATH=$PWD python benchmarks/time_to_reward.py --seeds 3 --out benchmarks/time_to_reward
    PYTHONPATH=$PWD python benchmarks/time_to_reward.py --tasks tiny_colour --methods flowgrpo,nft --seeds 1

For every task (``configs/diffusion/<task>.yaml``, FlowGRPO's toy configs), seed and method (``METHODS``:
the task's config with the method's overrides) one run of ``--steps`` training steps on the loop's own
stages (``Trainer.train_step``), evaluated on the held-out prompts every ``--eval-every`` steps (the
EMA weights, the ODE sampler: the loop's ``evaluation``). Methods run seed by seed in turn, so a
change of machine load hits all of them alike.

Recorded at each evaluation: the held-out reward (and per colour on ``tiny_colour``: the share of
"red" prompts' pixels that are red and of "blue" prompts' that are blue, so one colour for every
prompt cannot pass), the training wall time so far (the sum of the steps' ``time/step``: no start-up,
no evaluation), and the transformer forwards so far (calls, and samples: the calls' batch rows summed;
counted by a forward hook on the transformer during training steps only).

Printed: per task and method the median over seeds of the final held-out reward, the training time and
forwards to reach FlowGRPO's final (``--steps``) held-out reward (its median), and the ratio of that time
to FlowGRPO's. Saved: ``<out>.json`` (every run's curve) and ``--plot`` (reward against time and
against sample-forwards, median over seeds; docs/time_to_reward.png). Time it under ``flock /tmp/bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

#: DiffusionNFT's overrides of a toy FlowGRPO config (configs/diffusion/tiny_colour_nft.yaml is
#: tiny_colour.yaml with exactly these: tests/test_nft.py checks it).
#: Tuned on tiny_colour, seed 0 (benchmarks/README.md): 4 ODE steps a rollout, one noise level a sample, lr 3e-2.
NFT = ["algorithm=nft", "algo.loss_args.kl_coef=0.0", "sampling.num_steps=4", "sampling.timestep_fraction=0.25", "optim.lr=3e-2"]

#: Flow-GRPO-Fast: a 2-step SDE window in the first 4 steps, the steps before it once per prompt (branching).
FAST = ["sampling.sde_window.size=2", "sampling.sde_window.range=[0,4]", "sampling.same_noise_per_group=true",
        "sampling.branch_prefix=true"]
#: MixGRPO-Flash: the window slides (progressive) over the first 6 steps, branching before it,
#: DPM-Solver++(2M) after it in 40% of the steps.
MIXGRPO = ["sampling.sde_window.size=2", "sampling.sde_window.range=[0,6]", "sampling.sde_window.schedule=progressive",
           "sampling.sde_window.shift_interval=10", "sampling.sde_window.stride=1", "sampling.same_noise_per_group=true",
           "sampling.branch_prefix=true", "sampling.ode_solver=dpm2m", "sampling.tail_step_ratio=0.4"]

#: method -> (config file under configs/diffusion/, ``{task}`` standing for the task's name; overrides).
METHODS: dict[str, tuple[str, list[str]]] = {
    "flowgrpo": ("{task}.yaml", []),
    "fast": ("{task}.yaml", FAST),
    "mixgrpo": ("{task}.yaml", MIXGRPO),
    "nft": ("{task}.yaml", NFT),
}

#: The tasks: FlowGRPO's toy configs, prompt-dependent colours and plain brightness.
TASKS = ("tiny_colour", "tiny")

COLOURS = ("red", "blue")


def count_forwards(env) -> dict[str, int]:
    """Counters ``calls`` and ``samples`` (batch rows) of the transformer's forwards, kept by a hook on the
    family's transformer module (inside LoRA and DDP wrappers), while ``counts["on"]`` is 1."""
    counts = {"calls": 0, "samples": 0, "on": 0}
    module = next(m for m in env.model.modules() if type(m).__name__.endswith("Transformer2DModel"))

    def hook(_module, args, kwargs):
        if counts["on"]:
            latents = args[0] if args else kwargs["hidden_states"]
            counts["calls"] += 1
            counts["samples"] += latents.shape[0]

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return counts


def per_colour(env) -> dict[str, float]:
    """Held-out reward of the prompts naming each colour (EMA weights, the evaluation's sampler)."""
    rows = env.test_rows
    prompts = [row["prompt"] for row in rows]
    with env.ema_weights():
        images = env.sample_deterministic(rows)
    scores = env.rewards.components(images, prompts=prompts, columns={})
    total = next(iter(scores.values()))  # [n]: one reward on the toy tasks
    out = {}
    for colour in COLOURS:
        picked = [i for i, p in enumerate(prompts) if f" {colour} " in f" {p} "]
        if picked:
            out[colour] = float(total[picked].mean())
    return out


def train_one(task: str, method: str, seed: int, steps: int, eval_every: int, work: Path) -> list[dict]:
    """One run; its evaluations ``{step, time, calls, samples, reward, colours}``."""
    from unirl.cli import load_run_config
    from unirl.config.environments import ENVIRONMENTS
    from unirl.config.environments import import_object as _import
    from unirl.config import config_to_dict
    from unirl.trainer.loop import Trainer

    config, overrides = METHODS[method]
    path = REPO / "configs" / "diffusion" / config.format(task=task)
    run_dir = work / f"{task}-{method}-{seed}"
    cfg = load_run_config("diffusion", str(path), [*overrides, f"trainer.seed={seed}", f"trainer.total_steps={steps}",
                                                   "trainer.eval_every=0", "trainer.save_every=0",
                                                   "trainer.progress=false"], output_dir=str(run_dir))
    env = _import(ENVIRONMENTS["diffusion"][1])(cfg)
    trainer = Trainer(env, algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=cfg.output_dir,
                      config_dict=config_to_dict(cfg))
    trainer.setup()
    counts = count_forwards(env)
    curve, elapsed = [], 0.0

    def evaluate(step: int) -> None:
        reward = trainer.evaluate()["eval/reward"]
        curve.append({"step": step, "time": elapsed, "calls": counts["calls"], "samples": counts["samples"],
                      "reward": reward, "colours": per_colour(env) if task == "tiny_colour" else {}})

    try:
        evaluate(0)
        for step in range(1, steps + 1):
            counts["on"] = 1
            metrics = trainer.train_step()
            counts["on"] = 0
            elapsed += metrics["time/step"]
            if step % eval_every == 0 or step == steps:
                evaluate(step)
    finally:
        env.close()
    return curve


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (Linux), to print beside the times."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def first_reaching(curve: list[dict], target: float) -> dict | None:
    return next((point for point in curve if point["reward"] >= target), None)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(runs: dict, methods: list[str]) -> list[str]:
    """The table's lines: per task and method, medians over seeds."""
    lines = ["| task | method | seeds | final held-out reward | per colour (red / blue) | time to FlowGRPO's final (s) "
             "| x FlowGRPO's time | sample-forwards to it | total time (s) |", "|---" * 9 + "|"]
    for task, by_method in runs.items():
        base = by_method.get("flowgrpo")
        target = median([c[-1]["reward"] for c in base]) if base else None
        base_time = median([c[-1]["time"] for c in base]) if base else None
        for method in methods:
            curves = by_method.get(method, [])
            if not curves:
                continue
            final = median([c[-1]["reward"] for c in curves])
            colours = " / ".join(f"{median([c[-1]['colours'][k] for c in curves]):.3f}" for k in COLOURS
                                 if all(k in c[-1]["colours"] for c in curves)) or "-"
            reached = [first_reaching(c, target) for c in curves] if target is not None else []
            # Seeds that never reached it count as infinitely slow in the median; FlowGRPO's own figure is
            # its whole run's (the target is its median final reward, reached at the end by definition).
            t = median([p["time"] if p else float("inf") for p in reached]) if method != "flowgrpo" else base_time
            if target is None or t == float("inf"):
                to_time = to_samples = ratio = "not reached" if target is not None else "-"
            else:
                to_time, ratio = f"{t:.1f}", f"{t / base_time:.2f}"
                samples = [c[-1]["samples"] for c in curves] if method == "flowgrpo" else \
                    [p["samples"] if p else float("inf") for p in reached]
                to_samples = f"{median(samples):.0f}"
            total = median([c[-1]["time"] for c in curves])
            lines.append(f"| {task} | {method} | {len(curves)} | {final:.3f} | {colours} | {to_time} | {ratio} "
                         f"| {to_samples} | {total:.1f} |")
    return lines


def plot(runs: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 2, figsize=(10, 3.6 * len(runs)), squeeze=False)
    for row, (task, by_method) in enumerate(runs.items()):
        for method, curves in by_method.items():
            points = range(min(len(c) for c in curves))
            reward = [median([c[i]["reward"] for c in curves]) for i in points]
            for col, key in enumerate(("time", "samples")):
                x = [median([c[i][key] for c in curves]) for i in points]
                axes[row][col].plot(x, reward, marker="o", label=f"{method} ({len(curves)} seeds)")
        for col, label in enumerate(("training wall time (s)", "transformer sample-forwards")):
            axes[row][col].set(xlabel=label, ylabel="held-out reward (median)", title=task)
            axes[row][col].legend()
    fig.tight_layout()
    fig.savefig(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "time_to_reward")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "time_to_reward.png")
    parser.add_argument("--work", type=Path, default=Path("/tmp/unirl-time-to-reward"))
    parser.add_argument("--summarise", action="store_true", help="only print the table and plot of <out>.json")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    if args.summarise:  # a finished or stopped benchmark's saved runs
        runs = json.loads(args.out.with_suffix(".json").read_text())
        print("\n".join(summarise(runs, [m for m in methods if any(m in r for r in runs.values())])))
        plot({t: {m: c for m, c in r.items() if c} for t, r in runs.items()}, args.plot)
        return 0
    run_id = time.strftime("%Y%m%d-%H%M%S")
    print(f"torch threads {torch.get_num_threads()}; load average {load_average()}", flush=True)
    tasks = args.tasks.split(",")
    runs = {task: {m: [] for m in methods} for task in tasks}
    for seed in range(args.seeds):  # seed by seed, so a stopped benchmark has every task and method
        for task in tasks:
            for method in methods:  # interleaved: load changes hit every method alike
                curve = train_one(task, method, seed, args.steps, args.eval_every, args.work / run_id)
                runs[task][method].append(curve)
                last = curve[-1]
                print(f"{task} {method} seed {seed}: held-out {curve[0]['reward']:.3f} -> {last['reward']:.3f} "
                      f"{last['colours']} in {last['time']:.1f} s, {last['samples']} sample-forwards; "
                      f"load average {load_average()}", flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.with_suffix(".json").write_text(json.dumps(runs, indent=1))  # so far: kept if stopped
    lines = summarise(runs, methods)
    print("\n".join(lines))
    plot(runs, args.plot)
    print(f"saved {args.out.with_suffix('.json')} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
