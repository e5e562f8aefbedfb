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

#: AWM, DGPO and TempFlow-GRPO: configs/diffusion/tiny_colour_<method>.yaml is tiny_colour.yaml with exactly
#: these (tests/test_time_to_reward.py checks it); their settings are those configs' (docs/diffusion.md).
AWM = ["algorithm=awm", "mode_args.weighting=uniform", "sampling.num_steps=4", "sampling.timestep_fraction=0.25",
       "algo.clip_low=1e-4", "algo.clip_high=1e-4", "optim.lr=3e-2"]
DGPO = ["algorithm=dgpo", "mode_args.timestep_range=0.6", "mode_args.switch_old=200", "sampling.num_steps=4",
        "sampling.timestep_fraction=0.25", "algo.loss_args.beta=10.0", "optim.lr=2e-2"]
TEMPFLOW = ["algorithm=tempflow", "mode_args.branch_range=null", "algo.loss_args.weight_scale=2.25", "optim.lr=3e-2"]

#: method -> (config file under configs/diffusion/, ``{task}`` standing for the task's name; overrides).
METHODS: dict[str, tuple[str, list[str]]] = {
    "flowgrpo": ("{task}.yaml", []),
    "fast": ("{task}.yaml", FAST),
    "mixgrpo": ("{task}.yaml", MIXGRPO),
    "nft": ("{task}.yaml", NFT),
    "awm": ("{task}.yaml", AWM),
    "dgpo": ("{task}.yaml", DGPO),
    "tempflow": ("{task}.yaml", TEMPFLOW),
}

#: The guards (issue 49), each a registered policy loss in place of the method's own: ``<method>+<guard>``
#: is a method with ``algo.policy_loss=<guard>`` (and no ``algo.loss_args``: the guard's defaults). Only the
#: pairs whose config loads run: a mode whose forward does not give what the guard reads is refused there.
GUARDS = ("grpo_guard", "flow_dppo")

#: The tasks: FlowGRPO's toy configs, prompt-dependent colours (two and four of them) and plain brightness.
TASKS = ("tiny_colour", "tiny_palette", "tiny")


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


def method_config(method: str) -> tuple[str, list[str]]:
    """``(config, overrides)`` of ``method``: a ``METHODS`` name, or ``<name>+<guard>`` (one of ``GUARDS``: the
    method's overrides without its own ``algo.loss_args``, and the guard as its policy loss)."""
    name, _, guard = method.partition("+")
    if name not in METHODS or (guard and guard not in GUARDS):
        raise ValueError(f"unknown method {method!r}: a name of {', '.join(METHODS)}, optionally +{' or +'.join(GUARDS)}")
    config, overrides = METHODS[name]
    if guard:
        overrides = [o for o in overrides if not o.startswith("algo.loss_args.")] + [f"algo.policy_loss={guard}"]
    return config, overrides


def load_method(task: str, method: str, extra: list[str], run_dir: Path):
    """The run config of ``method`` on ``task`` with ``extra`` overrides (a config error if the pair is refused)."""
    from unirl.cli import load_run_config

    config, overrides = method_config(method)
    path = REPO / "configs" / "diffusion" / config.format(task=task)
    return load_run_config("diffusion", str(path), [*overrides, *extra], output_dir=str(run_dir))


def valid_methods(task: str, candidates: list[str]) -> tuple[list[str], dict[str, str]]:
    """The candidates whose config loads on ``task`` and, for the rest, the loader's reason (the registry's
    check that the mode's forward gives what the loss reads, ``unirl.diffusion.modes.resolve_algorithm``)."""
    kept, refused = [], {}
    for method in candidates:
        try:
            load_method(task, method, [], Path("/tmp/unirl-time-to-reward-check"))
            kept.append(method)
        except (ValueError, TypeError) as error:
            refused[method] = str(error).splitlines()[0]
    return kept, refused


def per_colour(env) -> dict[str, float]:
    """Held-out reward of the prompts naming each colour (EMA weights, the evaluation's sampler)."""
    from unirl.rewards.image import named_colour

    rows = env.test_rows
    prompts = [row["prompt"] for row in rows]
    with env.ema_weights():
        images = env.sample_deterministic(rows)
    scores = env.rewards.components(images, prompts=prompts, columns={})
    total = next(iter(scores.values()))  # [n]: one reward on the toy tasks
    out = {}
    for colour in dict.fromkeys(named_colour(p) for p in prompts):
        if colour is not None:
            out[colour] = float(total[[i for i, p in enumerate(prompts) if named_colour(p) == colour]].mean())
    return out


def train_one(task: str, method: str, seed: int, steps: int, eval_every: int, work: Path) -> list[dict]:
    """One run; its evaluations ``{step, time, calls, samples, reward, colours, offtarget}`` (``offtarget``:
    the held-out images' ``offtarget/eval/*`` figures, unirl/diffusion/offtarget.py)."""
    from unirl.config.environments import ENVIRONMENTS
    from unirl.config.environments import import_object as _import
    from unirl.config import config_to_dict
    from unirl.trainer.loop import Trainer

    cfg = load_method(task, method, [f"trainer.seed={seed}", f"trainer.total_steps={steps}", "trainer.eval_every=0",
                                     "trainer.save_every=0", "trainer.progress=false"], work / f"{task}-{method}-{seed}")
    env = _import(ENVIRONMENTS["diffusion"][1])(cfg)
    trainer = Trainer(env, algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=cfg.output_dir,
                      config_dict=config_to_dict(cfg))
    trainer.setup()
    counts = count_forwards(env)
    curve, elapsed = [], 0.0

    def evaluate(step: int) -> None:  # per colour at the end only (it samples the panel again)
        figures = trainer.evaluate()
        off = {k.removeprefix("offtarget/eval/"): v for k, v in figures.items()
               if k.startswith("offtarget/eval/") and k != "offtarget/eval/reward"}
        curve.append({"step": step, "time": elapsed, "calls": counts["calls"], "samples": counts["samples"],
                      "reward": figures["eval/reward"], "colours": per_colour(env) if step == steps else {},
                      "offtarget": off})

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


def off_reward(point: dict) -> float:
    """The evaluation's off-target reward: the sum of its not-optimised rewards (``offtarget.rewards``)."""
    return sum(v for k, v in point.get("offtarget", {}).items() if k.startswith("reward/"))


def method_row(curves: list[dict], method: str, target: float, base_time: float) -> dict:
    """Medians over seeds of one method's runs: the final held-out reward and figures, the time and
    sample-forwards to reach ``target`` (inf where a seed never does), and the off-target reward there."""
    reached = [c[-1] if method == "flowgrpo" else first_reaching(c, target) for c in curves]
    # Seeds that never reached it count as infinitely slow in the median; FlowGRPO's own figure is its whole
    # run's (the target is its median final reward, reached at the end by definition).
    time = base_time if method == "flowgrpo" else median([p["time"] if p else float("inf") for p in reached])
    colours = sorted({k for c in curves for k in c[-1]["colours"]})
    return {
        "final": median([c[-1]["reward"] for c in curves]),
        "colours": {k: median([c[-1]["colours"][k] for c in curves if k in c[-1]["colours"]]) for k in colours},
        "time": time, "ratio": time / base_time,
        "samples": median([p["samples"] if p else float("inf") for p in reached]),
        # at the crossing (a seed that never reached it: its final), and at the end
        "off_at": median([off_reward(p or c[-1]) for p, c in zip(reached, curves)]),
        "off_final": median([off_reward(c[-1]) for c in curves]),
        "diversity": median([c[-1].get("offtarget", {}).get("diversity", float("nan")) for c in curves]),
        "total": median([c[-1]["time"] for c in curves]),
    }


def summarise(runs: dict, methods: list[str]) -> list[str]:
    """The table's lines (per task and method, medians over seeds) and, per task, the issue's goal: the
    fastest method reaches FlowGRPO's final held-out reward in at most 1/8 of its time, with an off-target
    reward at that point no worse than FlowGRPO's final one."""
    lines = ["| task | method | seeds | final held-out reward | per colour | time to FlowGRPO's final (s) "
             "| x FlowGRPO's time | sample-forwards to it | off-target reward there (final) | held-out diversity "
             "| total time (s) |", "|---" * 11 + "|"]
    goals = []
    for task, by_method in runs.items():
        base = by_method.get("flowgrpo")
        if not base:
            continue
        target, base_time = median([c[-1]["reward"] for c in base]), median([c[-1]["time"] for c in base])
        rows = {m: method_row(by_method[m], m, target, base_time) for m in methods if by_method.get(m)}
        for method, r in rows.items():
            reached = r["time"] != float("inf")
            colours = " / ".join(f"{k} {v:.2f}" for k, v in r["colours"].items()) or "-"
            time, ratio, samples = (f"{r['time']:.1f}", f"{r['ratio']:.3f}", f"{r['samples']:.0f}") if reached else \
                ("not reached", "-", "-")
            lines.append(f"| {task} | {method} | {len(by_method[method])} | {r['final']:.3f} | {colours} | {time} "
                         f"| {ratio} | {samples} | {r['off_at']:.3f} ({r['off_final']:.3f}) | {r['diversity']:.3f} "
                         f"| {r['total']:.1f} |")
        others = {m: r for m, r in rows.items() if m != "flowgrpo"}
        if others:
            best, r = min(others.items(), key=lambda item: item[1]["ratio"])
            base_off = rows["flowgrpo"]["off_final"]
            met = r["ratio"] <= 1 / 8 and r["off_at"] >= base_off
            goals.append(f"{task}: fastest {best} at {r['ratio']:.3f}x FlowGRPO's time (goal <= 0.125: "
                         f"{'met' if r['ratio'] <= 1 / 8 else 'not met'}, {1 / r['ratio']:.1f}x faster), off-target "
                         f"reward there {r['off_at']:.3f} vs FlowGRPO's final {base_off:.3f} "
                         f"({'no worse' if r['off_at'] >= base_off else 'worse'}): goal {'MET' if met else 'NOT MET'}")
    return lines + [""] + goals


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
    parser.add_argument("--guards", action="store_true", help="also every method with each of GUARDS where it loads")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "time_to_reward")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "time_to_reward.png")
    parser.add_argument("--work", type=Path, default=Path("/tmp/unirl-time-to-reward"))
    parser.add_argument("--summarise", action="store_true", help="only print the table and plot of <out>.json")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    if args.guards:
        methods += [f"{m.partition('+')[0]}+{g}" for m in methods if "+" not in m for g in GUARDS]
    for m in methods:
        try:
            method_config(m)
        except ValueError as error:
            parser.error(str(error))
    if args.summarise:  # a finished or stopped benchmark's saved runs
        runs = json.loads(args.out.with_suffix(".json").read_text())
        print("\n".join(summarise(runs, [m for m in methods if any(m in r for r in runs.values())])))
        plot({t: {m: c for m, c in r.items() if c} for t, r in runs.items()}, args.plot)
        return 0
    run_id = time.strftime("%Y%m%d-%H%M%S")
    print(f"torch threads {torch.get_num_threads()}; load average {load_average()}", flush=True)
    tasks = args.tasks.split(",")
    runs = {}
    for task in tasks:  # the pairs the registry accepts (a guard needs the step means: FlowGRPO's SDE modes)
        kept, refused = valid_methods(task, methods)
        runs[task] = {m: [] for m in kept}
        for m, why in refused.items():
            print(f"{task} {m}: refused at config load: {why}", flush=True)
    for seed in range(args.seeds):  # seed by seed, so a stopped benchmark has every task and method
        for task in tasks:
            for method in runs[task]:  # interleaved: load changes hit every method alike
                curve = train_one(task, method, seed, args.steps, args.eval_every, args.work / run_id)
                runs[task][method].append(curve)
                last = curve[-1]
                print(f"{task} {method} seed {seed}: held-out {curve[0]['reward']:.3f} -> {last['reward']:.3f} "
                      f"{ {k: round(v, 3) for k, v in last['colours'].items()} } off-target {off_reward(last):.3f} "
                      f"in {last['time']:.1f} s, {last['samples']} sample-forwards; load average {load_average()}",
                      flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.with_suffix(".json").write_text(json.dumps(runs, indent=1))  # so far: kept if stopped
    lines = summarise(runs, methods)
    print("\n".join(lines))
    plot({t: {m: c for m, c in r.items() if c} for t, r in runs.items()}, args.plot)
    print(f"saved {args.out.with_suffix('.json')} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
