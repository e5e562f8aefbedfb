"""The second shape of the reward contract: a class for rewards backed by a model.

A ``ModelReward`` subclass is registered like a function (``@register_reward("pickscore",
modality="image")`` on the class). ``load_reward`` instantiates it once per run with the config's
``kwargs``; the instance is then called over each batch exactly like a reward function. It:

- loads its model once, lazily, on the first call (so ``unirl rewards list``, config checks and a
  reward that a run never reaches cost nothing), under a lock, since with
  ``trainer.reward_workers > 0`` two chunks may arrive at once;
- puts it on ``device``: by default this process's current CUDA device (Accelerate sets it per
  process, so every rank scores on its own GPU), else the CPU;
- scores in slices of ``batch_size`` samples, under ``torch.no_grad()``, so a large rollout does not
  run the reward model out of memory.

Subclasses implement ``load()`` and ``score(samples, *, prompts, **columns)``; a failure to load
is raised as ``RewardError`` (which ``score_batch`` passes through: re-scoring sample by sample
would only fail to load again).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from unirl.rewards.registry import RewardError, ScoresWithText

_DTYPES = ("float32", "float16", "bfloat16")


def default_device() -> str:
    """``cuda:<current device>`` when CUDA is available, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


class ModelReward:
    """Base class of model-based rewards. See the module docstring.

    Args:
        device: where the model runs; None picks ``default_device()`` at load time.
        dtype: ``float32``, ``float16`` or ``bfloat16`` for the model's weights.
        batch_size: samples per forward pass.
    """

    modality = "image"

    def __init__(self, *, device: str | None = None, dtype: str = "float32", batch_size: int = 16):
        if dtype not in _DTYPES:
            raise ValueError(f"{type(self).__name__}: dtype must be one of {_DTYPES}, got {dtype!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{type(self).__name__}: batch_size must be a positive integer, got {batch_size!r}")
        self.device = device
        self.dtype = dtype
        self.batch_size = batch_size
        self._loaded = False
        self._lock = threading.Lock()

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def load(self) -> None:
        """Load the model onto ``self.device`` (already resolved when this runs)."""
        raise NotImplementedError

    def score(self, samples: Sequence[Any], *, prompts: Sequence[str], **columns: Any) -> Sequence[float | None]:
        """Scores of one slice of at most ``batch_size`` samples."""
        raise NotImplementedError

    def ensure_loaded(self) -> None:
        with self._lock:
            if self._loaded:
                return
            if self.device is None:
                self.device = default_device()
            try:
                self.load()
            except Exception as err:
                raise RewardError(f"{type(self).__name__} could not load its model: {type(err).__name__}: {err}") from err
            self._loaded = True

    def __call__(self, samples: Sequence[Any], *, prompts: Sequence[str] | None = None, **columns: Any) -> list[float | None]:
        import torch

        self.ensure_loaded()
        n = len(samples)
        prompts = list(prompts) if prompts is not None else [""] * n
        out: list[float | None] = []
        texts: list[str] | None = []  # kept while every slice returns ScoresWithText
        for start in range(0, n, self.batch_size):
            stop = min(start + self.batch_size, n)
            part = {k: (v[start:stop] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in columns.items()}
            with torch.no_grad():
                scores = self.score(samples[start:stop], prompts=prompts[start:stop], **part)
            texts = texts + scores.texts if texts is not None and isinstance(scores, ScoresWithText) else None
            if hasattr(scores, "tolist"):
                scores = scores.tolist()
            out.extend(scores)
        return ScoresWithText(out, texts) if texts is not None and n else out
