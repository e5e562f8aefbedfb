"""``hpsv2``: Human Preference Score v2 (Wu et al. 2023, https://arxiv.org/abs/2306.09341).

An OpenCLIP ViT-H-14 fine-tuned on human preference pairs (HPD v2); the score is the cosine
similarity of the normalised image and prompt embeddings, as FlowGRPO's ``hpsv2_scorer.py`` computes
it (``image_features @ text_features.T``, diagonal; the HPSv2 paper reports it times 100). The
checkpoint ``HPS_v2.1_compressed.pt`` (or ``HPS_v2_compressed.pt`` for ``version="v2.0"``) comes from
the hub repository ``xswu/HPSv2``, or from ``checkpoint=`` a local file.

Needs the optional extra ``pip install -e ".[hpsv2]"`` (open-clip-torch, which imports torchvision;
install the torchvision build that matches your torch). This module imports ``open_clip`` first, so
without it ``hpsv2`` is listed as unavailable with that hint and the other rewards still load.
"""

from __future__ import annotations

from typing import Any

import open_clip  # optional dependency: pip install open-clip-torch

from unirl.rewards.models import ModelReward
from unirl.rewards.registry import register_reward

CHECKPOINTS = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


def load_checkpoint(path) -> dict:
    """The tensors of an HPSv2 checkpoint: a ``.safetensors`` file, or a torch file read with
    ``weights_only=True``, which refuses pickled objects (a downloaded file's pickle could run any code;
    the published ``{"state_dict": ...}`` checkpoints hold only tensors and plain values)."""
    import pickle

    import torch

    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"hpsv2: {path} holds pickled objects besides tensors; refused (torch.load with "
                         f"weights_only=True): {str(err).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise ValueError(f"hpsv2: {path} holds a {type(state).__name__}, expected a state dict")
    return state


@register_reward("hpsv2", modality="image")
class HPSv2(ModelReward):
    """HPSv2.1 human-preference score: cosine of OpenCLIP ViT-H-14 image and prompt embeddings (about 0.2-0.35)."""

    def __init__(self, *, version: str = "v2.1", checkpoint: str | None = None, architecture: str = "ViT-H-14",
                 hub_repo: str = "xswu/HPSv2", **kwargs: Any):
        super().__init__(**kwargs)
        if version not in CHECKPOINTS:
            raise ValueError(f"hpsv2: version must be one of {sorted(CHECKPOINTS)}, got {version!r}")
        self.version, self.checkpoint, self.architecture, self.hub_repo = version, checkpoint, architecture, hub_repo

    def load(self) -> None:
        model, _, preprocess = open_clip.create_model_and_transforms(self.architecture, pretrained=None, device="cpu")
        path = self.checkpoint
        if path is None:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(self.hub_repo, CHECKPOINTS[self.version])
        state = load_checkpoint(path)
        model.load_state_dict(state.get("state_dict", state))
        self.model = model.to(self.device, self.torch_dtype).eval().requires_grad_(False)
        self.preprocess = preprocess
        self.tokenizer = open_clip.get_tokenizer(self.architecture)

    def score(self, samples, *, prompts, **columns):
        import torch

        images = torch.stack([self.preprocess(img) for img in samples]).to(self.device, self.torch_dtype)  # [n, 3, H, W]
        tokens = self.tokenizer(list(prompts)).to(self.device)  # [n, 77]
        img = self.model.encode_image(images, normalize=True)  # [n, D]
        txt = self.model.encode_text(tokens, normalize=True)  # [n, D]
        return (img * txt).sum(-1).float().cpu()
