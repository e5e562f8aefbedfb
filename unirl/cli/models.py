"""``unirl models list|prepare|import-gguf``: real models from GGUF files, offline.

    unirl models list
    unirl models prepare smollm2-135m-instruct [--force]
    unirl models import-gguf FILE --out DIR [--dtype bf16|fp32]

``prepare`` writes a named model (``unirl/models/named.py``) into unirl's cache, where
``model.name_or_path: NAME`` finds it; ``import-gguf`` turns any GGUF transformers reads into an
ordinary HF model directory (``unirl/models/gguf.py``). Both check the written model's logits against
the GGUF-loaded one and print the gap.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers, common: argparse.ArgumentParser) -> None:
    """Add ``models list``, ``models prepare`` and ``models import-gguf``; each sets ``func``."""
    p_models = subparsers.add_parser("models", help="real models from GGUF files (prepare, import-gguf, list)",
                                     parents=[common])
    sub = p_models.add_subparsers(dest="models_command", required=True)
    p_list = sub.add_parser("list", help="the named models, whether installed and prepared", parents=[common])
    p_list.set_defaults(func=list_command, loads_libraries=False)
    p_prepare = sub.add_parser("prepare", help="write a named model into unirl's cache (model.name_or_path: NAME)",
                               parents=[common])
    p_prepare.add_argument("name", help="a named model (see unirl models list)")
    p_prepare.add_argument("--force", action="store_true", help="write it again even when prepared")
    p_prepare.set_defaults(func=prepare_command)
    p_import = sub.add_parser("import-gguf", help="a GGUF file -> an HF model directory (config, safetensors, tokenizer)",
                              parents=[common])
    p_import.add_argument("file", help="the .gguf file")
    p_import.add_argument("--out", required=True, help="the directory to write")
    p_import.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                          help="weights' dtype on disk (bf16: half the size, rounds the dequantized weights)")
    p_import.set_defaults(func=import_command)


def list_command(args: argparse.Namespace) -> int:
    from unirl.models.named import MODELS, ModelNotAvailableError, find_gguf, is_prepared, model_dir

    for name, model in MODELS.items():
        try:
            find_gguf(name)
            installed = "installed"
        except ModelNotAvailableError:
            installed = f"not installed ({model.pip})"
        prepared = f"prepared in {model_dir(name)}" if is_prepared(name) else "not prepared"
        print(f"{name}: {model.about}\n  {installed}; {prepared}")
    return 0


def prepare_command(args: argparse.Namespace) -> int:
    from unirl.models.named import is_prepared, prepare

    if is_prepared(args.name) and not args.force:
        print(f"{args.name} is prepared: {prepare(args.name)}")
    else:
        prepare(args.name, force=args.force)
    return 0


def import_command(args: argparse.Namespace) -> int:
    from unirl.models.gguf import import_gguf

    print(import_gguf(args.file, args.out, dtype=args.dtype).format())
    return 0
