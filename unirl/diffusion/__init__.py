"""FlowGRPO for flow-matching text-to-image models (Stable Diffusion 3 / 3.5) on diffusers.

* :mod:`unirl.diffusion.sde`: one denoising step as a Gaussian policy with its log-probability (pure).
* :mod:`unirl.diffusion.sampling`: prompt encoding, sampling with log-probs, re-scoring stored steps.
* :mod:`unirl.diffusion.config`: ``DiffusionConfig``, the typed config of ``unirl train diffusion``.
* :mod:`unirl.diffusion.env`: ``DiffusionEnvironment``, what the shared training loop drives.
* :mod:`unirl.diffusion.tiny`: a toy-size SD3 pipeline built from configs, for tests and demos.

Submodules are imported on use so that ``import unirl.diffusion`` stays cheap.
"""
