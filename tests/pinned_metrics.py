"""The first steps of every shipped tiny config, pinned: a restructuring must not change a number a run
produces (issue 31). ``tests/fixtures/pinned_metrics.json`` holds each config's per-step metrics for
``STEPS`` steps, written once from the code before a change:

    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 python tests/pinned_metrics.py --write   # every tiny config
    python tests/pinned_metrics.py text tiny          # print one config's figures
    UNIRL_PINNED_ONLY=diffusion/tiny_colour,diffusion/tiny_colour_nft pytest tests/test_pinned_metrics.py
                                                      # only those configs (test and --write alike)

``tests/test_pinned_metrics.py`` runs each config again and compares every figure (``time/*`` and
``perf/*`` are wall-clock or machine figures and are left out). Runs are forced onto the CPU with a
fixed thread count and run in one process in the fixture's order. The comparison is to 1e-5 relative
(1e-6 absolute), not bit for bit: the unchanged code does not repeat bit for bit here. Measured on the
code before the restructuring, the same tiny_ppo run in a fresh process and third in a shared one
agree exactly at step 1 (the sampled tokens, rewards and first update) and then differ in the last
bits of the updated weights (step 2: ``actor/grad_norm`` 1.6062171 vs 1.6062168, ``adv/mean``
+3.2e-8 vs -3.2e-8, a group mean of zero), so a 1e-7-relative drift is the noise floor; a change in
the math (another clip, estimator, normaliser or sample) moves figures by far more than 1e-5.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "pinned_metrics.json"
STEPS = 3
THREADS = 2
ALL_CONFIGS = [("text", "tiny"), ("text", "tiny_dapo"), ("text", "tiny_ppo"), ("text", "tiny_search"),
               ("diffusion", "tiny"), ("diffusion", "tiny_colour"), ("diffusion", "tiny_colour_nft"),
               ("diffusion", "tiny_flux"), ("diffusion", "tiny_kontext"), ("diffusion", "tiny_qwenimage"),
               ("diffusion", "tiny_wan")]
#: Machine figures, not a function of the code's math: wall-clock times (a tool call's latency too),
#: memory and throughput.
SKIPPED_PREFIXES = ("time/", "perf/", "rollout/tool_latency_s")
#: Figures that measure float noise itself: the gap between the engine's and the trainer's log-probs of
#: the same tokens (~1e-6 in float32) moves with the last bits of the weights, so it is compared to 1e-5
#: absolute (the other figures: 1e-5 relative, 1e-6 absolute).
NOISE_FIGURES = ("rollout/logprob_diff_", "rollout/mismatch_")


def only(configs: list[tuple[str, str]], names: str | None) -> list[tuple[str, str]]:
    """``configs`` narrowed to ``names`` (``env/name`` comma-separated, ``UNIRL_PINNED_ONLY``), in the
    fixture's order: a change checks the configs it touches without running all eleven on a shared
    machine. None or empty: all of them."""
    if not names:
        return list(configs)
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - {f"{e}/{n}" for e, n in configs}
    if unknown:
        raise ValueError(f"UNIRL_PINNED_ONLY: unknown config(s) {sorted(unknown)}; pinned: "
                         f"{', '.join(f'{e}/{n}' for e, n in configs)}")
    return [(e, n) for e, n in configs if f"{e}/{n}" in wanted]


CONFIGS = only(ALL_CONFIGS, os.environ.get("UNIRL_PINNED_ONLY"))


def fingerprint() -> dict:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"torch": torch.__version__, "cpu": cpu, "threads": THREADS}


def run_config(env: str, name: str) -> list[dict[str, float]]:
    """``STEPS`` training steps of the shipped config, on the CPU, without evaluation or checkpoints."""
    import torch

    torch.set_num_threads(THREADS)
    import unirl

    with tempfile.TemporaryDirectory(prefix="unirl-pinned-") as tmp:
        result = unirl.train(env, name, {"trainer.total_steps": STEPS, "trainer.eval_every": 0,
                                         "trainer.save_every": 0, "trainer.progress": False},
                             output_dir=Path(tmp) / "run", progress=False)
    return [{k: v for k, v in m.items() if not k.startswith(SKIPPED_PREFIXES)} for m in result.metrics]


def run_all(configs) -> dict[str, list[dict[str, float]] | str]:
    """Each config's ``run_config`` in this process, one after another (``unirl.train`` runs repeat in
    one process: each closes its engine and process group); a config that fails gives its error. The toys
    they name come from the session's cache, built by whichever test asked first: a build runs on
    ``unirl.models.cache.BUILD_THREADS`` threads (two, as these were pinned with) whoever asks, so the
    same weights as a build here (tests/test_tiny_search.py)."""
    out: dict[str, list[dict[str, float]] | str] = {}
    for env, name in configs:
        try:
            out[f"{env}/{name}"] = run_config(env, name)
        except Exception as e:  # reported per config by the test
            out[f"{env}/{name}"] = f"{type(e).__name__}: {e}"
    return out


def run_in_subprocess(env: str, name: str) -> list[dict[str, float]]:
    """``run_config`` in a fresh process (each run starts its own accelerator and engine), CPU only."""
    return _subprocess([env, name, "--json"])


def run_all_in_subprocess() -> dict[str, list[dict[str, float]] | str]:
    """Every config of ``CONFIGS`` in one fresh CPU-only process (one Python and torch start-up, not eleven)."""
    return _subprocess(["--all", "--json"])


def _subprocess(args: list[str]):
    environ = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(THREADS),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    repo = Path(__file__).resolve().parents[1]
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, __file__, *args], env=environ, capture_output=True, text=True,
                          timeout=3000, cwd=repo)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--write":  # in this process, one config after another, as the test runs them
        pinned = {"fingerprint": fingerprint(), "steps": STEPS, "configs": {}}
        if FIXTURE.exists() and "--resume" in argv:  # a long write cut short keeps what it finished
            pinned["configs"] = json.loads(FIXTURE.read_text())["configs"]
        elif FIXTURE.exists() and CONFIGS != ALL_CONFIGS:  # narrowed: re-pin those, keep the others' figures
            kept = json.loads(FIXTURE.read_text())["configs"]
            pinned["configs"] = {k: v for k, v in kept.items() if tuple(k.split("/")) not in CONFIGS}
        for env, name in CONFIGS:
            if f"{env}/{name}" in pinned["configs"]:
                continue
            pinned["configs"][f"{env}/{name}"] = run_config(env, name)
            FIXTURE.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")
            print(f"{env}/{name}: {STEPS} steps", flush=True)
        return
    if argv and argv[0] == "--all":
        print(json.dumps(run_all(CONFIGS)))
        return
    env, name = argv[:2]
    metrics = run_config(env, name)
    print(json.dumps(metrics) if "--json" in argv else json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
