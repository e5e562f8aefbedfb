"""The examples in docs/rewards.md run as written (the README copies the first one)."""

from __future__ import annotations

import re
from pathlib import Path


from unirl.rewards import registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "rewards.md"


def python_blocks(heading: str | None = None) -> list[str]:
    """The ```python blocks of docs/rewards.md, or those of the section under ``## heading``."""
    text = DOC.read_text()
    if heading is not None:
        start = text.index(f"\n## {heading}\n")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end > 0 else None]
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)




def test_write_your_own_reward_example_runs(isolated_registry):
    blocks = python_blocks("Write your own reward")
    assert blocks, "docs/rewards.md lost its '## Write your own reward' python block"
    namespace: dict = {}
    exec(compile(blocks[0], f"{DOC}:Write your own reward", "exec"), namespace)  # its asserts check the scores
    assert registry.reward_info("ends_with_period").description.startswith("bonus for an answer")


def test_every_python_block_runs(isolated_registry):
    blocks = python_blocks()
    assert len(blocks) >= 2
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC}:python block {i}", "exec"), {})


def test_readme_write_your_own_reward_example_runs(isolated_registry):
    readme = DOC.parents[1] / "README.md"
    text = readme.read_text()
    start = text.index("\n## Write your own reward\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"^```python\n(.*?)^```$", text[start:end if end > 0 else None], flags=re.S | re.M)
    assert blocks, "README.md lost its '## Write your own reward' python block"
    exec(compile(blocks[0], f"{readme}:Write your own reward", "exec"), {})  # its assert checks the scores
    assert registry.reward_info("ends_with_period").modality == "text"
