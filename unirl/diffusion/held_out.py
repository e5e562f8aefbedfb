"""The diffusion environment's held-out evaluation during training: deterministic (ODE) images of the test
prompts with the EMA weights, scored by the run's rewards, drawn on the evaluation grid.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from unirl.diffusion.frames import write_grid
from unirl.diffusion.offtarget import evaluation_figures, evaluation_parts
from unirl.diffusion.sampling import sample_with_logprob, to_pil


@torch.no_grad()
def sample_deterministic(env, rows: list[dict], positions: list[int] | None = None) -> list:
    """Images from the ODE sampler (noise 0, ``eval_num_steps``, ``guidance_scale``) with fixed seeds, for
    prompt rows (``{"prompt": ...}``, with an ``image`` for a family that takes one).

    ``positions`` [n]: where each row sits in the whole evaluation set (default 0..n-1); the
    initial noise depends on the position only, so a process sampling a share of the prompts
    draws the same images as one process sampling them all."""
    s, device = env.cfg.sampling, env.accelerator.device
    positions = list(range(len(rows))) if positions is None else positions
    if not rows:
        return []
    generator = torch.Generator().manual_seed(env.cfg.trainer.seed + 12_345)
    noise = env.family.noise(max(positions) + 1, env.latent_shape, generator)[positions]
    stochastic = torch.zeros(s.eval_num_steps, dtype=torch.bool)
    images = []
    for lo in range(0, len(rows), s.chunk_size):
        chunk = rows[lo:lo + s.chunk_size]
        encoded = env.encode(chunk)
        out = sample_with_logprob(env.family, env.model, noise[lo:lo + len(chunk)].to(device),
                                  env.eval_sigmas.to(device), env.eval_timesteps.to(device),
                                  env.cond(encoded, s.guidance_scale), guidance_scale=s.guidance_scale,
                                  noise_level=0.0, stochastic=stochastic)
        images += to_pil(env.family.decode(env.pipe, out.final))
    return images


def held_out_evaluation(env, step: int, run_dir: Path) -> tuple[dict[str, float], dict]:
    """Deterministic (ODE) images of the held-out prompts with the EMA weights, scored by the
    config's rewards. With several processes each samples every world-th prompt and the scores
    (and the grid's images) are gathered; the main process writes ``eval/step_N.png`` (videos: their
    first frames, and ``eval/step_N.gif`` playing them), and
    ``eval/step_N.jsonl`` with a judge reward's answers when one is configured."""
    if not env.test_rows:
        return {}, {}
    from accelerate.utils import gather_object

    acc, k = env.accelerator, env.cfg.data.grid_size
    mine = list(range(acc.process_index, len(env.test_rows), acc.num_processes))
    rows = [env.test_rows[i] for i in mine]
    with env.ema_weights():
        images = env.sample_deterministic(rows, mine)
    media = {}
    comps, judged = {}, {}  # judged: a judge reward's answers, by reward
    if rows:
        columns = {c: [row.get(c) for row in rows] for c in rows[0] if c != "prompt"}
        comps = env.rewards.components(images, prompts=[row["prompt"] for row in rows], columns=columns, texts=judged)
    # Off-target figures of each image (offtarget.py): gathered with the scores, averaged below.
    off = evaluation_parts(env, images, rows) if env.cfg.offtarget.enabled else [None] * len(rows)
    local = [(i, {name: float(v[j]) for name, v in comps.items()}, images[j] if i < k else None,
              {name: v[j] for name, v in judged.items()}, off[j]) for j, i in enumerate(mine)]
    results = sorted(gather_object(local) if acc.num_processes > 1 else local, key=lambda res: res[0])
    comps = {name: torch.tensor([res[1][name] for res in results]) for name in env.rewards.names}
    total, _ = env.rewards.combine(comps, torch.arange(len(results)))
    out = {f"eval/reward/{name}": v.nanmean().item() for name, v in comps.items()}
    out["eval/reward"] = total.mean().item()
    if env.cfg.offtarget.enabled:  # the held-out reward beside the figures that are not optimised
        out.update({"offtarget/eval/reward": out["eval/reward"], **evaluation_figures([res[4] for res in results])})
    if acc.is_main_process:
        shown = results[:k]
        captions = [f"{env.test_rows[i]['prompt']}\n" + " ".join(f"{name}={v:.3f}" for name, v in scores.items())
                    for i, scores, _, _, _ in shown]
        path = Path(run_dir) / "eval" / f"step_{step:06d}.png"
        grid = write_grid([image for _, _, image, _, _ in shown], captions, path, fps=env.cfg.video.fps)
        if any(judge for _, _, _, judge, _ in results):  # a judge's reasons beside its scores
            with open(path.with_suffix(".jsonl"), "w") as f:
                for i, scores, _, judge, _ in results:
                    f.write(json.dumps({"prompt": env.test_rows[i]["prompt"], **scores, "judge": judge}) + "\n")
        media = {"images": {"eval/grid": grid}}  # for the trackers
    return out, media
