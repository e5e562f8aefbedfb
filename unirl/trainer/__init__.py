"""The trainer: the one training loop (``unirl.trainer.loop.Trainer``) and its jobs, one module each.

* ``loop``: the stage order of a training step, and nothing else.
* ``advantages``: rewards on tokens (with the KL in the reward) and the estimators over the global batch.
* ``logprobs``: the old and reference log-probs (``Environment.score_actions`` over micro-batches).
* ``update``: mini-batches, micro-batches and backward piece by piece; the configured policy loss.
* ``critic``: PPO's value model, its values and its update.
* ``kl_control``: the coefficient of the KL in the reward (fixed or adaptive).
* ``dynamic_sampling``: DAPO's generate-until-enough-groups-vary.
* ``zero_advantage``: FlowGRPO's drop of samples whose advantage is zero.
* ``micro_batches``: planning micro-batches (by count or by tokens) and putting rows back.
* ``checkpoints`` (+ ``state_files``), ``preemption``: saving, resuming, stopping on a signal.
* ``run_log``, ``metrics``: the run's files and trackers; reducing figures over processes.
* ``optim``, ``distributed``: the optimizer and schedule; gathering over processes.

Nothing is imported here, so ``from unirl.trainer.preemption import Preempted`` stays cheap.
"""
