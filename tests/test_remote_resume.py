"""Resume against a new rollout server is exact (issue 51): a run whose server was replaced between its
checkpoint and its resume trains on the same samples as the uninterrupted run, because the trainer holds
everything that decides them (each sampling call's seed, from the run's seed and the batch; the weights, pushed
before the first generation), never the server's own random state.

The servers run in threads of this process (cheap: no vLLM, no second interpreter), over the transformers
engine. A server process samples an unseeded request from its own generator, which starts again from its
seed when the server is restarted; ``OwnGenerator`` gives each in-thread server such a generator of its own,
so the in-thread servers differ from a replaced process exactly where a real one does."""

from __future__ import annotations

import threading

import pytest
import torch

from unirl.cli import load_run_config
from unirl.text.env import TextEnvironment
from unirl.trainer.loop import Preempted, Trainer

from stage_helpers import sigterm_after  # tests/stage_helpers.py

ARGS = ["rollout.engine=hf", "rollout.max_new_tokens=8", "trainer.prompts_per_step=4", "trainer.group_size=4",
        "trainer.mini_batch_size=16", "trainer.micro_batch_size=16", "trainer.eval_every=0", "trainer.save_every=0",
        "trainer.progress=false", "optim.lr=1e-2", "trainer.total_steps=5",
        # a loss whose gradient is never zero (the tiny model's rewards are often all 0 here): the weights change
        # every step, so a server left at its starting weights would sample otherwise
        "algo.entropy_coef=0.01"]


class OwnGenerator:
    """A server's engine (the transformers engine on its own copy of the model) whose unseeded calls sample from a
    generator of the server's own, seeded at start, as a server process's do (its global generator); a seeded
    call samples from its seed, as any engine's."""

    def __init__(self, engine, seed: int = 0):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.state = torch.Generator().manual_seed(seed).get_state()

    def generate(self, prompt_ids, seed=None, **sampling):
        if seed is not None:
            return self.engine.generate(prompt_ids, seed=seed, **sampling)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.state)
            out = self.engine.generate(prompt_ids, **sampling)
            self.state = torch.get_rng_state()
        return out

    def __getattr__(self, name):  # load_weights, close ...: the engine's
        return getattr(self.engine, name)


def serve(model_dir):
    """A fresh rollout server in a thread (its own copy of the starting weights, its generator at its seed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unirl.rollout.hf import HFEngine
    from unirl.rollout.server import RolloutService, make_app
    from unirl.rollout.weight_channel import served_params
    from unirl.serving.guards import Guards
    from unirl.serving.server import AppServer

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine.with_own_copy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tok, "cpu")
    guards = Guards.from_settings("serve-rollout", max_body_mb=64, body_timeout_s=60, token=None,
                                  token_env="UNIRL_ROLLOUT_TOKEN")
    service = RolloutService(OwnGenerator(engine), "tiny", params=served_params(str(model_dir)))
    server = AppServer(make_app(service, guards, guards), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop(server) -> None:
    server.shutdown()
    server.server_close()


def _figures(rows: list[dict]) -> list[dict]:
    """The figures a run's math gives (wall-clock and machine figures left out)."""
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))} for row in rows]


def _trainer(tmp_path, name: str, server, route: str, *extra: str) -> Trainer:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    where = [f"source.urls=[{url}]"] if route == "urls" else ["rollout.engine=server", f"rollout.server_url={url}"]
    cfg = load_run_config("text", "tiny", [*ARGS, *where, *extra], output_dir=str(tmp_path / name))
    return Trainer.from_config(TextEnvironment(cfg), cfg)


def test_a_batchs_calls_are_seeded_by_the_run_and_the_batch_only():
    from unirl.rollout.engine import CALL_SEED_STRIDE, CallSeeds, batch_seed

    seeds = CallSeeds(7)
    taken = seeds.scoped(lambda batch, calls: [seeds.take() for _ in range(calls)])
    assert seeds.take() is None  # outside a batch: the server's own generator
    first = taken(3, 2)
    assert first == [batch_seed(7, 3), batch_seed(7, 3) + CALL_SEED_STRIDE]
    assert taken(4, 1) == [batch_seed(7, 4)] and taken(3, 2) == first  # counted from 0 again, whatever came before
    assert CallSeeds(8).scoped(lambda batch: CallSeeds(8).take())(3) is None  # another object's scope is not its own
    assert len({batch_seed(s, b) for s in range(20) for b in range(20)}) == 400
    assert seeds.take() is None


@pytest.mark.parametrize("route,staleness", [("urls", 0), ("urls", 1), ("server_url", 1)])
def test_a_resume_against_a_new_server_trains_on_the_uninterrupted_runs_samples(tmp_path, tiny_lm_dir, route, staleness):
    """``source.urls`` (``RemoteEngine``) and ``rollout.engine=server`` (``ServerEngine``), each batch sampled when
    the step asks and ahead of it (the checkpoint then holds batch 3, sampled by the server that went)."""
    k = f"source.max_staleness={staleness}"
    server = serve(tiny_lm_dir)
    try:
        whole = _trainer(tmp_path, "whole", server, route, k).train()
    finally:
        stop(server)

    server = serve(tiny_lm_dir)
    try:  # SIGTERM during step 3: the checkpoint holds steps 1..3 (and, sampling ahead, batch 3)
        stopped = _trainer(tmp_path, "split", server, route, k)
        sigterm_after(stopped, 3)
        with pytest.raises(Preempted, match="after step 3"):
            stopped.train()
    finally:
        stop(server)  # the server goes; a new one, at its own seed and the starting weights, replaces it

    server = serve(tiny_lm_dir)
    try:
        resumed = _trainer(tmp_path, "split", server, route, k, "trainer.resume=true").train()
    finally:
        stop(server)
    assert len(resumed) == 2 and all(row["actor/grad_norm"] > 0 for row in whole)
    assert _figures(resumed) == _figures(whole[3:])
