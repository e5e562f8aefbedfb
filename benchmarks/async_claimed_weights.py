"""Did the engine sample each asynchronous batch with exactly the weights the batch claims?

    python benchmarks/async_claimed_weights.py /tmp/claimed                       # the tiny recipe, staleness 1, 100 steps
    python benchmarks/async_claimed_weights.py /tmp/claimed source.bypass_mode=false trainer.seed=0

Runs the tiny recipe (vLLM) with ``source.max_staleness=1`` and, before each step learns, recomputes the
batch's log-probs with a copy of the trainer's weights at the batch's ``Rollout.policy_version`` and with
the current weights. Written to ``OUT/claimed_weights.jsonl``, one line a step: the largest and mean
``|engine_logp - claimed|`` (float noise if the engine sampled with those weights: torn weights, a stale
prefix cache or a wrong version would show here), the same against the current weights, and the KL from
the claimed to the current weights on the batch (one update's move). This is the check that showed the
staleness-1 collapse was no weight-sync bug (docs/async.md); the suite keeps a short version of it
(``tests/test_async_rollout.py::test_a_stale_batch_was_sampled_with_exactly_the_weights_it_claims``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from unirl.cli import load_run_config
from unirl.config import config_to_dict
from unirl.text.env import TextEnvironment
from unirl.trainer.logprobs import score_all
from unirl.trainer.loop import Trainer

DEFAULTS = ["trainer.total_steps=100", "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false",
            "rollout.gpu_memory_utilization=0.1", "algo.tis_cap=2.0", "source.max_staleness=1"]


class ClaimedWeights(Trainer):
    """Keeps the trainer's weights at each step's start and compares every batch's engine log-probs."""

    def __init__(self, *args, out: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.out = out.open("w")

    def async_train_step(self):
        model = self.accelerator.unwrap_model(self.env.model)
        self.versions[self.optimizer_steps] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for old in [v for v in self.versions if v < self.optimizer_steps - self.max_staleness]:
            del self.versions[old]
        return super().async_train_step()

    @torch.no_grad()
    def _gaps(self, rollout) -> dict[str, float]:
        model = self.accelerator.unwrap_model(self.env.model)
        now_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        now = score_all(self, self.env.model, rollout)["logp"]  # [N, T]
        version = int(rollout.policy_version[0])
        model.load_state_dict(self.versions[version])
        claimed = score_all(self, self.env.model, rollout)["logp"]  # [N, T]
        model.load_state_dict(now_state)
        mask = rollout.tensors["response_mask"].bool()
        off_claimed, off_now = (rollout.engine_logp - claimed).abs()[mask], (rollout.engine_logp - now).abs()[mask]
        return {"step": self.step + 1, "version": version, "trainer_version": self.optimizer_steps,
                "engine_vs_claimed_max": off_claimed.max().item(), "engine_vs_claimed_mean": off_claimed.mean().item(),
                "engine_vs_current_max": off_now.max().item(), "engine_vs_current_mean": off_now.mean().item(),
                "kl_claimed_to_current": (claimed - now)[mask].mean().item()}

    def learn(self, rollout, rewards, times=None):
        self.out.write(json.dumps({**self._gaps(rollout), "reward_mean": rewards.float().mean().item()}) + "\n")
        self.out.flush()
        return super().learn(rollout, rewards, times)


def main(out_dir: str, overrides: list[str]) -> None:
    cfg = load_run_config("text", "tiny", [*DEFAULTS, *overrides], output_dir=out_dir)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    trainer = ClaimedWeights(TextEnvironment(cfg), algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer,
                             run_dir=cfg.output_dir, config_dict=config_to_dict(cfg),
                             out=Path(out_dir) / "claimed_weights.jsonl")
    trainer.train()
    rows = [json.loads(line) for line in (Path(out_dir) / "claimed_weights.jsonl").read_text().splitlines()]
    worst = max(rows, key=lambda r: r["engine_vs_claimed_max"])
    moved = max(rows, key=lambda r: r["kl_claimed_to_current"])
    print(f"{len(rows)} steps: |engine - claimed weights| at most {worst['engine_vs_claimed_max']:.2e} (step "
          f"{worst['step']}); |engine - current weights| at most {max(r['engine_vs_current_max'] for r in rows):.2f}; "
          f"largest one-update KL on a batch {moved['kl_claimed_to_current']:.3f} (step {moved['step']})")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
