"""Train a policy from your own agent loop: plain ``openai`` client code, no unirl inside the agent.

The run serves the policy it trains at an OpenAI-compatible endpoint (``source.agent``) and records every call
of a session token for token. The agent below owns its environment, the tiny game (walk along a line of
cells 0..9 to a goal, one move a turn: ``r`` or ``l``), and plays it through the endpoint: one session per
episode, its id in the ``user`` field, the next prompt its history plus the move and what the game shows,
and the episode's reward posted at the end. The run trains on the sessions (each one masked trajectory:
the moves trained, the game's answers not) and serves the updated policy to the agent's next calls.

    python examples/external_agent.py          # the tiny game's model, built once (~30 s); about a minute
                                               # on 2 CPU cores; its last line: reward A -> B

docs/agents.md ("Train your own agent loop") says what the endpoint takes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

#: The tiny model's end of turn. A finished move (``finish_reason == "stop"``) ended with it, and the text does
#: not show it: the agent writes it back into its history, as a chat template writes the end of an assistant
#: message, so that the next prompt continues the last one token for token (else the session is cut there).
END = "<|endoftext|>"
CELLS, TURNS = 10, 4


def play(client: openai.OpenAI, model: str, start: int, goal: int, group: str) -> float:
    """One episode of the game through the endpoint, as one session; returns its reward."""
    session, cell, history, reward = uuid.uuid4().hex, start, f"at {start} goal {goal}\n", 0.0
    for _ in range(TURNS):
        choice = client.completions.create(model=model, prompt=history, max_tokens=4, temperature=1.0,
                                           user=session).choices[0]
        cell = min(max(cell + {"r": 1, "l": -1}.get(choice.text.strip(), 0), 0), CELLS - 1)
        if cell == goal:
            reward = 1.0
            break
        history += choice.text + (END if choice.finish_reason == "stop" else "") + f"at {cell} goal {goal}\n"
    client.post(f"/sessions/{session}/reward", body={"reward": reward, "group": group}, cast_to=object)
    return reward


def episodes(group_size: int, seed: int):
    """(start, goal, group) forever: each task played ``group_size`` times (GRPO's group)."""
    rng = random.Random(seed)
    pairs = [(s, g) for s in range(CELLS) for g in range(CELLS) if 0 < abs(s - g) <= TURNS]
    for k in itertools.count():
        start, goal = rng.choice(pairs)
        for _ in range(group_size):
            yield start, goal, f"task-{k}"


def agent(url: str, model: str, done: threading.Event, *, workers: int, group_size: int, seed: int) -> None:
    """Play episodes on ``workers`` threads until the run is over."""
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    tasks, lock = episodes(group_size, seed), threading.Lock()

    def worker():
        while not done.is_set():
            with lock:
                start, goal, group = next(tasks)
            try:
                play(client, model, start, goal, group)
            except openai.APIConnectionError:
                # the run closes its endpoint before it returns: over once it has (its error, if any, is
                # raised by main), a failure if the endpoint went away while the run goes on
                if not done.wait(30):
                    raise

    with ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(worker) for _ in range(workers)]:
            future.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--workers", type=int, default=16, help="episodes the agent plays at once")
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args()
    import unirl

    run_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="external-agent-")) / "run"
    group_size, result, done = 8, {}, threading.Event()
    overrides = {"source.agent.port": 0,  # a free port; the address lands in RUN/agent_endpoint.json
                 "source.max_staleness": 1,  # the agent keeps playing while the trainer updates
                 "rollout.environment.name": None,  # the episodes are the agent's, not the run's
                 "trainer.total_steps": args.steps, "trainer.prompts_per_step": 8, "trainer.group_size": group_size,
                 "trainer.mini_batch_size": 64, "trainer.micro_batch_size": 64, "trainer.eval_every": 0,
                 "trainer.save_every": 0}

    def train():
        try:
            result["run"] = unirl.train("text", "tiny_game", overrides, rewards=["session_reward"], output_dir=run_dir,
                                        progress=False)
        except BaseException as err:  # noqa: BLE001 - raised again below
            result["error"] = err
        finally:
            done.set()

    trainer = threading.Thread(target=train, daemon=True)  # an agent that fails ends the script
    trainer.start()
    endpoint = run_dir / "agent_endpoint.json"
    while not endpoint.exists() and not done.is_set():
        time.sleep(0.1)
    if endpoint.exists():
        served = json.loads(endpoint.read_text())
        agent(served["url"], served["model"], done, workers=args.workers, group_size=group_size, seed=0)
    trainer.join()
    if "error" in result:
        raise result["error"]
    rewards = result["run"].rewards
    print(f"reward {rewards[0]:.2f} -> {rewards[-1]:.2f}")


if __name__ == "__main__":
    main()
