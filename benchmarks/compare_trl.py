"""unirl beside TRL's ``GRPOTrainer``: the same model, prompts, batch shape, lengths and optimizer.

    pip install -e .[bench]                      # TRL (never imported by unirl/)
    python benchmarks/compare_trl.py             # all four runs, ~10 minutes on 2 CPU cores
    python benchmarks/compare_trl.py --runs unirl-vllm,trl-hf --steps 4
    python benchmarks/compare_trl.py --model smollm2-135m-instruct --runs unirl-vllm,trl-hf
    python benchmarks/compare_trl.py --device cuda --dtype bfloat16 --shape qwen2.5-0.5b --new-tokens 128 \
        --runs unirl-hf,trl-hf                 # Qwen2.5-0.5B's shape on one GPU, HF generate in both

``--model toy`` (the default) is a randomly initialised Qwen2 shape (8 layers, hidden 512, head_dim 64,
22.6M parameters) with the tiny model's character tokenizer, written once to a local directory that both
libraries load; the prompts are the tiny addition task's questions, scored by the ``gsm8k`` reward.
Every step: 16 prompts x 8 samples, up to 32 new tokens at temperature 1, one AdamW step over the
128 samples in one forward/backward (token-mean loss, clip 0.2, no KL, constant lr, grad-norm clip 1).

``--shape`` changes the toy's shape: ``qwen2.5-0.5b`` (hidden 896, 24 layers, 14 heads, 2 kv heads,
intermediate 4864, vocabulary 151936, tied embeddings: 494M parameters) or ``key=value,...`` over
``hidden,layers,heads,kv_heads,intermediate,vocab``; the character tokenizer writes only its own ~80 ids,
and ids past it (which a random model samples) decode to nothing. ``--device``, ``--dtype`` (the weights'
dtype in both libraries: pure bf16, no float32 master copy), ``--prompts``, ``--group`` and
``--new-tokens`` set the rest; ``--gradient-checkpointing on|off`` sets it in both (default: each
library's own, unirl off and TRL on). On CUDA the table adds each run's peak GPU memory
(``torch.cuda.max_memory_allocated``).

``--model smollm2-135m-instruct`` is the real model (``unirl models prepare``, fp32, 134.5M parameters,
vocabulary 49,152) on ``smollm2_math``'s word problems with verl's GSM8K instruction, asked through
the model's chat template in both libraries (unirl: ``data.chat_template``; TRL: conversational
prompts), scored by verl's strict ``gsm8k``; 8 prompts x 8 samples, 32 new tokens, otherwise as above.

Each run is a child process (so its peak resident memory is its own) that times each step; the
table shows the median over the steps after the first (warm-up), unirl's stages (``time/*``) and
its framework overhead (step - rollout - update), and each run's s/step over the faster TRL mode's.
TRL's defaults are kept otherwise: with vLLM it recomputes the old log-probs for its importance
sampling correction.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = ("unirl-vllm", "unirl-hf", "trl-hf", "trl-vllm")
MODELS = ("toy", "smollm2-135m-instruct")
GROUP, NEW_TOKENS, LR, SEED = 8, 32, 1e-5, 0
#: Prompts a step: the toy's 16 as before; the real model's 8 (smollm2_math's batch shape).
PROMPTS = {"toy": 16, "smollm2-135m-instruct": 8}
#: Named toy shapes (vocab None: the character tokenizer's size).
SHAPES = {
    "toy": dict(hidden=512, intermediate=1152, layers=8, heads=8, kv_heads=8, vocab=None),
    "qwen2.5-0.5b": dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936),
}


def parse_shape(text: str) -> dict:
    """A named shape, or ``key=value,...`` over the toy's keys (the others keep the toy's values)."""
    if text in SHAPES:
        return dict(SHAPES[text])
    shape = dict(SHAPES["toy"])
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in shape or not value.isdigit():
            raise SystemExit(f"--shape: {item!r} is not key=integer over {sorted(shape)} (or one of {sorted(SHAPES)})")
        shape[key] = int(value)
    return shape


# ------------------------------------------------------------------------- shared inputs
def build_inputs(root: Path, model: str, shape: dict) -> tuple[Path, Path]:
    """The model directory and the prompts (JSONL of ``question``, ``answer``) for ``--model``."""
    return build_toy_inputs(root, shape) if model == "toy" else build_real_inputs(root, model)


def build_real_inputs(root: Path, model: str) -> tuple[Path, Path]:
    """The prepared real model and smollm2_math's training questions with verl's instruction appended
    (the gsm8k adapter's prompt), so both libraries send the same text through the chat template."""
    from unirl.models.named import prepare
    from unirl.text.arithmetic import rows
    from unirl.text.data import GSM8K_INSTRUCTION

    data = root / f"{model}-prompts.jsonl"
    if not data.exists():
        root.mkdir(parents=True, exist_ok=True)
        data.write_text("".join(json.dumps({"question": f"{r['question']} {GSM8K_INSTRUCTION}", "answer": r["answer"]}) + "\n"
                                for r in rows("train", 2000, seed=SEED, max_operand=9)))
    return prepare(model), data


def build_toy_inputs(root: Path, shape: dict) -> tuple[Path, Path]:
    """The model directory (random Qwen2 of ``shape``, tiny tokenizer) and the prompts (JSONL)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from unirl.text.tiny import addition_rows, build_tokenizer

    name = "qwen2-22m" if shape == SHAPES["toy"] else "qwen2-" + "-".join(f"{k}{v}" for k, v in shape.items())
    model_dir, data = root / name, root / "prompts.jsonl"
    if not (model_dir / "config.json").exists():
        tokenizer = build_tokenizer()
        config = Qwen2Config(vocab_size=shape["vocab"] or len(tokenizer), tie_word_embeddings=True,
                             bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, dtype="float32", hidden_size=shape["hidden"],
                             intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                             num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                             max_position_embeddings=1024)
        torch.manual_seed(SEED)
        model = Qwen2ForCausalLM(config)
        model.save_pretrained(model_dir, safe_serialization=True)
        model.generation_config.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in addition_rows(2000, seed=SEED + 1)))
    return model_dir, data


# ------------------------------------------------------------------------------- children
def run_unirl(engine: str, model_dir: Path, data: Path, steps: int, micro: int, extra: list[str], prompts: int,
              run: dict) -> dict:
    from unirl.cli import load_run_config
    from unirl.trainer.loop import Trainer
    from unirl.text.env import TextEnvironment

    out = Path(tempfile.mkdtemp(prefix="unirl-vs-trl-")) / "run"
    cfg = load_run_config("text", "tiny", [
        f"model.name_or_path={model_dir}", f"data.train={data}", "data.test=null", f"rollout.engine={engine}",
        f"rollout.max_new_tokens={run['new_tokens']}", "rollout.temperature=1.0", f"trainer.total_steps={steps}",
        f"trainer.prompts_per_step={prompts}", f"trainer.group_size={run['group']}",
        f"trainer.mini_batch_size={prompts * run['group']}", f"model.dtype={run['dtype']}",
        *([f"model.gradient_checkpointing={run['gc'] == 'on'}"] if run["gc"] else []),
        f"trainer.micro_batch_size={micro}", "trainer.ppo_epochs=1", "trainer.eval_every=0", "trainer.progress=false",
        f"trainer.seed={SEED}", "algo.loss_agg=token-mean", "algo.clip_low=0.2", "algo.clip_high=0.2", "algo.kl_coef=0.0",
        f"optim.lr={LR}", "optim.max_grad_norm=1.0", "optim.warmup_steps=0", *extra,
    ], output_dir=str(out))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    trainer.setup()
    try:
        rows = [trainer.train_step() for _ in range(steps)]
    finally:
        if trainer.source is not None:  # source.max_staleness >= 1: the producer stops before its engine
            trainer.source.close(wait=False)
        trainer.env.close()
    return {"steps": [{k: v for k, v in r.items() if k.startswith("time/")} for r in rows]}


def run_trl(use_vllm: bool, model_dir: Path, data: Path, steps: int, prompts: int, chat: bool, run: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from unirl.rewards.gsm8k import gsm8k

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    # A real model's prompts go through its chat template (TRL's conversational format), as unirl's do.
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}] if chat else r["question"],
                                  "answer": r["answer"]} for r in rows])

    def reward(completions, answer, **kwargs):
        texts = [c[-1]["content"] if chat else c for c in completions]  # conversational: the assistant message
        return gsm8k(texts, answer=answer, method="strict")

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    out = tempfile.mkdtemp(prefix="trl-vs-unirl-")
    args = GRPOConfig(
        output_dir=out, use_cpu=run["device"] == "cpu", seed=SEED, max_steps=steps,
        per_device_train_batch_size=prompts * run["group"], gradient_accumulation_steps=1, num_generations=run["group"],
        max_completion_length=run["new_tokens"], temperature=1.0,
        model_init_kwargs={"dtype": getattr(torch, run["dtype"])},
        **({"gradient_checkpointing": run["gc"] == "on"} if run["gc"] else {}),
        num_iterations=1, beta=0.0, loss_type="dapo", epsilon=0.2, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none",
        use_vllm=use_vllm, vllm_mode="colocate", bf16=False, fp16=False, disable_tqdm=True,
    )
    timer = StepTimes()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args, train_dataset=dataset, callbacks=[timer])
    trainer.train()
    return {"steps": [{"time/step": t} for t in timer.times]}


def child(args) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"  # unirl's Accelerator on the CPU even where CUDA is present
    import torch

    model_dir, data, prompts = Path(args.model_dir), Path(args.data), args.prompts
    run = dict(device=args.device, dtype=args.dtype, group=args.group, new_tokens=args.new_tokens,
               gc=args.gradient_checkpointing)
    if args.child.startswith("unirl-"):
        # The real model's context is 8k tokens; prompts of ~90 tokens and 32 new ones need 256 (smollm2_math's).
        extra = ([] if args.model == "toy" else ["rollout.max_model_len=256"]) + args.unirl_override
        result = run_unirl(args.child.removeprefix("unirl-"), model_dir, data, args.steps, args.micro_batch_size,
                           extra, prompts, run)
    else:
        result = run_trl(args.child == "trl-vllm", model_dir, data, args.steps, prompts, args.model != "toy", run)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if torch.cuda.is_available() and args.device == "cuda":  # the whole run's peak, set-up included
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 1024 ** 3
    Path(args.out).write_text(json.dumps(result))


# --------------------------------------------------------------------------------- parent
def summarise(result: dict) -> dict:
    steps = result["steps"][1:]  # the first pays for warm-up
    med = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in steps[0]}  # async: publish only some steps
    row = {"step": med["time/step"], "peak": result["peak_rss_mib"], "n": len(steps),
           "gpu": result.get("peak_gpu_gib")}
    if "time/rollout" in med:
        row.update(rollout=med["time/rollout"], old=med.get("time/old_logprobs", 0.0), update=med["time/update"],
                   overhead=statistics.median(s["time/step"] - s["time/rollout"] - s["time/update"] for s in steps))
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=5, help="steps per run; the first is warm-up (default 5)")
    parser.add_argument("--model", choices=MODELS, default="toy",
                        help="the randomly initialised toy (default) or a real model that unirl prepares offline")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="unirl's samples per forward/backward (default: the whole step's; TRL: one forward)")
    parser.add_argument("--unirl-override", action="append", default=[], help="extra unirl key=value (repeatable)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both libraries run")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the weights' dtype in both")
    parser.add_argument("--shape", default="toy", help=f"the toy's shape: {', '.join(SHAPES)} or key=value,...")
    parser.add_argument("--prompts", type=int, default=None, help="prompts a step (default: the model's, 16 or 8)")
    parser.add_argument("--group", type=int, default=GROUP, help=f"samples a prompt (default {GROUP})")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help=f"new tokens at most (default {NEW_TOKENS})")
    parser.add_argument("--gradient-checkpointing", choices=("on", "off"), default=None,
                        help="in both libraries (default: each one's own, unirl off and TRL on)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--work", default=None, help="where the model and prompts are written (default: the cache)")
    parser.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    args.prompts = args.prompts or PROMPTS[args.model]
    args.micro_batch_size = args.micro_batch_size or args.prompts * args.group
    if args.child:
        return child(args)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first is warm-up)")
    runs = [r for r in args.runs.split(",") if r]
    if unknown := set(runs) - set(RUNS):
        parser.error(f"unknown runs {sorted(unknown)}; choose from {RUNS}")

    from unirl.models.cache import default_cache_dir

    root = Path(args.work) if args.work else default_cache_dir() / "compare-trl"
    shape = parse_shape(args.shape)
    model_dir, data = build_inputs(root, args.model, shape)
    results, failures = {}, {}
    for name in runs:
        out = root / f"{name}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--child", name, "--model", args.model, "--model-dir", str(model_dir), "--data", str(data),
               "--out", str(out), "--steps", str(args.steps), "--micro-batch-size", str(args.micro_batch_size),
               "--device", args.device, "--dtype", args.dtype, "--prompts", str(args.prompts), "--group", str(args.group),
               "--new-tokens", str(args.new_tokens),
               *(["--gradient-checkpointing", args.gradient_checkpointing] if args.gradient_checkpointing else []),
               *[f"--unirl-override={o}" for o in args.unirl_override]]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode or not out.exists():
            lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
            failures[name] = lines[-1] if lines else f"exit status {proc.returncode}"
            print(f"{name}: failed ({failures[name]})", flush=True)
            continue
        results[name] = summarise(json.loads(out.read_text()))
        print(f"{name}: {results[name]['step']:.2f} s/step ({wall:.0f} s wall with start-up)", flush=True)

    print_table(args, shape, runs, results, failures)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "shape": shape, "results": results,
                                               "failures": failures}, indent=1))


def print_table(args, shape: dict, runs: list[str], results: dict, failures: dict) -> None:
    """The markdown table: s/step, unirl's stages, peak memory (GPU on CUDA) and the ratio to the faster TRL."""
    trl = [results[r]["step"] for r in ("trl-hf", "trl-vllm") if r in results]
    best = min(trl) if trl else None
    if args.model != "toy":
        what = f"{args.model}, chat template"
    else:
        what = f"Qwen2 shape {args.shape}" + ("" if shape["vocab"] else " (22.6M parameters)")
    print(f"\n{args.prompts} prompts x {args.group} samples, {args.new_tokens} new tokens, {what}, {args.dtype} on "
          f"{args.device}; median of steps 2-{args.steps}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| run | s/step | rollout | old log-probs | update | overhead | peak RSS | peak GPU | vs faster TRL |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in runs:
        if name in failures:
            print(f"| {name} | failed: {failures[name][:80]} | | | | | | | |")
            continue
        r = results[name]
        stages = (f"{r['rollout']:.2f} | {r['old']:.2f} | {r['update']:.2f} | {r['overhead']:.2f} "
                  f"({r['overhead'] / r['step']:.0%})" if "rollout" in r else " | | | ")
        ratio = f"{r['step'] / best:.2f}x" if best else ""
        gpu = f"{r['gpu']:.1f} GiB" if r.get("gpu") is not None else ""
        print(f"| {name} | {r['step']:.2f} | {stages} | {r['peak'] / 1024:.1f} GB | {gpu} | {ratio} |")

if __name__ == "__main__":
    main()
