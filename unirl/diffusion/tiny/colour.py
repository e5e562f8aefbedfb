"""The colour demo's warm start: the toy text encoders learn to say which colour a prompt names.

The toy pipelines (``sd3.py``, ``flux.py``, ...) have random text encoders, so "a red cat" and
"a red boat" are unrelated conditionings and no reward that depends on the prompt's meaning can be
learnt from them. ``warm_start_text_encoders`` gives them that meaning with a short seeded regression,
as the text demo warm-starts its toy LM: for every training prompt (``tiny_prompts("train")``,
"a <colour> <thing>") each conditioning tensor the pipeline produces (SD3: CLIP+T5 token embeddings
and the pooled vector; FLUX: T5 tokens and CLIP's pooled output) is regressed onto a fixed random
code of its colour (``COLOUR_WARM_START``: steps, learning rate, code scale). Afterwards prompts
that name the same colour give nearly the same conditioning, whatever the thing, and the held-out
test prompts (colour/thing pairs never seen together) too.

What it does not do: the transformer is untouched and still random, so at step 0 the images do not
follow the colour (the ``colour_share`` reward starts near chance); the RL run has to learn, per
colour, which way to move the picture. Nothing here uses the reward or any image.
"""

from __future__ import annotations

import torch

#: The warm start's settings; part of the toy's cache key.
COLOUR_WARM_START = {"steps": 200, "lr": 3e-3, "code_scale": 1.0}


def warm_start_text_encoders(pipe, family_name: str, *, seed: int, steps: int, lr: float, code_scale: float) -> None:
    """Regress ``family.encode(pipe, prompt)`` of each training prompt onto its colour's random code, in place.

    Only the pipeline's text encoders change. Codes: one Gaussian tensor per (colour, conditioning
    key), of the conditioning's per-sample shape, times ``code_scale``, drawn from ``seed``.
    """
    from unirl.diffusion.families import FAMILIES
    from unirl.diffusion.tiny.prompts import TINY_COLOURS, tiny_prompts

    family = FAMILIES.get(family_name)()
    prompts = tiny_prompts("train")
    colours = torch.tensor([TINY_COLOURS.index(p.split()[1]) for p in prompts])  # [n]
    encoders = [m for name in ("text_encoder", "text_encoder_2", "text_encoder_3")
                if (m := getattr(pipe, name, None)) is not None]
    max_len = pipe.tokenizer.model_max_length
    with torch.no_grad():
        shapes = {k: v.shape[1:] for k, v in family.encode(pipe, prompts[:1], max_sequence_length=max_len,
                                                              device="cpu").items()}
    generator = torch.Generator().manual_seed(seed)
    codes = {k: code_scale * torch.randn((len(TINY_COLOURS), *shape), generator=generator) for k, shape in shapes.items()}
    params = [p for m in encoders for p in m.parameters()]
    for m in encoders:
        m.requires_grad_(True).train()
    optimizer = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        cond = family.encode(pipe, prompts, max_sequence_length=max_len, device="cpu")
        loss = sum((v.float() - codes[k][colours]).square().mean() for k, v in cond.items())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for m in encoders:
        m.requires_grad_(False).eval().zero_grad(set_to_none=True)
