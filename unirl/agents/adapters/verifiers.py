"""``verifiers``: a task of a PrimeIntellect ``verifiers`` taskset as an episode, scored by the task's own
rewards (its rubric). Tested with verifiers 0.4.0 (``verifiers.v1``).

verifiers 0.4 replaced the ``MultiTurnEnv`` / ``ToolEnv`` / ``Rubric`` classes of 0.3 with tasksets (data),
tasks whose ``@vf.reward`` methods score a finished trace (the rubric), and harnesses: agent programs
that call the model themselves through an OpenAI-compatible endpoint and run the task's tools and
simulated users. Here unirl plays the model's side in-process: the episode's prompt is the task's
(system prompt, then its prompt), the policy answers in one turn, and the task scores the trace of
that exchange with its rewards and metrics (their weighted sum is the step's reward; each one is in
``info``). Tasks whose episodes need a harness (tools, a simulated user, a sandbox runtime) are played
by verifiers' own harness against an endpoint serving the policy, not by this adapter. verifiers 0.3.1
(the last with ``MultiTurnEnv``) pins ``mcp<2`` against vLLM 0.32's ``mcp>=2`` and is not supported.

A taskset is named as verifiers names it (``taskset``: an installed taskset package's id, or an
importable module exporting one ``Taskset`` subclass in ``__all__``), with its config's fields in
``taskset_config``. Rows pick a task by ``task_index`` (``taskset_rows`` writes them); the tasks are
loaded once per taskset and config.
"""

from __future__ import annotations

import functools
import json

from unirl.agents.adapters import require
from unirl.agents.protocol import Episode, Step, register_environment

require("verifiers")


@register_environment("verifiers")
class VerifiersTask(Episode):
    """A task of a verifiers taskset, answered in one turn and scored by the task's rewards."""

    def __init__(self, row: dict, *, taskset: str, taskset_config: dict | None = None):
        tasks = _tasks(taskset, json.dumps(taskset_config or {}, sort_keys=True))
        index = row.get("task_index")
        if not isinstance(index, int) or not 0 <= index < len(tasks):
            raise ValueError(f"verifiers: a row needs 'task_index', 0..{len(tasks) - 1} of taskset {taskset!r}; got "
                             f"{index!r} (unirl.agents.adapters.verifiers.taskset_rows writes such rows)")
        self.task = tasks[index]

    def reset(self) -> str:
        data = self.task.data
        return f"{data.system_prompt}\n\n{data.prompt_text}" if data.system_prompt else data.prompt_text

    async def step(self, action: str) -> Step:
        trace = self._trace(action)
        await self.task.score(trace)
        info = {name: r.score for name, r in trace.rewards.items() if r is not None}
        info.update({f"metric/{k}": v for k, v in trace.metrics.items() if v is not None})
        return Step(reward=trace.reward, done=True, info=info)

    def _trace(self, action: str):
        """The trace of the exchange as verifiers records one: the prompt's messages, then the sampled answer."""
        from verifiers.v1 import AgentConfig, MessageNode, SubprocessConfig, Trace
        from verifiers.v1.trace import AgentInfo, TraceTask
        from verifiers.v1.types import AssistantMessage, SystemMessage, UserMessage

        data = self.task.data
        messages = [SystemMessage(content=data.system_prompt)] if data.system_prompt else []
        prompt = data.prompt if data.prompt is not None else ""
        messages += [UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt)
        nodes = [MessageNode(parent=i - 1 if i else None, message=m) for i, m in enumerate(messages)]
        nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, message=AssistantMessage(content=action),
                                 sampled=True))
        task = TraceTask(type=type(self.task).__name__, data=data, key=self.task.key, hash=self.task.hash)
        return Trace(task=task, agent=AgentInfo(config=AgentConfig(runtime=SubprocessConfig())), nodes=nodes,
                     is_completed=True, ok=True)


@functools.lru_cache(maxsize=8)
def _tasks(taskset: str, config_json: str) -> list:
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.utils.loaders import load_taskset

    return list(load_taskset(TasksetConfig(id=taskset, **json.loads(config_json))))


def taskset_rows(taskset: str, taskset_config: dict | None = None) -> list[dict]:
    """One row per task of the taskset: ``{"prompt", "task_index"}`` (the prompt for logs and held-out
    files; the episode asks the task for its own)."""
    tasks = _tasks(taskset, json.dumps(taskset_config or {}, sort_keys=True))
    return [{"prompt": t.data.prompt_text, "task_index": i} for i, t in enumerate(tasks)]
