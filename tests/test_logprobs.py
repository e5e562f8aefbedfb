"""Chunked token log-probs (``unirl/text/logprobs.py``) against the full-vocabulary logits.

The reference everywhere is the path the text environment used before: ``z = (h W^T + b).float() / T``,
``logp = z.gather(target) - z.logsumexp()``, ``entropy = unirl.core.entropy_from_logits(z)``, with
autograd's gradients. Values and gradients (wrt hidden states, head weight and bias, and through a
real model: every parameter, LoRA's, and DDP-synchronised ones over 2 gloo processes) agree to 1e-5
in float32, for chunk sizes that do and do not divide the number of tokens, with padded positions,
with and without the entropy.
"""

from __future__ import annotations

import math
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import text_env
from unirl.core import entropy_from_logits
from unirl.text.logprobs import response_logprobs, token_logprobs

TOL = dict(rtol=1e-5, atol=1e-5)


def _full(hidden, weight, targets, temperature, bias=None):
    """The full-logits reference: [n, R, H] -> logp, entropy [n, R]."""
    z = F.linear(hidden, weight, bias).float() / temperature  # [n, R, V]
    return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1), entropy_from_logits(z)


def test_hand_derived_values():
    # One token, H = 1, V = 2: logits (0, ln 2) / T with T = 1 -> p = (1/3, 2/3).
    hidden = torch.ones(1, 1, 1)
    weight = torch.tensor([[0.0], [math.log(2.0)]])
    logp, entropy = token_logprobs(hidden, weight, torch.tensor([[1]]), chunk_size=1, with_entropy=True)
    assert logp.item() == pytest.approx(math.log(2 / 3), abs=1e-7)
    assert entropy.item() == pytest.approx(-(1 / 3 * math.log(1 / 3) + 2 / 3 * math.log(2 / 3)), abs=1e-7)
    # T = ln 2 makes the logits (0, 1): p = (1, e) / (1 + e); no entropy asked, none returned.
    logp, entropy = token_logprobs(hidden, weight, torch.tensor([[0]]), temperature=math.log(2.0), chunk_size=4)
    assert logp.item() == pytest.approx(-math.log(1 + math.e), abs=1e-6) and entropy is None


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])  # 7 does not divide n*R = 3*9 = 27; 64 > 27: one chunk
def test_values_and_gradients_match_full_logits(seed, with_entropy, chunk_size):
    g = torch.Generator().manual_seed(seed)
    n, R, H, V, T = 3, 9, 16, 37, 0.7
    hidden = torch.randn(n, R, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) / 2).requires_grad_()
    bias = torch.randn(V, generator=g).requires_grad_()
    targets = torch.randint(V, (n, R), generator=g)
    mask = (torch.arange(R) < torch.tensor([[9], [5], [1]])).float()  # [n, R] right-padded responses
    a, c = torch.randn(n, R, generator=g), torch.randn(n, R, generator=g)  # upstream weights of logp, entropy

    logp, entropy = token_logprobs(hidden, weight, targets, temperature=T, chunk_size=chunk_size,
                                   with_entropy=with_entropy, bias=bias)
    ref_logp, ref_entropy = _full(hidden, weight, targets, T, bias)
    torch.testing.assert_close(logp, ref_logp, **TOL)
    loss, ref_loss = (a * logp * mask).sum(), (a * ref_logp * mask).sum()
    if with_entropy:
        torch.testing.assert_close(entropy, ref_entropy, **TOL)
        loss, ref_loss = loss + (c * entropy * mask).sum(), ref_loss + (c * ref_entropy * mask).sum()
    got = torch.autograd.grad(loss, (hidden, weight, bias))
    want = torch.autograd.grad(ref_loss, (hidden, weight, bias))
    for x, y in zip(got, want):
        assert y.abs().max() > 1e-2  # the comparison is not between zeros
        torch.testing.assert_close(x, y, **TOL)
    assert torch.all(got[0][mask == 0] == 0)  # padded positions get exactly no gradient


def test_entropy_alone_and_logp_alone_backpropagate():
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(2, 6, 8, generator=g, requires_grad=True), torch.randn(11, 8, generator=g)
    targets = torch.randint(11, (2, 6), generator=g)
    logp, entropy = token_logprobs(hidden, weight, targets, chunk_size=5, with_entropy=True)
    ref_logp, ref_entropy = _full(hidden, weight, targets, 1.0)
    for out, ref in ((entropy, ref_entropy), (logp, ref_logp)):  # only one output used in each backward
        torch.testing.assert_close(torch.autograd.grad(out.sum(), hidden, retain_graph=True)[0],
                                   torch.autograd.grad(ref.sum(), hidden, retain_graph=True)[0], **TOL)


def test_gradients_are_exact_in_float64():
    """gradcheck: the analytic backward against finite differences, independent of the reference."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(9, (2, 5), generator=g)
    fn = lambda h, w, b: token_logprobs(h, w, targets, temperature=1.3, chunk_size=3, with_entropy=True, bias=b)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_bfloat16_autocast_matches_the_full_path_under_autocast():
    """Under autocast the head's matmul runs in bfloat16 as the model's own head would; logits are float32 after."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 10, 32, generator=g, requires_grad=True)
    weight = torch.randn(50, 32, generator=g, requires_grad=True)
    targets = torch.randint(50, (2, 10), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = token_logprobs(hidden, weight, targets, chunk_size=6, with_entropy=True)
        ref_logp, ref_entropy = _full(hidden, weight, targets, 1.0)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, **TOL)  # the same bf16 logits, the same float32 math
    torch.testing.assert_close(entropy, ref_entropy, **TOL)
    got = torch.autograd.grad((logp + entropy).sum(), (hidden, weight))
    want = torch.autograd.grad((ref_logp + ref_entropy).sum(), (hidden, weight))
    for x, y in zip(got, want):  # both multiply bf16-rounded gradients; summation order differs
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)


def test_bad_shapes_and_chunk_size_are_errors():
    h, w, t = torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        token_logprobs(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match=r"hidden \(2, 3, 4\) must be targets' shape \(2, 4\)"):
        token_logprobs(h, w, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"weight must be \[V, H=4\]"):
        token_logprobs(h, torch.zeros(5, 3), t)


# ------------------------------------------------------------------------------------------------
# Through a model: the text environment, LoRA, a head that is changed afterwards, DDP
# ------------------------------------------------------------------------------------------------


def _old_evaluate(model, t, temperature):
    """The text environment's evaluate before chunking, verbatim in substance."""
    P = t["prompt_ids"].shape[1]
    ids = torch.cat([t["prompt_ids"], t["response_ids"]], dim=1)
    attn = torch.cat([t["prompt_mask"], t["response_mask"].long()], dim=1)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False).logits
    logits = logits[:, P - 1:-1].float() / temperature
    logp = logits.gather(-1, t["response_ids"].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return logp, entropy_from_logits(logits)


def _padded_batch(vocab: int, seed: int, n: int = 5, P: int = 6, R: int = 7) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of different lengths (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len, response_len = torch.randint(2, P + 1, (n,), generator=g), torch.randint(1, R + 1, (n,), generator=g)
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()  # [n, P]
    response_mask = (torch.arange(R) < response_len[:, None]).float()  # [n, R]
    prompt_ids = torch.randint(3, vocab, (n, P), generator=g) * prompt_mask
    response_ids = torch.randint(3, vocab, (n, R), generator=g) * response_mask.long()
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
            "response_mask": response_mask}


def _text_env(tmp_path, *overrides):
    return text_env(tmp_path, "trainer.prompts_per_step=4", "trainer.group_size=2", "trainer.mini_batch_size=8",
                    "trainer.micro_batch_size=8", "rollout.temperature=0.8", "algo.entropy_coef=0.01", *overrides)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("lora", [False, True])
def test_text_env_evaluate_matches_the_full_logits_path(tmp_path, tiny_lm_dir, lora):
    from unirl.env import Rollout

    # One padded row per sample, as _old_evaluate: this test is about the chunks (packed rows: test_packing.py).
    overrides = ["model.logprob_chunk_size=4", "model.share_prompt=false"] + (
        ["model.lora.enabled=true", "model.lora.r=4"] if lora else [])
    env = _text_env(tmp_path, *overrides)
    try:
        model = env.model.train()
        if lora:  # LoRA's B starts at zero, which would make its A's gradient zero on both paths
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.1)
        t = _padded_batch(len(env.tokenizer), seed=11)
        batch = Rollout(tensors=t, group_ids=torch.arange(5), prompts=[""] * 5, samples=[""] * 5)
        out = env.actions.score_actions(model, batch)
        logp, entropy = _old_evaluate(model, t, temperature=0.8)
        mask = t["response_mask"]
        torch.testing.assert_close(out["logp"], logp, **TOL)
        torch.testing.assert_close(out["entropy"], entropy, **TOL)
        assert torch.equal(out["mask"], mask)
        w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
        ((w * out["logp"] - out["entropy"]) * mask).sum().backward()
        got = _grads(model)
        ((w * logp - entropy) * mask).sum().backward()
        want = _grads(model)
        assert got.keys() == want.keys() and len(got) > 0
        if lora:
            assert all("lora_" in name for name in got) and any("lora_A" in name for name in got)
        else:
            assert "model.embed_tokens.weight" in got  # the tied head's gradient adds to the embedding's
        for name in want:
            assert want[name].abs().max() > 0, name
            torch.testing.assert_close(got[name], want[name], **TOL, msg=name)
    finally:
        env.close()


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_lora_on_the_output_head_needs_the_full_path(tmp_path, tiny_lm_dir):
    from unirl.env import Rollout

    env = _text_env(tmp_path, "model.lora.enabled=true", "model.lora.target_modules=[q_proj,lm_head]",
                    "model.share_prompt=false")  # padded rows, as _old_evaluate
    try:
        t = _padded_batch(len(env.tokenizer), seed=1)
        batch = Rollout(tensors=t, group_ids=torch.arange(5), prompts=[""] * 5, samples=[""] * 5)
        with pytest.raises(ValueError, match="plain torch.nn.Linear, got Linear .*model.logprob_chunk_size=null"):
            env.actions.score_actions(env.model, batch)
        env.cfg.model.logprob_chunk_size = None  # the full logits: LoRA's head delta included
        torch.testing.assert_close(env.actions.score_actions(env.model, batch)["logp"], _old_evaluate(env.model, t, 0.8)[0], **TOL)
    finally:
        env.close()


class _ScaledHeadLM(torch.nn.Module):
    """A causal LM that changes its head's output (as Gemma's soft-capping or Cohere's logit scale do)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, **kwargs):
        return SimpleNamespace(logits=self.lm_head(self.embed(input_ids)) * 2.0)


def test_a_model_that_changes_its_head_output_is_refused():
    model, t = _ScaledHeadLM(), _padded_batch(10, seed=0)
    ids = torch.cat([t["prompt_ids"], t["response_ids"]], 1)
    args = (model, model.lm_head, ids, torch.ones_like(ids), torch.zeros_like(ids), t["response_ids"])
    with pytest.raises(ValueError, match="_ScaledHeadLM changes its output head's result.*logprob_chunk_size=null"):
        response_logprobs(*args, temperature=1.0, chunk_size=4)
    assert "forward" not in model.lm_head.__dict__  # the head is itself again
    logp, _ = response_logprobs(*args, temperature=1.0, chunk_size=None)  # the full path sees the scaling
    logits = (model.lm_head(model.embed(ids)) * 2.0)[:, -8:-1]
    torch.testing.assert_close(logp, logits.log_softmax(-1).gather(-1, t["response_ids"][..., None]).squeeze(-1))


def _tiny_qwen2(tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config).float()


_DDP_CASES = [(True, False), (False, True)]  # (tied head, find_unused_parameters)


def _ddp_worker(rank: int, port: int, out_dir: str):
    """One of 2 gloo processes: chunked log-probs through DDP's forward, gradients synchronised."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for tied, find_unused in _DDP_CASES:
            model = _tiny_qwen2(tied)
            ddp = DDP(model, find_unused_parameters=find_unused)
            t = _padded_batch(40, seed=100 + rank)
            ids = torch.cat([t["prompt_ids"], t["response_ids"]], 1)
            attn = torch.cat([t["prompt_mask"], t["response_mask"].long()], 1)
            logp, entropy = response_logprobs(ddp, model.get_output_embeddings(), ids, attn,
                                              (attn.cumsum(-1) - 1).clamp(min=0), t["response_ids"],
                                              temperature=0.9, chunk_size=3, with_entropy=True)
            ((logp - 0.1 * entropy) * t["response_mask"]).sum().backward()
            if rank == 0:
                torch.save({n: p.grad for n, p in model.named_parameters()},
                           os.path.join(out_dir, f"ddp-{tied}-{find_unused}.pt"))
        # Both processes done before either tears gloo down: one leaving while the other still
        # works aborted it now and then ("terminate called without an active exception", about 1
        # run in 5 under load; 0 in 30 with this barrier).
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_synchronises_the_chunked_gradients(tmp_path):
    """The head runs inside DDP's forward, so its gradient is averaged over processes like every other
    one, with a tied head and with an untied one while DDP looks for unused parameters (an untied head
    applied after DDP's forward would be reported unused, then DDP fails with "Expected to mark a
    variable ready only once")."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    for tied, find_unused in _DDP_CASES:
        got = torch.load(tmp_path / f"ddp-{tied}-{find_unused}.pt", weights_only=True)
        # Reference: the full logits of each process's batch on one process, gradients averaged.
        model = _tiny_qwen2(tied)
        for rank in (0, 1):
            t = _padded_batch(40, seed=100 + rank)
            logp, entropy = _old_evaluate(model, t, temperature=0.9)
            ((logp - 0.1 * entropy) * t["response_mask"]).sum().div(2).backward()
        assert ("lm_head.weight" in got) == (not tied)
        for name, p in model.named_parameters():
            assert got[name] is not None and p.grad.abs().max() > 0, name
            torch.testing.assert_close(got[name], p.grad, **TOL, msg=f"tied={tied}: {name}")
