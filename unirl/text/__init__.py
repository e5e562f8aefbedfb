"""RL for language models: vLLM (or transformers) rollouts, token log-probs, rewards, tools.

* :mod:`unirl.text.config`: ``TextConfig``, the typed config of ``unirl train text``.
* :mod:`unirl.text.env`: ``TextEnvironment``, what the shared training loop drives.
* :mod:`unirl.text.vlm_env`: ``VLMEnvironment``, its subclass for a vision-language policy.
* :mod:`unirl.rollout`: the rollout engines (vLLM, transformers); :mod:`unirl.rollout.server_client`
  the rollout server's (``rollout.engine: server``).

Submodules are imported on use so that ``import unirl.text`` stays cheap.
"""


def build_environment(cfg):
    """The environment of a ``TextConfig``: a ``VLMEnvironment`` when ``model.name_or_path`` is a
    vision-language model (``unirl.text.vlm.vlm_model``), else a ``TextEnvironment``."""
    from unirl.text.vlm import vlm_model

    if vlm_model(cfg.model.name_or_path):
        from unirl.text.vlm_env import VLMEnvironment

        return VLMEnvironment(cfg)
    from unirl.text.env import TextEnvironment

    return TextEnvironment(cfg)
