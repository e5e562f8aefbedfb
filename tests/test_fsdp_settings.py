"""FSDP2's settings and the sharded checkpoint format's arithmetic, without starting processes."""

from __future__ import annotations

import pytest
import torch

from unirl.trainer.sharded_state import Sharded, _read_rows, materialise
from unirl.trainer.state_files import Piece, chunk_range


@pytest.mark.parametrize("n,world,expected", [
    (7, 2, [(0, 4), (4, 7)]),            # torch.chunk(7 rows, 2): 4 + 3
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),  # ceil(5/4) = 2 rows each: the last process holds none
    (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (0, 2, [(0, 0), (0, 0)]),
])
def test_chunk_range_is_torch_chunk(n, world, expected):
    assert [chunk_range(n, world, r) for r in range(world)] == expected
    rows = torch.arange(n)
    chunks = list(torch.chunk(rows, world)) if n else []
    for r, (start, stop) in enumerate(expected):
        assert rows[start:stop].tolist() == (chunks[r].tolist() if r < len(chunks) else [])


def test_rows_come_from_the_pieces_that_hold_them():
    whole = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    saved = Sharded([Piece(whole[0:4], 0, 0, (7, 3)), Piece(whole[4:7], 0, 4, (7, 3))])  # written by 2 processes
    for start, stop in [(0, 7), (0, 2), (2, 6), (3, 5), (4, 7), (6, 7), (7, 7)]:  # 3 processes' or 1's ranges
        torch.testing.assert_close(_read_rows(saved, 0, start, stop), whole[start:stop], rtol=0, atol=0)
    torch.testing.assert_close(materialise(saved), whole, rtol=0, atol=0)


def _config(*overrides):
    from unirl.cli.train import load_run_config

    return load_run_config("text", "tiny", list(overrides))


def test_fsdp_settings_are_checked():
    cfg = _config("trainer.strategy=fsdp2", "trainer.fsdp.offload=params", "rollout.sleep_level=2")
    assert (cfg.trainer.strategy, cfg.trainer.fsdp.offload, cfg.rollout.sleep_level) == ("fsdp2", "params", 2)
    assert _config().trainer.strategy == "ddp" and _config().trainer.fsdp.offload == "none"
    for bad, named in [("trainer.strategy=fsdp", "strategy"), ("trainer.fsdp.offload=optimizer", "offload"),
                       ("rollout.sleep_level=3", "sleep_level"), ("rollout.sync_bucket_mb=0", "sync_bucket_mb")]:
        with pytest.raises(Exception, match=named):
            _config(bad)
    with pytest.raises(Exception, match="fp16"):
        _config("trainer.strategy=fsdp2", "trainer.mixed_precision=fp16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU runs")
def test_vllm_sleep_is_refused_on_cpu(tiny_lm_dir):
    from accelerate import Accelerator

    from unirl.text.env import TextEnvironment

    cfg = _config("rollout.engine=vllm", "rollout.sleep_level=1")
    env = TextEnvironment(cfg)
    with pytest.raises(ValueError, match="rollout.sleep_level=1: vLLM sleeps only on GPUs"):
        env.setup(Accelerator(cpu=True))
    env.close()
