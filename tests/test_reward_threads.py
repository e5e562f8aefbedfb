"""A torch reward scored in the reward worker threads starts no second OpenMP team.

A second team (a torch operation run in a new thread makes that thread an OpenMP master) puts more
OpenMP threads than cores on a small machine, and libgomp then sleeps its idle threads after every
parallel region: the trainer's later operations got 2-3x slower (a 14 ms forward took 47 ms on
2 cores). The check counts the process's threads, which does not depend on the machine's load:
scoring in the pool adds the pool's thread and nothing else, while a plain thread running the same
reward adds its OpenMP helpers (the control that shows the check can fail).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

REWARD = '''
import torch

_W = torch.nn.Linear(256, 256)


def torch_score(completions, **kwargs):
    with torch.no_grad():
        x = torch.randn(len(completions), 256) @ torch.randn(256, 256)  # a parallel region
        return [float(v) for v in _W(x).sum(dim=-1)]
'''

SCRIPT = '''
import os, sys
from concurrent.futures import ThreadPoolExecutor
import torch
from unirl.config.schema import RewardConfig
from unirl.reward_set import RewardSet

threads = lambda: len(os.listdir("/proc/self/task"))
main_count = torch.get_num_threads()
torch.randn(64, 256) @ torch.randn(256, 256)  # the main thread's own team exists before we count
samples = ["a"] * 8
with RewardSet([RewardConfig(name=sys.argv[1] + ":torch_score")], workers=1) as rewards:
    rewards._pool.submit(lambda: 0).result()  # starts the pool's thread (and runs its initializer)
    before = threads()
    scores = rewards.submit(samples, prompts=samples, columns={}).result()["torch_score"]
    pool_added = threads() - before
    worker_count = rewards._pool.submit(torch.get_num_threads).result()
    after_pool = threads()
    plain = ThreadPoolExecutor(1)
    plain.submit(lambda: 0).result()
    before = threads()
    plain.submit(rewards.fns[0], samples).result()
    plain_added = threads() - before
print(pool_added, plain_added, worker_count, torch.get_num_threads(), main_count, len(scores))
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one OpenMP thread: no team to start")
def test_torch_reward_in_a_worker_starts_no_second_openmp_team(tmp_path):
    reward = tmp_path / "torch_reward.py"
    reward.write_text(textwrap.dedent(REWARD))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(reward)], capture_output=True, text=True, check=True)
    pool_added, plain_added, worker_count, main_after, main_before, n = map(int, out.stdout.split())
    assert n == 8
    assert pool_added == 0  # the pool's thread ran the reward on its own: no OpenMP helpers
    assert worker_count == 1
    assert main_after == main_before >= 2  # the trainer's thread keeps its threads
    assert plain_added == main_before - 1  # without the initializer: a team of main_before threads
