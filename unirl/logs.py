"""Quiet by default: a run's console holds its progress bar and unirl's own lines, unless ``--verbose``.

vLLM, transformers, diffusers, torch and Accelerate log at INFO (and draw their own progress bars)
during start-up and loading; ``configure`` lowers them to WARNING, and during a run ``RunOutput``
sends what is left (their warnings, their Python ``warnings``, and the C-level notices written
straight to the file descriptors while the models load) to ``RUN/run.log``. Warnings raised
outside those libraries (unirl's own, a user's reward file) still reach the console. One warning
is dropped outright: see ``RotaryReloadFilter``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import warnings
from pathlib import Path

_LIBRARIES = ("vllm", "transformers", "diffusers", "accelerate", "peft", "torch.distributed", "httpx")
#: Loggers whose records go to the run's log file during a quiet run.
_LOG_FILE_LOGGERS = ("vllm", "transformers", "diffusers", "accelerate", "peft", "torch", "httpx", "huggingface_hub",
                     "datasets", "triton")
#: Packages whose Python ``warnings`` go to the run's log file: their start-up notices (deprecations
#: inside vLLM, torch's and transformers' FutureWarnings), not about the user's input.
LIBRARY_PACKAGES = frozenset({"vllm", "torch", "transformers", "diffusers", "accelerate", "peft", "huggingface_hub",
                              "datasets", "triton", "safetensors", "tokenizers", "torchvision", "timm"})
#: The log file in the run directory.
LOG_NAME = "run.log"


def configure(verbose: bool = False, libraries: bool = True) -> None:
    """Set the libraries' log level (WARNING, or INFO with ``verbose``) and their loading bars.

    Call before the libraries are imported where possible: vLLM reads ``VLLM_LOGGING_LEVEL`` when
    it configures its logger at import. ``libraries=False`` (a command that loads no model: ``unirl
    config list``) leaves out transformers' and diffusers' own settings, which import them (~4 s)."""
    level = logging.INFO if verbose else logging.WARNING
    os.environ.setdefault("VLLM_LOGGING_LEVEL", logging.getLevelName(level))
    if not verbose:  # vLLM's own handler prints to stdout; its records go to RunOutput's file instead
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    for name in _LIBRARIES:
        logging.getLogger(name).setLevel(level)
    if not verbose:
        logging.getLogger("transformers.utils.import_utils").addFilter(TorchvisionFallbackFilter())
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if not verbose and libraries:
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


#: The console's stderr of each ``RunOutput.quiet`` call running now, innermost last (empty: ``sys.stderr`` is it).
_CONSOLES: list = []


def console():
    """Where a line meant for the person at the console goes now: ``sys.stderr``, or the console's stderr
    kept aside while a ``RunOutput.quiet`` call points descriptors 1 and 2 (and ``sys.stderr``) at the run log."""
    return _CONSOLES[-1] if _CONSOLES else sys.stderr


def say(line: str) -> None:
    """``line`` on the console and, while set-up output goes to the run log, in the log too: unirl's own
    progress (a toy model's build takes minutes on a CPU) must not sit in the log alone, looking like a hang."""
    print(line, file=sys.stderr, flush=True)
    if console() is not sys.stderr:
        print(line, file=console(), flush=True)


class RunOutput:
    """The libraries' output of one run (or one evaluation) in ``directory/run.log``, unirl's on the console.

    While entered: the libraries' loggers write to the file instead of their console handlers, and
    Python warnings raised inside ``LIBRARY_PACKAGES`` go there too (others reach the console as
    usual). ``quiet(fn)`` wraps a call whose C-level output (vLLM's worker start-up, torch's NUMA
    notice, loading bars) must go to the file as well: file descriptors 1 and 2 point at it while
    ``fn`` runs. With ``verbose`` nothing is redirected (``path`` is then None).
    """

    def __init__(self, directory: str | Path, *, verbose: bool = False, name: str = LOG_NAME):
        rank = int(os.environ.get("RANK", "0"))
        self.path = None if verbose else Path(directory) / (name if rank == 0 else f"{Path(name).stem}.rank{rank}.log")
        self._saved: list = []
        self._console = None  # the console's stderr while the descriptors point at the file

    def __enter__(self) -> "RunOutput":
        if self.path is None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = logging.FileHandler(self.path, mode="a", encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for name in _LOG_FILE_LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.handlers[:], logger.propagate))
            logger.handlers, logger.propagate = [self._handler], False
        self._showwarning = warnings.showwarning
        warnings.showwarning = self._route_warning
        return self

    def __exit__(self, *exc) -> None:
        if self.path is None:
            return
        warnings.showwarning = self._showwarning
        for logger, handlers, propagate in self._saved:
            logger.handlers, logger.propagate = handlers, propagate
        self._saved = []
        self._handler.close()

    def _route_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if from_library(filename):
            self._handler.stream.write(warnings.formatwarning(message, category, filename, lineno, line))
            self._handler.flush()
        else:
            self._showwarning(message, category, filename, lineno, file or self._console, line)

    def quiet(self, fn):
        """``fn`` with file descriptors 1 and 2 pointing at the log file while it runs."""
        if self.path is None:
            return fn

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self._descriptors_to_file():
                return fn(*args, **kwargs)

        return wrapper

    @contextlib.contextmanager
    def _descriptors_to_file(self):
        """Descriptors 1 and 2, and Python's ``sys.stdout``/``sys.stderr`` (a notebook's are not the
        descriptors), point at the log; ``self._console`` keeps the console's stderr for warnings."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        on_descriptor = _fileno(sys.stderr) == 2
        saved = os.dup(1), os.dup(2)
        self._console = os.fdopen(os.dup(2), "w", buffering=1) if on_descriptor else sys.stderr
        log = open(self.path, "a", buffering=1, encoding="utf-8")
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        _CONSOLES.append(self._console)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield
        finally:
            _CONSOLES.pop()
            log.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            log.close()
            if on_descriptor:
                self._console.close()
            self._console = None


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return None


def from_library(filename: str) -> bool:
    """Whether ``filename`` lies in an installed package of ``LIBRARY_PACKAGES``."""
    parts = Path(filename).parts
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages"):
            return parts[i + 1] in LIBRARY_PACKAGES
    return False
