"""FlowGRPO for flow-matching text-to-image models (Stable Diffusion 3 / 3.5, FLUX.1) on diffusers.

* :mod:`unirl.diffusion.sde`: one denoising step as a Gaussian policy with its log-probability (pure).
* :mod:`unirl.diffusion.sampling`: sampling with log-probs, re-scoring stored steps, for any family.
* :mod:`unirl.diffusion.families`: one adapter per model family (encode, velocity, latent layout, schedule, decode).
* :mod:`unirl.diffusion.config`: ``DiffusionConfig``, the typed config of ``unirl train diffusion``.
* :mod:`unirl.diffusion.env`: ``DiffusionEnvironment``, what the shared training loop drives.
* :mod:`unirl.diffusion.tiny`, :mod:`unirl.diffusion.tiny_flux`: toy-size SD3 and FLUX.1 pipelines built
  from configs, for tests and demos; :mod:`unirl.diffusion.tiny_colour`: the colour demo's warm start.

Submodules are imported on use so that ``import unirl.diffusion`` stays cheap.
"""
