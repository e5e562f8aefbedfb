"""The rollout server refuses what it cannot serve before its engine sees it (issue 51): client mistakes are a
400 naming the field, a weight push that does not fit the served model is a 400 naming the tensor, and a
refused request changes nothing the server serves. The weight routes need a token even on loopback. The
trainer's client (``ServerEngine``) trusts no answer it cannot train on and reports a refused token at once.

In-process, over the transformers engine on the tiny model (no vLLM start): the checks sit in front of any
engine."""

from __future__ import annotations

import json
import os
import stat
import threading
import time

import pytest
import torch

TOKEN = "w3ights"


@pytest.fixture(scope="module")
def served(tiny_lm_dir):
    """The app over a private copy of the tiny model (what ``load_weights`` replaces), its original weights,
    and a ``TestClient``; the weight routes under ``TOKEN``, the others open (loopback's default)."""
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unirl.rollout.hf import HFEngine
    from unirl.rollout.server import RolloutService, make_app
    from unirl.rollout.weight_channel import served_params
    from unirl.serving.guards import Guards

    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32)
    engine = HFEngine.with_own_copy(model, tok, torch.device("cpu"))
    service = RolloutService(engine, "tiny", params=served_params(str(tiny_lm_dir)))
    guards = Guards.from_settings("serve-rollout", max_body_mb=8, body_timeout_s=5, token=None, token_env="UNSET_X")
    weight_guards = Guards.from_settings("serve-rollout", max_body_mb=64, body_timeout_s=5, token=TOKEN,
                                         token_env="UNSET_X")
    app = make_app(service, guards, weight_guards)
    original = {k: v.clone() for k, v in engine.own.state_dict().items()}
    return TestClient(app), service, engine, original


def _sample(client) -> list:
    out = client.post("/generate", json={"prompt_ids": [[3, 4, 5]], "n": 2, "max_new_tokens": 6, "seed": 7})
    assert out.status_code == 200, out.text
    return [[g["response_ids"] for g in group] for group in out.json()["generations"]]


BAD_REQUESTS = [  # (path, body, the field the 400 names)
    ("/generate", {"prompt_ids": [[3, 4]], "seed": 2**70}, "'seed'"),
    ("/generate", {"prompt_ids": [[3, 4]], "seed": -1}, "'seed'"),
    ("/generate", {"prompt_ids": [[3, 4]], "seed": 2**63 - 2, "n": 4}, "'seed'"),  # seed + i * n past 64 bits
    ("/generate", {"prompt_ids": [[3, 4]], "top_p": 5}, "'top_p'"),
    ("/generate", {"prompt_ids": [[3, 4]], "top_p": 0}, "'top_p'"),
    ("/generate", {"prompt_ids": [[3, 4]], "stop": ["a", ""]}, "'stop'"),
    ("/generate", {"prompt_ids": [[3, 100000]]}, "'prompt_ids'[0] holds 100000"),
    ("/generate", {"prompt_ids": [[3], [-1]]}, "'prompt_ids'[1] holds -1"),
    ("/generate", {"prompt_ids": [[True]]}, "'prompt_ids'"),
    ("/generate", {"prompt_ids": [[3, 4]], "n": {"a": [1]}}, "'n'"),
    ("/generate", {"prompt_ids": [[3, 4]], "greedy": "yes"}, "'greedy'"),
    ("/generate", {"prompt_ids": [[3, 4]], "top_k": -5}, "'top_k'"),
    ("/v1/completions", {"prompt": [3, 99999], "max_tokens": 2}, "'prompt'[0] holds 99999"),
    ("/v1/completions", {"prompt": "1+1", "temperature": 10**400}, "'temperature'"),
    ("/v1/completions", {"prompt": "1+1", "stop": ""}, "'stop'"),
    ("/v1/completions", {"prompt": [[[1]]]}, "'prompt'[0] holds [1]"),
]


def test_client_mistakes_are_400_naming_the_field_and_change_nothing(served):
    client, *_ = served
    before = _sample(client)
    for path, body, named in BAD_REQUESTS:
        out = client.post(path, json=body)
        assert out.status_code == 400 and named in out.json()["error"]["message"], (path, body, out.text)
    # JSON's non-standard NaN (Python's json reads it) and a body nested past the recursion limit.
    nan = client.post("/generate", content=b'{"prompt_ids": [[3]], "temperature": NaN}')
    assert nan.status_code == 400 and "'temperature' must be a finite number" in nan.json()["error"]["message"]
    deep = client.post("/v1/completions", content=b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}")
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    assert _sample(client) == before  # nothing refused reached the engine or its random state
    top = client.post("/generate", json={"prompt_ids": [[3]], "seed": 2**63 - 1 - 1, "max_new_tokens": 2})
    assert top.status_code == 200  # the largest seed a one-prompt request may give


def _safetensors(weights: dict) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous().clone() for k, v in weights.items()})


def test_a_weight_push_that_does_not_fit_the_served_model_is_refused_before_loading(served):
    client, service, engine, original = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = _sample(client)
    good = {k: v for k, v in original.items()}
    cases = [
        ({**good, "model.layers.9.mlp.up_proj.weight": torch.zeros(256, 128)}, "'model.layers.9.mlp.up_proj.weight' is not"),
        ({**good, "model.norm.weight": torch.zeros(64)}, "'model.norm.weight' has shape [64], the served model's is [128]"),
        ({**good, "model.norm.weight": torch.zeros(128, dtype=torch.int32)}, "'model.norm.weight' has dtype 'int32'"),
    ]
    assert client.post("/weights", content=_safetensors(good)).status_code == 401  # the weight routes' token
    for weights, named in cases:
        out = client.post("/weights", content=_safetensors(weights), headers=auth)
        assert out.status_code == 400 and named in out.json()["error"]["message"], out.text
    for name, tensor in engine.own.state_dict().items():
        assert torch.equal(tensor, original[name]), name  # not one tensor loaded
    assert _sample(client) == before and service.weights_version is None

    # A push that fits loads (and changes what is sampled); the original weights put back.
    moved = {k: v + 0.5 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in good.items()}
    out = client.post("/weights", content=_safetensors(moved), headers={**auth, "X-Unirl-Weights-Version": "1"})
    assert out.status_code == 200 and out.json()["weights_version"] == "1"
    assert _sample(client) != before
    assert client.post("/weights", content=_safetensors(good), headers=auth).status_code == 200
    assert _sample(client) == before


def test_weight_routes_refuse_bad_connects_and_receives_in_one_line(served):
    client, service, *_ = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/weights/connect", json={"host": "127.0.0.1", "port": 9}).status_code == 401
    assert client.get("/weights").status_code == 401
    spec = client.get("/weights", headers=auth).json()["tensors"]
    assert spec["model.norm.weight"] == {"shape": [128], "dtype": "float32"} and "lm_head.weight" in spec  # tied
    out = client.post("/weights/connect", json={"host": "127.0.0.1", "port": 9, "timeout_s": 10**9}, headers=auth)
    assert out.status_code == 400 and "'timeout_s' must be in 1..300" in out.json()["error"]["message"]
    start = time.monotonic()
    out = client.post("/weights/connect", json={"host": "127.0.0.1", "port": 9, "timeout_s": 1}, headers=auth)
    message = out.json()["error"]["message"]
    assert out.status_code == 502 and "could not join the trainer's weight group at 127.0.0.1:9" in message
    assert "\n" not in message and "frame" not in message and time.monotonic() - start < 30
    service.group = object()  # as if a trainer had joined: the spec is checked before any receive
    out = client.post("/weights/receive", json={"tensors": [{"name": "model.norm.weight", "shape": [3],
                                                            "dtype": "float32"}]}, headers=auth)
    assert out.status_code == 400 and "'model.norm.weight' has shape [3]" in out.json()["error"]["message"]
    assert service.group is None  # dropped: the pusher's broadcast fails at once instead of waiting


def test_a_server_without_a_token_hands_the_one_it_made_to_a_trainer_on_this_machine(tmp_path, monkeypatch):
    from unirl.rollout.server_client import _token, token_path, write_token

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("UNIRL_ROLLOUT_TOKEN", raising=False)
    path = write_token("made-at-start", 8123)
    assert path == token_path(8123) and path.read_text() == "made-at-start"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert _token("http://127.0.0.1:8123") == "made-at-start"
    assert _token("http://10.1.2.3:8123") is None  # another machine's server: only $UNIRL_ROLLOUT_TOKEN
    monkeypatch.setenv("UNIRL_ROLLOUT_TOKEN", "given")
    assert _token("http://127.0.0.1:8123") == "given"


def test_the_trainer_refuses_answers_it_cannot_train_on():
    from unirl.rollout.server_client import check_answer

    def g(ids, lps=None, **kw):
        return {"response_ids": ids, "logprobs": [-0.5] * len(ids) if lps is None else lps, "text": "x",
                "finished": False, **kw}

    ok = {"generations": [[g([1, 2]), g([3])], [g([4]), g([])]]}
    gens = check_answer(ok, prompts=2, per_prompt=2, max_new_tokens=2, vocab_size=78)
    assert [[x.response_ids for x in group] for group in gens] == [[[1, 2], [3]], [[4], []]]
    bad = [
        ({}, "no 'generations' list"),
        ({"generations": [[g([1]), g([2])]]}, "1 groups of generations for 2 prompts"),
        ({"generations": [[g([1])], [g([2]), g([3])]]}, "prompt 0's group holding 1 samples, not 2"),
        ({"generations": [[g([1]), g([78])], [g([4]), g([])]]}, "prompt 0's sample 1 holding token id 78, outside"),
        ({"generations": [[g([1]), g([-3])], [g([4]), g([])]]}, "holding token id -3"),
        ({"generations": [[g([1]), g([2, 3], [-1.0])], [g([4]), g([])]]}, "sample 1 with 1 log-probs for 2 tokens"),
        ({"generations": [[g([1]), g([1, 2, 3])], [g([4]), g([])]]}, "3 tokens long, over max_new_tokens=2"),
        ({"generations": [[g([1]), "x"], [g([4]), g([])]]}, "prompt 0's sample 1 not a JSON object"),
    ]
    for out, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            check_answer(out, prompts=2, per_prompt=2, max_new_tokens=2, vocab_size=78)


@pytest.fixture(scope="module")
def live(served):
    """The app served over HTTP in a thread (the trainer's client speaks HTTP and gloo)."""
    from unirl.serving.server import AppServer

    client, service, engine, original = served
    server = AppServer(client.app, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", service, engine, original
    server.shutdown()
    server.server_close()


def test_a_trainer_with_a_wrong_token_is_told_at_once_and_a_wrong_model_before_its_push(live, monkeypatch):
    from unirl.rollout.server_client import RolloutServerError, ServerEngine

    url, service, engine, original = live
    monkeypatch.delenv("UNIRL_ROLLOUT_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent-unirl-test")
    for token in (None, "wrong"):
        start = time.monotonic()
        with pytest.raises(RolloutServerError, match=rf"rollout server {url} refused the token on GET /weights "
                                                     r"\(401\): set \$UNIRL_ROLLOUT_TOKEN"):
            ServerEngine(url, token=token, timeout_s=30)
        assert time.monotonic() - start < 10  # was a 120 s wait ending in a DistStoreError

    trainer = ServerEngine(url, token=TOKEN, timeout_s=30, vocab_size=78)
    weights = list(original.items())
    wrong = [(n, torch.zeros(3) if n == "model.norm.weight" else t) for n, t in weights]
    with pytest.raises(RolloutServerError, match=r"serves another model: tensor 'model.norm.weight' has shape \[3\]"):
        trainer.load_weights(wrong)
    trainer.load_weights(weights)  # the right ones go through the weight group
    assert service.weights_version == "1" and all(torch.equal(t, original[n]) for n, t in engine.own.state_dict().items())
    gens = trainer.generate([[3, 4, 5]], n=2, max_new_tokens=4, temperature=1.0, seed=3)
    assert len(gens) == 1 and len(gens[0]) == 2 and all(len(x.response_ids) <= 4 for x in gens[0])
    json.dumps([x.logprobs for x in gens[0]])  # plain floats


def test_a_load_that_fails_after_the_checks_stops_generation_instead_of_serving_a_mix(served):
    """The transformers engine loads strictly: a push of some tensors passes the checks (vLLM takes such a
    push) and fails while loading, after the tensors it holds were copied in; the server then says so on every
    generation (503, restart) rather than sample from a mix of two versions."""
    from fastapi.testclient import TestClient

    from unirl.rollout.hf import HFEngine
    from unirl.rollout.server import RolloutService, make_app

    client, service, engine, original = served
    own = HFEngine.with_own_copy(engine.own, engine.tokenizer, torch.device("cpu"))
    fresh = TestClient(make_app(RolloutService(own, "tiny", params=service.params), _open(), _open()))
    partial = {"model.norm.weight": torch.zeros(128)}
    out = fresh.post("/weights", content=_safetensors(partial))
    assert out.status_code == 500 and "Missing key" in out.json()["error"]["message"]
    gen = fresh.post("/generate", json={"prompt_ids": [[3, 4]], "max_new_tokens": 2})
    assert gen.status_code == 503 and "restart `unirl serve-rollout`" in gen.json()["error"]["message"]


def _open():
    from unirl.serving.guards import Guards

    return Guards.from_settings("serve-rollout", max_body_mb=8, body_timeout_s=5, token=None, token_env="UNSET_X")


def test_a_join_that_waits_holds_neither_generations_nor_a_second_join(live):
    """issue 51: eight joins to a dead port delayed every generation by ~78 s (they took the threads the
    generations run on). Now one join waits, on threads of its own; a second is refused (409)."""
    import urllib.error
    import urllib.request

    url, *_ = live

    def post(path, body, token=TOKEN):
        request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST", headers={
            "Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    waiting = threading.Thread(target=post, args=("/weights/connect", {"host": "127.0.0.1", "port": 9, "timeout_s": 2}))
    waiting.start()
    time.sleep(0.5)
    status, out = post("/weights/connect", {"host": "127.0.0.1", "port": 9, "timeout_s": 2})
    assert status == 409 and "another trainer is joining" in out["error"]["message"]
    start = time.monotonic()
    status, _ = post("/generate", {"prompt_ids": [[3, 4]], "max_new_tokens": 2}, token=None)
    assert status == 200 and time.monotonic() - start < 3 and waiting.is_alive()
    waiting.join()
