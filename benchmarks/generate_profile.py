"""Where the transformers-engine rollout spends its time: ``generate`` called as TRL calls it, against
unirl's ``HFEngine`` and the pieces that differ between them, on one model and one batch.

    python benchmarks/generate_profile.py --device cuda --dtype bfloat16 --shape qwen2.5-0.5b
    python benchmarks/generate_profile.py --shape toy --new-tokens 32        # the CPU toy, a smoke run

Variants, each timed over ``--repeats`` calls after one warm-up call (same prompts, same seeds):
  trl          ``model.generate`` with TRL 1.16's GRPO generation config (its ``generation_kwargs``:
               do_sample, temperature, top_p 1, top_k 0, repetition_penalty 1, disable_compile) on the
               prompts repeated ``--group`` times, as TRL's sampler repeats them
  trl+nrs      the same with ``num_return_sequences=--group`` in place of repeated prompts
  trl+logprobs trl+nrs plus unirl's ``SampledTokenLogprobs`` processor (the sampled tokens' log-probs)
  unirl        ``HFEngine.generate`` (what ``rollout.engine=hf`` runs), model on transformers' sdpa
  unirl-static the same with ``rollout.hf_cache=static`` (on a GPU transformers compiles the decoding step;
               the warm-up call pays the compilation)
  unirl-packed the same after ``use_packed_attention`` (what ``model.share_prompt=true`` installs)
Random weights never sample EOS, so every variant generates ``--new-tokens`` tokens for every row.
``--profile`` adds torch.profiler's top operators for ``trl`` and the last unirl variant (at the 0.5B shape on an H200,
~60 s each: run the timings first). Results: a markdown table
(median seconds, ms per generated step, peak memory) and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_trl import SHAPES, build_toy_inputs, parse_shape  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> dict:
    fn()  # warm-up
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 1024 ** 3 if device == "cuda" else None
    return {"median_s": statistics.median(times), "all_s": times, "peak_gib": peak}


def profile_top(fn, device: str, rows: int = 18) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    tables = []
    for key in (("self_device_time_total", "self_cuda_time_total") if device == "cuda" else ()) + ("self_cpu_time_total",):
        try:
            tables.append(prof.key_averages().table(sort_by=key, row_limit=rows))
        except (AttributeError, KeyError, ValueError) as err:  # the key's name differs between torch versions
            tables.append(f"(sorting by {key}: {err})")
    return "\n".join(tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--shape", default="toy", help=f"{', '.join(SHAPES)} or key=value,... (compare_trl.py)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="trl,trl+nrs,trl+logprobs,unirl,unirl-packed")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--work", default=None, help="where the model is written (compare_trl.py's --work)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessorList

    from unirl.rollout.hf import HFEngine, SampledTokenLogprobs
    from unirl.text.packing import use_packed_attention

    root = Path(args.work or tempfile.mkdtemp(prefix="generate-profile-"))
    model_dir, data = build_toy_inputs(root, parse_shape(args.shape))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype),
                                                 attn_implementation="sdpa").to(args.device).eval()
    questions = [json.loads(line)["question"] for line in data.read_text().splitlines()[: args.prompts]]
    prompt_ids = [tokenizer(q)["input_ids"] for q in questions]
    width = max(map(len, prompt_ids))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=args.device)
    attn = (torch.arange(width, device=args.device)[None] >= torch.tensor(
        [width - len(p) for p in prompt_ids], device=args.device)[:, None]).long()
    G, T = args.group, args.new_tokens
    trl_config = GenerationConfig(max_new_tokens=T, do_sample=True, pad_token_id=pad, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=[tokenizer.eos_token_id], temperature=1.0, top_p=1.0, top_k=0,
                                  min_p=None, repetition_penalty=1.0, cache_implementation=None, disable_compile=True)

    @torch.no_grad()
    def trl():
        torch.manual_seed(0)
        return model.generate(input_ids=ids.repeat_interleave(G, 0), attention_mask=attn.repeat_interleave(G, 0),
                              generation_config=trl_config)

    @torch.no_grad()
    def trl_nrs(processors=None):
        torch.manual_seed(0)
        return model.generate(input_ids=ids, attention_mask=attn, generation_config=trl_config,
                              num_return_sequences=G, logits_processor=processors)

    def trl_logprobs():
        keep = SampledTokenLogprobs(1.0)
        seqs = trl_nrs(LogitsProcessorList([keep]))
        return keep.finish(seqs[:, width:])

    engine = HFEngine(lambda: model, tokenizer)

    def unirl():
        return engine.generate(prompt_ids, n=G, max_new_tokens=T, temperature=1.0, seed=0)

    static = HFEngine(lambda: model, tokenizer, cache="static")

    def unirl_static():  # rollout.hf_cache=static: transformers compiles decoding on a GPU (warm-up compiles)
        return static.generate(prompt_ids, n=G, max_new_tokens=T, temperature=1.0, seed=0)

    fns = {"trl": trl, "trl+nrs": trl_nrs, "trl+logprobs": trl_logprobs, "unirl": unirl, "unirl-static": unirl_static,
           "unirl-packed": unirl}
    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(fns):
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(fns)}")
    variants.sort(key=lambda v: v == "unirl-packed")  # it switches the model's attention for good: last
    results, profiles = {}, {}
    for name in variants:
        if name == "unirl-packed":
            use_packed_attention(model)
        results[name] = timed(fns[name], args.device, args.repeats)
        r = results[name]
        print(f"{name}: {r['median_s']:.3f} s ({1000 * r['median_s'] / T:.1f} ms/step)", flush=True)
    # After every timing (a cut-short run keeps them); the model's attention is packed once unirl-packed ran.
    for name in ("trl", "unirl-packed" if "unirl-packed" in results else "unirl") if args.profile else ():
        if name in results:
            profiles[name] = profile_top(fns[name], args.device)
            print(f"== profile {name}\n{profiles[name]}", flush=True)

    base = results.get("trl", next(iter(results.values())))["median_s"]
    print(f"\n{args.prompts} prompts x {G}, {T} new tokens, shape {args.shape}, {args.dtype} on {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "") + f", median of {args.repeats}")
    print("| variant | s/call | ms/step | peak GiB | vs trl |\n|---|---|---|---|---|")
    for name, r in results.items():
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else ""
        print(f"| {name} | {r['median_s']:.3f} | {1000 * r['median_s'] / T:.1f} | {peak} | {r['median_s'] / base:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
