"""Quiet by default: the libraries unirl drives log warnings and errors only, unless ``--verbose``.

vLLM, transformers, diffusers and Accelerate log at INFO (and draw their own progress bars) during
start-up and loading; a run's own output is its progress bar and the lines unirl prints. One
warning is dropped outright: see ``RotaryReloadFilter``.
"""

from __future__ import annotations

import logging
import os

_LIBRARIES = ("vllm", "transformers", "diffusers", "accelerate", "peft", "torch.distributed", "httpx")


def configure(verbose: bool = False) -> None:
    """Set the libraries' log level (WARNING, or INFO with ``verbose``) and their loading bars.

    Call before the libraries are imported where possible: vLLM reads ``VLLM_LOGGING_LEVEL`` when
    it configures its logger at import."""
    level = logging.INFO if verbose else logging.WARNING
    os.environ.setdefault("VLLM_LOGGING_LEVEL", logging.getLevelName(level))
    for name in _LIBRARIES:
        logging.getLogger(name).setLevel(level)
    if not verbose:
        logging.getLogger("transformers.utils.import_utils").addFilter(TorchvisionFallbackFilter())
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_warning()
            hf_logging.disable_progress_bar()  # "Loading weights" bars on every from_pretrained
        except ImportError:  # pragma: no cover - transformers is a dependency
            pass
        try:
            from diffusers.utils import logging as diffusers_logging

            diffusers_logging.set_verbosity_warning()
            diffusers_logging.disable_progress_bar()  # "Loading pipeline components..."
        except ImportError:  # pragma: no cover - diffusers is a dependency
            pass


class TorchvisionFallbackFilter(logging.Filter):
    """Drops transformers' ``X requires torchvision (not installed); falling back to XPil``.

    diffusers' SD3 pipeline module imports CLIP/SigLIP image processors, and the CPU install leaves
    torchvision out (PyPI's build does not import beside the CPU torch). The PIL processors it falls
    back to compute the same thing; unirl's image rewards feed them PIL images anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("requires torchvision (not installed)" in message and "falling back to" in message)


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's ``RotaryEmbedding: Failed to load weights``, logged at every weight sync.

    Why it is harmless: vLLM's layer-wise reload (``reload_weights``) expects every layer that holds
    tensors to receive some from the checkpoint. Its ``RotaryEmbedding`` holds only a
    ``cos_sin_cache`` buffer computed from the model config (rope theta, head size), which no HF
    checkpoint contains (HF's ``inv_freq`` is a non-persistent buffer), so the reload finds nothing
    for it, warns, and puts the layer's own cache back unchanged. The weights that do change are
    loaded; ``tests/test_vllm_engine.py`` checks the synced engine's log-probs against the trainer's.
    Any other layer's failure still gets through.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def silence_rotary_reload_warning() -> None:
    """Attach ``RotaryReloadFilter`` to the vLLM logger that emits it (idempotent)."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(RotaryReloadFilter())
