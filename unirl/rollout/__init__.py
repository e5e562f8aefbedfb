"""The rollout layer: engines that sample (``engine``: the ``Engine`` contract and its registry; ``vllm``,
``hf``, ``server_client``), the one path by which the policy's weights reach them (``weights``), the batch
sources the training loop pulls scored batches from (``sources``: inline, threaded, remote), and the rollout
server that serves an engine over HTTP (``server``, with its ``weight_channel``).

Submodules are imported on use, so that ``import unirl.rollout`` stays cheap.
"""

from unirl.rollout.engine import ENGINES, Engine, EngineContext, Generation, register_engine
from unirl.rollout.engines import build_engine

__all__ = ["ENGINES", "Engine", "EngineContext", "Generation", "build_engine", "register_engine"]
