"""The ``python_code`` environment: the policy writes a Python program, the sandbox runs it against the
row's tests (``unirl/agents/sandbox.py``), and a failed attempt is answered with what went wrong so the
policy can try again, up to ``attempts`` turns (and ``rollout.max_turns``).

A row holds the task (``prompt``) and the tests (``tests``: Python source, typically ``assert`` lines,
run after the program in its namespace). The program is the last fenced code block of the turn
(```python ... ```), or the whole turn when it has none. The reward is ``reward`` on the turn whose
program passes (the episode ends there), 0 otherwise.
"""

from __future__ import annotations

import re

from unirl.agents.protocol import Episode, Step, register_environment
from unirl.agents.sandbox import Limits, run_program

_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def program_of(text: str) -> str:
    """The last fenced code block of ``text``, or ``text`` itself when it has none."""
    blocks = _FENCED.findall(text)
    return blocks[-1] if blocks else text


@register_environment("python_code")
class PythonCode(Episode):
    """Write a Python program that passes the row's tests, run in a sandbox with limits."""

    def __init__(self, row: dict, *, attempts: int = 1, reward: float = 1.0, wall_s: float = 10.0, cpu_s: int = 5,
                 memory_mb: int = 512, file_size_mb: int = 8, processes: int = 8, feedback_chars: int = 600):
        if not isinstance(row.get("tests"), str):
            raise ValueError(f"python_code: a row needs 'tests', Python source run after the program; got "
                             f"{type(row.get('tests')).__name__}")
        self.tests, self.attempts, self.reward, self.feedback_chars = row["tests"], attempts, reward, feedback_chars
        self.limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, file_size_mb=file_size_mb,
                             processes=processes)
        self.tried = 0

    def reset(self) -> None:
        return None  # the row's prompt

    def step(self, action: str) -> Step:
        self.tried += 1
        outcome = run_program(program_of(action), self.tests, self.limits)
        info = {"status": outcome.status, "wall_s": outcome.wall_s}
        if outcome.passed:
            return Step(reward=self.reward, done=True, info=info)
        if self.tried >= self.attempts:
            return Step(reward=0.0, done=True, info=info)
        feedback = (outcome.stderr or outcome.stdout)[-self.feedback_chars:]
        return Step(observation=f"\nThe tests did not pass ({outcome.status}):\n{feedback}\nTry again.\n", reward=0.0,
                    info=info)
