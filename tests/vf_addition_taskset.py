"""A verifiers 0.4 taskset for tests/test_agents_adapters.py, importable as ``vf_addition_taskset`` (the
tests' folder is on the path): the tiny model's addition questions, scored by a ``@vf.reward`` that
calls unirl's ``gsm8k`` reward (``method: strict_normalized``, the tiny config's) on the trace's reply, so a
run through the adapter can be compared with the same run scored by unirl's reward set; and a ``@vf.metric``."""

from __future__ import annotations

import verifiers.v1 as vf

from unirl.rewards.gsm8k import gsm8k

__all__ = ["AdditionTaskset"]


class AdditionData(vf.TaskData):
    answer: str


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward
    async def correct(self, task: AdditionData, trace: vf.Trace) -> float:
        return gsm8k([trace.last_reply], answer=[task.answer], method="strict_normalized")[0]

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class AdditionTaskset(vf.Taskset[AdditionTask]):
    def load(self):
        from unirl.text.tiny import addition_rows

        for row in addition_rows(64, seed=0):
            yield AdditionTask(AdditionData(prompt=row["question"], answer=row["answer"].split("#### ")[-1]))
