"""A diffusion training step split into model time and framework time.

    .venv/bin/python benchmarks/diffusion_step_split.py                      # tiny config, 12 steps
    .venv/bin/python benchmarks/diffusion_step_split.py --steps 20 sampling.max_sequence_length=128
    .venv/bin/python benchmarks/diffusion_step_split.py --hook-check         # cost of the instrumentation
    .venv/bin/python benchmarks/diffusion_step_split.py --against ../before  # another commit, step by step

Runs ``configs/diffusion/<config>.yaml`` (default ``tiny``: 8 prompts x 4 = 32 images, 8 SDE steps
all trained, CFG off, LoRA r8, one mini-batch, so one optimizer step) in this process with
``unirl.trainer.loop.Trainer`` and ``DiffusionEnvironment``, times each ``trainer.train_step()`` by wall clock
and splits it with instrumentation installed here (nothing in ``unirl/`` is changed):

=============  ==========================================================================================
column         what it contains
=============  ==========================================================================================
step           wall time of ``trainer.train_step()`` (perf_counter around the call)
sample fwd     transformer forwards with gradients off (the rollout's denoising steps): a timer around
               the ``forward`` of the diffusers transformer inside the PEFT wrapper (set on the instance,
               not as forward hooks, whose slow call path would add Python to the framework column), so
               LoRA layers are included and PEFT's wrapper call is not
train fwd      the same timer, forwards with gradients on (the update re-scoring the trained steps)
backward       ``accelerator.backward(loss)``: autograd through the transformer and the loss
vae decode     the VAE's ``decode`` (post-quant conv and decoder)
text enc       forwards of the text encoders (CLIP x2, T5): prompt encoding, tokenizers not included
optimizer      ``accelerator.clip_grad_norm_``, ``optimizer.step`` and ``optimizer.zero_grad``
reward         ``env.score``: the main thread waiting for the chunks scored in the reward thread, scoring
               the last chunk itself (with nothing left to sample it is not handed to a thread; the
               tiny config has one chunk), then combining the rewards. The reward functions' own
               time, wherever they ran, is printed below the table (not subtracted)
framework      step - all of the above: the sampler's and the SDE step's tensor work outside the
               transformer, storing the rollout, advantages, batching, the loss math, the LR
               scheduler, the EMA, metrics, Python. The SDE step's own share of it (``sde_step`` and
               ``step_log_prob``: noise draws, the step's mean and log-prob) is printed below the table
=============  ==========================================================================================

A second table attributes the framework time to the loop's stages (each stage's wall time minus the
columns above that ran inside it). On a GPU every timer synchronises the device first, so the columns
are device time plus launch; that synchronisation is itself a cost the uninstrumented run does not
pay. ``--hook-check`` alternates instrumented and bare steps and prints both medians and the median
difference of each instrumented step and the bare one after it: what the instrumentation costs (it
lands in the framework column).

``--against CHECKOUT`` compares with another commit without the machine's drift in between: make a
worktree of it (``git worktree add ../before <commit>``), and the script runs this checkout and that
one's ``unirl`` (through ``PYTHONPATH``, with this script's instrumentation) in two processes that take
their steps in turn, the order swapped at every step; it prints both tables and the step-by-step
difference of their framework time. Compare the framework columns only: two processes of the same
code ran their model columns 4% apart (355 and 370 ms steps; the speed of a process's kernels depends
on where its memory landed) while their framework times differed by +0.02 ms (median of 30 pairs). On the development VM, whose speed drifts by a third within
minutes, separate runs could not show a 2 ms change that this shows.

Timed runs on a shared machine: ``flock /tmp/bench.lock .venv/bin/python benchmarks/...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

COLUMNS = ("sample fwd", "train fwd", "backward", "vae decode", "text enc", "optimizer", "reward")
STAGES = ("rollout", "score", "advantages", "old_logprobs", "update", "sync")


class Split:
    """Per-step seconds by column and by loop stage, filled by the wrappers and hooks of ``instrument``."""

    def __init__(self, sync):
        self.sync = sync  # torch.cuda.synchronize on a GPU, a no-op on the CPU
        self.columns: dict[str, float] = defaultdict(float)
        self.stages: dict[str, float] = defaultdict(float)
        self.column_in_stage: dict[str, float] = defaultdict(float)
        self.reward_thread = 0.0
        self.sde = 0.0  # inside framework: the SDE step's tensor work (noise draws, mean, log-prob)
        self.stage: str | None = None
        self._open: tuple[str, float] | None = None  # the column being timed (no nesting: the outer one counts)
        self._lock = threading.Lock()
        self._main = threading.main_thread().ident

    def reset(self) -> None:
        self.columns.clear(), self.stages.clear(), self.column_in_stage.clear()
        self.reward_thread = 0.0
        self.sde = 0.0

    def begin(self, column: str) -> bool:
        if self._open is not None or threading.get_ident() != self._main:
            return False
        self.sync()
        self._open = (column, time.perf_counter())
        return True

    def end(self) -> None:
        self.sync()
        column, start = self._open
        self._open = None
        seconds = time.perf_counter() - start
        self.columns[column] += seconds
        self.column_in_stage[self.stage] += seconds


def instrument(trainer, split: Split):
    """Install the hooks and wrappers; returns a function that removes them all."""
    env, acc = trainer.env, trainer.accelerator
    restore = []

    def patch(obj, name, make):
        had_own = name in vars(obj)
        original = getattr(obj, name)
        setattr(obj, name, make(original))
        restore.append(lambda: setattr(obj, name, original) if had_own else delattr(obj, name))

    def timed_call(column):
        """A wrapper maker timing calls under ``column``: a name, or a function giving it at each call."""
        column_of = column if callable(column) else (lambda: column)

        def make(fn):
            def call(*args, **kwargs):
                opened = split.begin(column_of())
                try:
                    return fn(*args, **kwargs)
                finally:
                    if opened:
                        split.end()
            return call
        return make

    # Model forwards: the module's forward wrapped on the instance (the column depends on whether
    # gradients are on). Not forward hooks: with a hook registered every call takes nn.Module's slow
    # path, whose extra Python would land in the framework column.
    def hook_module(module, column_of):
        patch(module, "forward", timed_call(column_of))

    import torch

    hook_module(env.pipe.transformer, lambda: "train fwd" if torch.is_grad_enabled() else "sample fwd")
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if getattr(env.pipe, name, None) is not None:
            hook_module(getattr(env.pipe, name), lambda: "text enc")
    patch(env.vae, "decode", timed_call("vae decode"))
    patch(acc, "backward", timed_call("backward"))
    patch(acc, "clip_grad_norm_", timed_call("optimizer"))
    patch(trainer.optimizer, "step", timed_call("optimizer"))
    patch(trainer.optimizer, "zero_grad", timed_call("optimizer"))
    patch(env, "score", timed_call("reward"))

    # The reward functions, in the reward thread or the last chunk's in ``env.score`` (for information).
    def thread_timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with split._lock:
                    split.reward_thread += time.perf_counter() - start
        return call

    # The SDE step (sampler and re-scoring call it by these module-level names: sde_step, and
    # step_log_prob where a piece re-scores a stored step from its offset): part of the framework
    # column, printed on its own line as the algorithm's own tensor work.
    from unirl.diffusion import sampling

    def sde_timed(fn):
        def call(*args, **kwargs):
            split.sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                split.sync()
                split.sde += time.perf_counter() - start
        return call

    patch(sampling, "sde_step", sde_timed)
    if hasattr(sampling, "step_log_prob"):  # absent in an --against checkout older than it
        patch(sampling, "step_log_prob", sde_timed)

    original_fns = list(env.rewards.fns)
    env.rewards.fns = [thread_timed(fn) for fn in original_fns]
    restore.append(lambda: setattr(env.rewards, "fns", original_fns))

    # Loop stages (the trainer's own stage boundaries; same names as its time/* metrics).
    def stage_timed(stage):
        def make(fn):
            def call(*args, **kwargs):
                previous, split.stage = split.stage, stage
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    split.sync()
                    split.stages[stage] += time.perf_counter() - start
                    split.stage = previous
            return call
        return make

    patch(env, "rollout", stage_timed("rollout"))
    patch(trainer, "advantages", stage_timed("advantages"))
    patch(trainer, "old_and_reference", stage_timed("old_logprobs"))
    patch(trainer, "update", stage_timed("update"))
    patch(env, "sync_weights", stage_timed("sync"))
    patch(env, "score", stage_timed("score"))  # around the reward column's wrapper

    def remove():
        for undo in reversed(restore):
            undo()

    return remove


def build_trainer(config: str, overrides: list[str], run_dir: Path):
    from unirl.cli import load_run_config
    from unirl.config import config_to_dict
    from unirl.diffusion.env import DiffusionEnvironment
    from unirl.trainer.loop import Trainer

    cfg = load_run_config("diffusion", config, ["trainer.eval_every=0", "trainer.progress=false",
                                                "trainer.save_every=0", *overrides], output_dir=str(run_dir))
    trainer = Trainer(DiffusionEnvironment(cfg), algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=run_dir,
                      config_dict=config_to_dict(cfg))
    trainer.setup()
    return trainer, cfg


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"device {device}, Python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="config overrides key=value")
    parser.add_argument("--config", default="tiny", help="diffusion config name or path (default tiny)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps after the warm-up (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first and not counted (default 2)")
    parser.add_argument("--hook-check", action="store_true",
                        help="alternate instrumented and bare steps and compare their medians")
    parser.add_argument("--against", metavar="CHECKOUT",
                        help="also run the unirl package of another checkout (a git worktree of an older commit), "
                             "in a second process, the two taking steps in turn; prints both tables and the "
                             "step-by-step difference of their framework time")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one side of --against
    return parser.parse_args(argv)


class StepRunner:
    """The trainer of one configuration and its instrumentation; ``step()`` runs and splits one step."""

    def __init__(self, args):
        import diffusers
        import torch
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        run_dir = Path(tempfile.mkdtemp(prefix="unirl-diffusion-split-")) / "run"
        self.trainer, self.cfg = build_trainer(args.config, args.overrides, run_dir)
        cuda = self.trainer.accelerator.device.type == "cuda"
        self.split = Split(torch.cuda.synchronize if cuda else (lambda: None))

    def step(self, hooked: bool = True) -> dict:
        split = self.split
        remove = instrument(self.trainer, split) if hooked else None
        split.reset()
        split.sync()
        start = time.perf_counter()
        metrics = self.trainer.train_step()
        split.sync()
        wall = time.perf_counter() - start
        if remove is not None:
            remove()
        return {"step": wall, "hooked": hooked, **{c: split.columns.get(c, 0.0) for c in COLUMNS},
                "reward thread": split.reward_thread, "sde": split.sde,
                **{f"stage {s}": split.stages.get(s, 0.0) for s in STAGES},
                **{f"in {s}": split.column_in_stage.get(s, 0.0) for s in STAGES},
                "check": (metrics["reward/mean"], metrics.get("loss/total", float("nan")))}

    def close(self) -> None:
        self.trainer.env.close()


def report(rows: list[dict], bare: list[dict], checks: list[tuple], args, cfg, label: str = "") -> None:
    """The tables of one run: the medians of ``rows`` (instrumented timed steps) and the checks of every step."""
    def med(key):
        return statistics.median(r[key] for r in rows)

    framework = [r["step"] - sum(r[c] for c in COLUMNS) for r in rows]
    s, b = cfg.sampling, cfg.trainer
    print(f"\n{label}{sys.executable} {' '.join(sys.argv)}")
    print(f"config {args.config}: {b.prompts_per_step} prompts x {b.group_size} = {b.prompts_per_step * b.group_size} "
          f"images at {s.resolution} px, {s.num_steps} steps (timestep_fraction {s.timestep_fraction}), guidance "
          f"{s.guidance_scale} (train_cfg {s.train_cfg}), max_sequence_length {s.max_sequence_length}, LoRA "
          f"{'r' + str(cfg.model.lora.r) if cfg.model.lora.enabled else 'off'}, EMA {cfg.ema.enabled}")
    print(machine())
    print(f"median over {len(rows)} steps after {args.warmup} warm-up steps")
    print("\n| " + " | ".join(("step",) + COLUMNS + ("framework", "framework share")) + " |")
    print("|" + "---|" * (len(COLUMNS) + 3))
    cells = [f"{med('step') * 1000:.0f} ms"] + [f"{med(c) * 1000:.1f} ms" for c in COLUMNS]
    share = statistics.median(f / r["step"] for f, r in zip(framework, rows))
    cells += [f"{statistics.median(framework) * 1000:.1f} ms", f"{share:.1%}"]
    print("| " + " | ".join(cells) + " |")
    print(f"\nreward functions (pool chunks overlap sampling; the last chunk runs inside the reward column): "
          f"{med('reward thread') * 1000:.1f} ms")
    sde_share = statistics.median(r["sde"] / r["step"] for r in rows)
    rest = statistics.median((f - r["sde"]) / r["step"] for f, r in zip(framework, rows))
    print(f"of the framework column, the SDE step's tensor work (Gaussian noise drawn from the run's CPU generator, "
          f"step mean, log-prob; sampler and re-scoring): {med('sde') * 1000:.1f} ms ({sde_share:.1%} of the step); "
          f"the rest: {rest:.1%} of the step")

    # Framework time by loop stage: the stage's wall minus the columns timed inside it.
    print("\n| loop stage | wall | model/optimizer/reward columns inside | framework |")
    print("|---|---|---|---|")
    for stage in STAGES:
        wall, inside = med(f"stage {stage}"), med(f"in {stage}")
        print(f"| {stage} | {wall * 1000:.1f} ms | {inside * 1000:.1f} ms | "
              f"{statistics.median(r[f'stage {stage}'] - r[f'in {stage}'] for r in rows) * 1000:.1f} ms |")
    glue = [r["step"] - sum(r[f"stage {st}"] for st in STAGES) for r in rows]
    print(f"| between stages (metrics, loop glue) | {statistics.median(glue) * 1000:.1f} ms | | "
          f"{statistics.median(glue) * 1000:.1f} ms |")

    if bare:
        paired = [h["step"] - b["step"] for h, b in zip(rows, bare)]  # each instrumented step and the bare one after it
        print(f"\nhook check: instrumented steps median {med('step') * 1000:.1f} ms ({len(rows)}), bare steps median "
              f"{statistics.median(r['step'] for r in bare) * 1000:.1f} ms ({len(bare)}); instrumented minus the next "
              f"bare step: median {statistics.median(paired) * 1000:+.2f} ms, mean {statistics.mean(paired) * 1000:+.2f} ms")
    print("\nreward/mean, loss/total per step:", ", ".join(f"{r:.4f}/{l:.4g}" for r, l in checks))


def framework_of(row: dict) -> float:
    return row["step"] - sum(row[c] for c in COLUMNS)


def worker(args) -> None:
    """One side of ``--against``: a step per line read from stdin, its row written as JSON to stdout."""
    runner = StepRunner(args)
    print(json.dumps({"ready": True}), flush=True)
    try:
        for _ in sys.stdin:
            print(json.dumps(runner.step()), flush=True)
    finally:
        runner.close()


def read_json(proc: subprocess.Popen, dead: str) -> dict:
    """The worker's next JSON line (anything else a library printed to stdout is passed on)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{dead} (exit status {proc.wait()})")
        if line.startswith("{"):
            return json.loads(line)
        sys.stdout.write(line)


def against(args) -> None:
    """This checkout and ``args.against`` in two processes, taking their steps in turn (the order
    swapped at every step), so a drift of the machine's speed reaches both sides alike."""
    here = [sys.executable, str(Path(__file__).resolve()), "--worker", "--config", args.config, *args.overrides]
    other_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(args.against).resolve()),
                                                                             os.environ.get("PYTHONPATH")]))}
    sides = {"this checkout": os.environ, f"--against {args.against}": other_env}
    procs = {name: subprocess.Popen(here, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for name, env in sides.items()}
    rows: dict[str, list[dict]] = {name: [] for name in procs}
    try:
        for name, proc in procs.items():
            read_json(proc, f"the {name} worker exited before its first step")
        for i in range(args.warmup + args.steps):
            for name in (list(procs) if i % 2 == 0 else list(procs)[::-1]):
                procs[name].stdin.write("step\n")
                procs[name].stdin.flush()
                rows[name].append(read_json(procs[name], f"the {name} worker exited at step {i}"))
    finally:
        for proc in procs.values():
            with contextlib.suppress(OSError):
                proc.stdin.close()
            proc.wait()
    from unirl.cli import load_run_config

    cfg = load_run_config("diffusion", args.config, list(args.overrides))
    for name, side in rows.items():
        report(side[args.warmup:], [], [tuple(r["check"]) for r in side], args, cfg, label=f"[{name}] ")
    timed = {name: side[args.warmup:] for name, side in rows.items()}
    (a, a_rows), (b, b_rows) = timed.items()
    diff = [framework_of(x) - framework_of(y) for x, y in zip(a_rows, b_rows)]
    print(f"\nframework time, {a} minus {b}, step by step: median {statistics.median(diff) * 1000:+.2f} ms, "
          f"mean {statistics.mean(diff) * 1000:+.2f} ms over {len(diff)} step pairs")


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    if args.against:
        return against(args)
    runner = StepRunner(args)
    rows, bare, checks = [], [], []
    try:
        for i in range(args.warmup + args.steps):
            row = runner.step(hooked=not (args.hook_check and i % 2))
            checks.append(row["check"])
            if i >= args.warmup:
                (rows if row["hooked"] else bare).append(row)
    finally:
        runner.close()
    report(rows, bare, checks, args, runner.cfg)


if __name__ == "__main__":
    main()
