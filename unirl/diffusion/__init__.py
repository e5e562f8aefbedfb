"""FlowGRPO for flow-matching diffusers models (Stable Diffusion 3 / 3.5, FLUX.1, ...), one adapter per family.

* :mod:`unirl.diffusion.sde`: one denoising step as a Gaussian policy with its log-probability (pure).
* :mod:`unirl.diffusion.sampling`: sampling with log-probs, re-scoring stored steps, for any family.
* :mod:`unirl.diffusion.families`: one adapter per model family (encode, velocity, latent layout, schedule, decode).
* :mod:`unirl.diffusion.config`: ``DiffusionConfig``, the typed config of ``unirl train diffusion``.
* :mod:`unirl.diffusion.env`: ``DiffusionEnvironment``, what the shared training loop drives; the algorithm is a
  registered rollout mode (:mod:`unirl.diffusion.rollout_mode`): FlowGRPO's (:mod:`unirl.diffusion.flowgrpo`),
  DiffusionNFT's (:mod:`unirl.diffusion.nft`), AWM's and DGPO's on NFT's data path
  (:mod:`unirl.diffusion.forward_process`), TempFlow-GRPO's (:mod:`unirl.diffusion.tempflow`).
* :mod:`unirl.diffusion.offtarget`: the figures logged under ``offtarget/`` that show reward hacking.
* :mod:`unirl.diffusion.pipeline`: loading a family's pipeline (a toy, a directory or a hub name), frozen but the transformer.
* :mod:`unirl.diffusion.tiny`: one toy-size pipeline per family, built from a fixed seed for tests and demos,
  and the colour demo's warm start (toys depend on the adapters, never the reverse).

Submodules are imported on use so that ``import unirl.diffusion`` stays cheap.
"""


def build_environment(cfg):
    """The environment of a ``DiffusionConfig``; ``cfg.algorithm`` picks its registered rollout mode."""
    from unirl.diffusion.env import DiffusionEnvironment

    return DiffusionEnvironment(cfg)
