"""Peak memory of the diffusion update's forward+backward against the number of trained steps T.

    python benchmarks/diffusion_memory.py                 # resolution 128, T = 2, 4, 8, micro-batch 8
    python benchmarks/diffusion_memory.py --resolution 96 --steps 2 8

For each T, a fresh process builds the toy SD3 (``model.name_or_path=tiny``) at the given resolution,
samples a rollout of 8 images with T trained steps, then runs one micro-batch's forward and backward
twice over: ``stepwise`` (the loop's order since issue 9: each trained step is evaluated and
backpropagated before the next, FlowGRPO's order) and ``whole`` (all T steps evaluated, then one
backward: the graphs of every step alive at once). Two measures of what that call adds:

* ``in use``: the peak of the bytes held by malloc (glibc ``mallinfo2``: ``uordblks + hblkhd``),
  sampled every 0.2 ms by a watcher thread, minus the bytes held just before: what the autograd
  graph and the gradients take (on a GPU the same reading is ``torch.cuda.max_memory_allocated``);
* ``RSS``: the peak resident set (``/proc/self/status`` VmHWM, reset through
  ``/proc/self/clear_refs``) minus the resident set before, which also counts freed memory the
  allocator keeps (fragmentation), so it is noisier.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _MallocPeak:
    """Peak of glibc's in-use heap bytes while the context is open, sampled by a thread."""

    def __enter__(self):
        import ctypes
        import threading

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in
                        ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                         "fordblks", "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        self._read = lambda: (lambda m: m.uordblks + m.hblkhd)(libc.mallinfo2())
        self.before = self.peak = self._read()
        self._stop = threading.Event()

        def watch():
            while not self._stop.is_set():
                self.peak = max(self.peak, self._read())
                self._stop.wait(0.0002)

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())

    @property
    def added_mib(self) -> float:
        return (self.peak - self.before) / 2**20


def child(resolution: int, steps: int, mode: str) -> dict:
    import torch

    from unirl.cli import load_run_config
    from unirl.config import config_to_dict
    from unirl.diffusion.env import DiffusionEnvironment
    from unirl.trainer.loop import Trainer
    from unirl.trainer.update import micro_backward, mini_denominator

    torch.set_num_threads(1)
    cfg = load_run_config("diffusion", "tiny", [
        f"sampling.resolution={resolution}", f"sampling.num_steps={steps}", "trainer.prompts_per_step=2",
        "trainer.group_size=4", "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "trainer.eval_every=0",
        "trainer.progress=false", "trainer.reward_workers=0", "ema.enabled=false", "sampling.chunk_size=8",
    ], output_dir=str(Path(tempfile.mkdtemp()) / "run"))
    trainer = Trainer(DiffusionEnvironment(cfg), algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer,
                      run_dir=cfg.output_dir, config_dict=config_to_dict(cfg))
    trainer.setup()
    rollout = trainer.env.sampler.rollout(trainer.env.prompts.next(0), 4)
    trainer.advantages(rollout, torch.linspace(0, 1, len(rollout)))
    trainer.old_and_reference(rollout)
    if mode == "whole":
        trainer.env.column_slices = lambda batch: [slice(None)]
    denominator = mini_denominator(trainer, rollout)
    # The first update of the process: memory the allocator freed earlier would hide a later peak.
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set (VmHWM)
    before = _status_kib("VmRSS")
    with _MallocPeak() as heap:
        micro_backward(trainer, trainer.env.model, rollout, denominator, sync=True)
    peak = _status_kib("VmHWM")  # both include the LoRA gradients (small next to the graph)
    trainer.env.close()
    return {"resolution": resolution, "steps": steps, "mode": mode, "heap_mib": heap.added_mib,
            "rss_mib": (peak - before) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--child", nargs=3, metavar=("RESOLUTION", "STEPS", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), int(args.child[1]), args.child[2])))
        return
    rows = []
    for steps in args.steps:
        for mode in ("stepwise", "whole"):
            out = subprocess.run([sys.executable, __file__, "--child", str(args.resolution), str(steps), mode],
                                 check=True, capture_output=True, text=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"diffusion update, toy SD3 at {args.resolution} px, micro-batch 8: peak memory added by forward+backward")
    print("| trained steps T | stepwise: in use | stepwise: RSS | whole: in use | whole: RSS |")
    print("|---|---|---|---|---|")
    for steps in args.steps:
        got = {r["mode"]: r for r in rows if r["steps"] == steps}
        print(f"| {steps} | {got['stepwise']['heap_mib']:.0f} MiB | {got['stepwise']['rss_mib']:.0f} MiB "
              f"| {got['whole']['heap_mib']:.0f} MiB | {got['whole']['rss_mib']:.0f} MiB |")


if __name__ == "__main__":
    main()
