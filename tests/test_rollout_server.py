"""The rollout server (``unirl serve-rollout``, ``unirl.rollout.server``) and the trainer's client
(``rollout.engine: server``): a real vLLM in its own process on the tiny model. Its samples equal a
colocated engine's for the same seed and weights; weights pushed to it give the trainer's log-probs;
its OpenAI-compatible endpoints answer in OpenAI's shapes; the guards of ``serve-reward`` apply; a run
whose server dies says so in one line and resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def chat_model_dir(tiny_lm_dir, tmp_path_factory) -> Path:
    """The tiny model with a chat template (the plain concatenation of the messages), for /v1/chat/completions."""
    path = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_lm_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return path


def start_server(model: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """``unirl serve-rollout`` on a free port; returns the process and its URL once it serves."""
    # --kv-cache-gb: the toy's sequences need a few MiB; vLLM's own sizing would take 0.3 of the host's RAM
    # (--gpu-memory-utilization on a CPU) after a warm-up pass to measure it.
    cmd = [sys.executable, "-m", "unirl.cli", "serve-rollout", str(model), "--dtype", "float32", "--port", "0",
           "--served-model-name", "tiny", "--kv-cache-gb", "0.25", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = proc.stdout.readline()  # blocks until the URL line, or EOF when the server failed
    if not line.startswith("serving rollouts"):
        proc.kill()
        raise RuntimeError(f"serve-rollout did not start: {line!r}")
    return proc, line.split(" at ")[-1].strip()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(chat_model_dir):
    proc, url = start_server(chat_model_dir)
    yield url
    stop(proc)


def _post(url: str, path: str, body: dict, token: str | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


PROMPTS = ["3+4=?", "12+9=?"]


@pytest.mark.requires("vllm")
def test_samples_equal_the_colocated_engines_and_pushed_weights_give_the_trainers_logprobs(server, chat_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unirl.rollout.vllm import VLLMEngine
    from unirl.rollout.weights import hf_checkpoint_weights
    from unirl.rollout.server_client import ServerEngine, token_path

    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    ids = [tok(p).input_ids for p in PROMPTS]
    client = ServerEngine(server)
    sampling = dict(n=3, max_new_tokens=8, temperature=1.0, seed=11)
    local = VLLMEngine(str(chat_model_dir), dtype="float32", seed=0, gpu_memory_utilization=0.05, kv_cache_bytes=1 << 28, tensor_parallel_size=1,
                       enforce_eager=True, max_model_len=None)
    try:
        here, there = local.generate(ids, **sampling), client.generate(ids, **sampling)
    finally:
        local.close()
    assert [[g.response_ids for g in gs] for gs in there] == [[g.response_ids for g in gs] for gs in here]
    for a, b in zip([g for gs in here for g in gs], [g for gs in there for g in gs]):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5) and b.text == a.text and b.finished == a.finished

    # New weights (the trainer's after some updates): pushed, the server samples from them.
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    client.load_weights(hf_checkpoint_weights(model))
    gens = [g for gs in client.generate(ids, n=2, max_new_tokens=8, temperature=1.0, seed=5) for g in gs]
    prompts = [p for p in ids for _ in range(2)]
    for prompt, g in zip(prompts, gens):
        seq = torch.tensor([prompt + g.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(seq).logits[0, len(prompt) - 1:-1].float(), -1)  # [R, V]
        trainer = logp.gather(1, torch.tensor(g.response_ids)[:, None])[:, 0]
        assert g.logprobs == pytest.approx(trainer.tolist(), abs=2e-4)
    # The weight routes took the token the server made at start (no --token), from the file a trainer on this
    # machine reads; a push naming a tensor vLLM does not serve is refused before loading (issue 51: it broke
    # every later generation with "Meta tensors"), and the server goes on serving.
    bad = {"tensors": [{"name": "model.nope.weight", "shape": [3], "dtype": "float32"}], "version": "x"}
    assert _post(server, "/weights/receive", bad)[0] == 401
    status, out = _post(server, "/weights/receive", bad, token_path(int(server.rsplit(":", 1)[1])).read_text())
    assert status == 400 and "'model.nope.weight' is not a parameter of the served model" in out["error"]["message"]
    assert _post(server, "/generate", {"prompt_ids": ids[:1], "max_new_tokens": 2})[0] == 200


@pytest.mark.requires("vllm")
def test_openai_completions_and_chat_answer_in_openai_shapes(server):
    status, out = _post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPTS, "max_tokens": 6, "n": 2,
                                                    "temperature": 1.0, "logprobs": 0, "seed": 1})
    assert status == 200 and out["object"] == "text_completion" and out["model"] == "tiny"
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for c in out["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) and all(x <= 0 for x in lp["token_logprobs"])
        assert c["finish_reason"] in ("stop", "length")
    assert out["usage"]["prompt_tokens"] == 5 + 6 and out["usage"]["total_tokens"] > out["usage"]["prompt_tokens"]

    status, out = _post(server, "/v1/chat/completions", {"model": "tiny", "max_tokens": 8, "temperature": 0,
                                                         "logprobs": True,
                                                         "messages": [{"role": "user", "content": "3+4=?"}]})
    assert status == 200 and out["object"] == "chat.completion"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert "".join(t["token"] for t in choice["logprobs"]["content"]).startswith(choice["message"]["content"])
    greedy = _post(server, "/v1/completions", {"prompt": "3+4=?", "max_tokens": 8, "temperature": 0})[1]
    assert greedy["choices"][0]["text"] == choice["message"]["content"]  # the template is the plain content

    status, out = _post(server, "/v1/completions", {"model": "gpt-4", "prompt": "1"})
    assert status == 400 and "'gpt-4' is not served here; this server serves 'tiny'" in out["error"]["message"]
    status, out = _post(server, "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and "'messages' must be" in out["error"]["message"]


def test_the_guards_of_serve_reward_apply(tiny_lm_dir):
    """Token, size and address checks on the app itself, over the transformers engine (no vLLM start)."""
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unirl.serving.guards import Guards
    from unirl.rollout.hf import HFEngine
    from unirl.rollout.server import RolloutService, make_app, make_server

    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32)
    guards = Guards.from_settings("serve-rollout", max_body_mb=0.001, body_timeout_s=5, token="s3cret",
                                  token_env="UNIRL_ROLLOUT_TOKEN")
    client = TestClient(make_app(RolloutService(HFEngine(lambda: model, tok), "tiny"), guards, guards))
    body = {"prompt": "3+4=?", "max_tokens": 4}
    assert client.get("/health").status_code == 200  # no token needed
    assert client.post("/v1/completions", json=body).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": "Bearer s3cret"}
    ok = client.post("/v1/completions", json=body, headers=auth)
    assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"] is None
    big = client.post("/v1/completions", json={**body, "prompt": "1" * 2000}, headers=auth)
    assert big.status_code == 413 and "--max-body-mb" in big.json()["error"]["message"]
    weights = client.post("/weights", content=b"not safetensors", headers=auth)
    assert weights.status_code == 400 and "safetensors" in weights.json()["error"]["message"]
    with pytest.raises(ValueError, match="--host 0.0.0.0 exposes the policy .* give a --token"):
        make_server("tiny", "0.0.0.0", 0, token=None)
    with pytest.raises(ValueError, match=r"--kv-cache-gb must be > 0 \(GiB\), got 0"):
        make_server("tiny", port=0, kv_cache_gb=0)  # before vLLM loads


@pytest.mark.slow  # two server starts and a run
@pytest.mark.requires("vllm")
def test_a_run_whose_server_dies_says_so_in_one_line_and_resumes(tmp_path, chat_model_dir):
    run = tmp_path / "run"
    proc, url = start_server(chat_model_dir)
    args = [sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny", "--output-dir", str(run),
            "rollout.engine=server", f"rollout.server_url={url}", "trainer.prompts_per_step=4", "trainer.group_size=4",
            "trainer.mini_batch_size=16", "trainer.micro_batch_size=16", "trainer.eval_every=0", "trainer.save_every=1",
            "trainer.progress=false", "source.max_staleness=1"]
    # Steps as many as it never finishes by itself (a tiny step here can take 0.02 s: 200 steps ended before
    # this loop saw a checkpoint, once), and any saved checkpoint will do: only the last two are kept.
    train = subprocess.Popen([*args, "trainer.total_steps=100000"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 300
        while not any((run / "checkpoints").glob("step_*")):
            assert train.poll() is None and time.monotonic() < deadline, train.communicate()[1][-3000:]
            time.sleep(0.2)
    finally:
        proc.kill()  # the server dies mid-run
        proc.wait()
    _, stderr = train.communicate(timeout=300)
    assert train.returncode != 0
    lines = [line for line in stderr.splitlines() if line.startswith("unirl:") and "rollout server" in line]
    assert len(lines) == 1 and "unreachable" in lines[0] and "resume with trainer.resume=true" in lines[0], stderr[-3000:]
    assert "Traceback" not in stderr

    proc, url = start_server(chat_model_dir)
    try:
        saved = max(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))
        args[args.index(next(a for a in args if a.startswith("rollout.server_url=")))] = f"rollout.server_url={url}"
        resumed = subprocess.run([*args, "trainer.resume=true", f"trainer.total_steps={saved + 2}"], cwd=REPO,
                                 capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        stop(proc)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == list(range(1, saved + 3))
