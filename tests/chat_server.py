"""A real OpenAI-compatible chat server for the judge tests: a transformers model behind ``POST /v1/chat/completions``.

Not a test module. ``python tests/chat_server.py MODEL_DIR PORT`` serves the model (greedy decoding,
``max_tokens`` new tokens) on 127.0.0.1:PORT with FastAPI and uvicorn, as ``vllm serve`` would, only
lighter: no KV-cache reservation (vLLM's CPU server reserves gigabytes) and no vLLM needed. Start-up was
about the same on the busy 2-core machine (37 s against vLLM's 46 s, both mostly imports), and
``vllm.entrypoints.openai.api_server`` on the same model gave the same scores through ``llm_judge``.
A model without a chat template (the tiny one) reads the last user message as it is. Requests are
answered one at a time (a lock; the model is not thread-safe), and ``GET /stats`` says how many
completions it has served, so a test can see what a cache kept from the server.
"""

from __future__ import annotations

import sys
import threading
import time

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from transformers import AutoModelForCausalLM, AutoTokenizer


def make_app(model_dir: str) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    app, lock, served = FastAPI(), threading.Lock(), {"completions": 0}

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.get("/stats")
    def stats():
        return served

    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        body = await request.json()
        messages, max_tokens = body["messages"], int(body.get("max_tokens", 16))
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = tokenizer(messages[-1]["content"]).input_ids
        with lock, torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            served["completions"] += 1
        text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        return JSONResponse({"id": f"chat-{served['completions']}", "object": "chat.completion",
                             "created": int(time.time()), "model": body.get("model"),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": text}}]})

    return app


if __name__ == "__main__":
    torch.set_num_threads(1)
    uvicorn.run(make_app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
