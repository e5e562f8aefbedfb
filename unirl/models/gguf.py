"""GGUF -> an ordinary Hugging Face model directory (``unirl models import-gguf FILE --out DIR``).

transformers reads a GGUF file (``from_pretrained(dir, gguf_file=NAME)``, with the ``gguf``
package): it dequantizes every tensor to float32 and maps llama.cpp's names to its own. It will not
``save_pretrained`` that model (the GGUF quantizer is "not serializable"), so the import rebuilds
the plain architecture from the same config without its ``quantization_config``, loads the
dequantized state dict into it and saves that: ``config.json``, ``model.safetensors``, the tokenizer
(with the chat template the GGUF embeds) and a ``generation_config.json`` whose EOS and pad are the
GGUF's. transformers and vLLM load the result by path like any checkpoint.

The import checks itself before it returns: it loads the written directory again and compares its
logits on a chat-formatted prompt with the GGUF-loaded model whose weights are rounded to the
written dtype (the same numbers, so the gap is float32 noise; a wrong name, a lost tied weight or a
config that drifted shows up as a large gap). The gap to the unrounded GGUF model is reported too:
it is zero in float32 and the bfloat16 rounding otherwise.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: The check's tolerance on the max |logit gap| to the same weights (float32 forward passes of a
#: 30-layer model on 40 tokens differ by ~1e-5 between a fresh load and the GGUF-loaded module).
CHECK_ATOL = 1e-3
#: The prompt the check runs through both models (chat-formatted when the GGUF has a template).
CHECK_MESSAGES = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]


@dataclass
class ImportReport:
    """What ``import_gguf`` wrote and how close the written model is to the GGUF one."""

    gguf: str
    out: str
    dtype: str
    architecture: str
    parameters: int
    eos_token_id: int | list[int]
    pad_token_id: int
    chat_template: bool
    #: max |logit gap|, written model vs the GGUF model with its weights rounded to ``dtype``.
    logit_gap_same_weights: float
    #: max |logit gap|, written model vs the GGUF model as dequantized (the dtype's rounding).
    logit_gap_to_gguf: float
    #: the two models' greedy next tokens agree at every position of the check prompt.
    argmax_agree: bool

    def format(self) -> str:
        return (f"wrote {self.out} ({self.architecture}, {self.parameters / 1e6:.1f}M parameters, {self.dtype}); "
                f"eos {self.eos_token_id}, pad {self.pad_token_id}, chat template {'yes' if self.chat_template else 'no'}; "
                f"logit gap {self.logit_gap_same_weights:.1e} to the same weights, {self.logit_gap_to_gguf:.1e} to the "
                f"GGUF's float32 (greedy tokens {'agree' if self.argmax_agree else 'DIFFER'})")


def import_gguf(gguf_file: str | Path, out: str | Path, dtype: str = "bf16") -> ImportReport:
    """Convert ``gguf_file`` into an HF model directory ``out`` in ``dtype`` (``bf16`` or ``fp32``),
    check it (see the module doc) and return the report; ``out/unirl_import.json`` holds it too."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path = Path(gguf_file).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file!r} not found")
    out = Path(out).expanduser()
    # 1. The GGUF as transformers reads it: config, tokenizer, float32 dequantized model.
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    # 2. The plain architecture from the same config, holding the dequantized weights in ``dtype``.
    model = _plain_model(config, gguf_model.state_dict(), DTYPES[dtype])
    # 3. Tokenizer and generation config; 4. write everything.
    if tokenizer.pad_token_id is None:  # a pad is needed to batch; the EOS is what HF chat models use
        tokenizer.pad_token = tokenizer.eos_token
    generation = _generation_config(model.config, tokenizer, _gguf_eot_id(path))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    generation.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # 5. Reload what was written and compare logits with the GGUF model.
    report = _check(path, out, dtype, gguf_model, tokenizer, generation)
    (out / "unirl_import.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    return report


def _plain_model(config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    config = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every weight of the architecture must come from the GGUF (a tied head shares the embedding).
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
        model.tie_weights()
    if missing or unexpected:
        raise ValueError(f"the GGUF's tensors do not fill {type(model).__name__}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model.to(dtype).eval()


def _gguf_eot_id(path: Path) -> int | None:
    """The GGUF's end-of-turn token (``tokenizer.ggml.eot_token_id``) when it names one."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("tokenizer.ggml.eot_token_id")
    return int(field.contents()) if field is not None else None


def _generation_config(config, tokenizer, eot_id: int | None):
    """EOS = the tokenizer's EOS plus the chat template's end-of-turn token when it differs (so vLLM
    and ``generate`` stop at the end of an assistant turn); pad = the tokenizer's pad."""
    from transformers import GenerationConfig

    eos = [tokenizer.eos_token_id] + ([eot_id] if eot_id is not None and eot_id != tokenizer.eos_token_id else [])
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos,
                            pad_token_id=tokenizer.pad_token_id)


@torch.no_grad()
def _check(path: Path, out: Path, dtype: str, gguf_model, tokenizer, generation) -> ImportReport:
    from transformers import AutoModelForCausalLM

    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    else:
        ids = tokenizer(CHECK_MESSAGES[0]["content"]).input_ids
    ids = torch.tensor([list(ids)])  # [1, T]
    written = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    logits = written(input_ids=ids).logits  # [1, T, V]
    reference = gguf_model(input_ids=ids).logits
    # The GGUF model's own weights rounded to the written dtype, in place (it is not used afterwards).
    for p in gguf_model.parameters():
        p.copy_(p.to(DTYPES[dtype]).float())
    same = gguf_model(input_ids=ids).logits
    report = ImportReport(
        gguf=str(path), out=str(out), dtype=dtype, architecture=type(written).__name__,
        parameters=sum(p.numel() for p in written.parameters()), eos_token_id=generation.eos_token_id,
        pad_token_id=generation.pad_token_id, chat_template=bool(tokenizer.chat_template),
        logit_gap_same_weights=(logits - same).abs().max().item(),
        logit_gap_to_gguf=(logits - reference).abs().max().item(),
        argmax_agree=bool((logits.argmax(-1) == reference.argmax(-1)).all()),
    )
    if report.logit_gap_same_weights > CHECK_ATOL:
        raise ValueError(f"the written model {out} does not reproduce the GGUF's logits: max gap "
                         f"{report.logit_gap_same_weights:.2e} > {CHECK_ATOL:.0e} (same weights)")
    return report
