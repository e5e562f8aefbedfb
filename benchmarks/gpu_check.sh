#!/usr/bin/env bash
# unirl's check on one GPU (issue 32), under 7 minutes on an H100/H200: the tiny text and diffusion
# configs on CUDA with rollout.engine=hf, the Qwen2.5-0.5B-shape comparison with TRL (HF generate in
# both, bf16), and the test suite on 8 xdist workers. Each part runs under its own `timeout` (SIGINT
# first, so pytest still prints its summary), and everything it measured lands in $OUT:
#   summary.txt   the card, the versions, each part's exit status and seconds, the key figures
#   compare.log, compare.json   benchmarks/compare_trl.py's table and results
#   compare_static.log, compare_async.log (.json)   unirl alone with rollout.hf_cache=static / max_staleness=1
#   tiny.log      the two tiny runs' last metrics rows and run_info.json
#   profile.log, profile.json   benchmarks/generate_profile.py: TRL's generate call against HFEngine's
#   suite.log, suite.xml        pytest's output and its JUnit report
#
# The suite rarely fits beside the rest: SUITE names what to run (default: tests), SUITE_REST=FILE runs
# every collected test that FILE (an earlier call's suite.log, brought back and carried again, e.g. as
# .gpu/suite.log: the machine keeps nothing between calls) does not list, and PARTS
# (default "compare compare-static compare-async profile tiny suite") picks the parts. A prebuilt toy cache (UNIRL_CACHE, e.g. a copy
# of a CPU session's test cache carried in .gpu/cache) saves each worker its toy builds.
#
# Wheels the GPU machine lacks (diffusers, trl, datasets ...) are installed from $WHEELS (default .gpu/,
# see ../shared/gpu-wheels/README.md; WHEELS= installs none). Run from the repository's root:  bash benchmarks/gpu_check.sh
# ASYNC_CACHES (default "dynamic static") picks compare-async's runs. A rehearsal on a CPU of the parts' commands,
# at a toy's size (the script's own mistakes found before a GPU session spends its minutes on them):
#   WHEELS= PY=.venv/bin/python DEVICE=cpu DTYPE=float32 SHAPE=toy NEW_TOKENS=16 PARTS="compare-static compare-async" \
#     ASYNC_CACHES=static STATIC_STEPS=3 ASYNC_STEPS=3 OUT=/tmp/gpu-check-rehearsal bash benchmarks/gpu_check.sh
# (the SD3.5-Medium-shape diffusion step is not part of it: building a 2.24B transformer at random and
# stepping it does not fit beside the rest in 7 minutes).
set -u
OUT=${OUT:-/tmp/unirl-gpu-check}
WHEELS=${WHEELS-.gpu}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16} SHAPE=${SHAPE:-qwen2.5-0.5b}
# The 0.5B-shape comparison's batch: 16 prompts x 8 samples, 128 new tokens.
SIZE="--device $DEVICE --dtype $DTYPE --shape $SHAPE --prompts 16 --group 8 --new-tokens ${NEW_TOKENS:-128}"
SITE="${TMPDIR:-/tmp}/site"
mkdir -p "$OUT"
S="$OUT/summary.txt"
T0=$(date +%s)

if [[ -n $WHEELS ]]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    >>"$S" 2>&1 || echo "pip install of $WHEELS/*.whl failed" >>"$S"
  export PYTHONPATH="$SITE:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export UNIRL_CACHE=${UNIRL_CACHE:-${TMPDIR:-/tmp}/unirl-cache} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
{
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import sys, torch, transformers, accelerate, diffusers, trl, peft; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, \
'diffusers', diffusers.__version__, 'trl', trl.__version__, 'peft', peft.__version__)"
} >>"$S" 2>&1

# part NAME SECONDS LOG COMMAND...: run it under its own timeout, log its status and time.
part() {
  local name=$1 limit=$2 log=$3 start rc
  shift 3
  start=$(date +%s)
  timeout -k 15 -s INT "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "$name: exit $rc in $(($(date +%s) - start)) s (limit $limit s)" | tee -a "$S"
}

PARTS=" ${PARTS:-compare compare-static compare-async profile tiny suite} "
W=${TMPDIR:-/tmp}/compare-trl

# 1. The 0.5B-shape comparison with TRL: HF generate in both, bf16 weights, 16 prompts x 8, 128 new tokens.
if [[ $PARTS == *" compare "* ]]; then
part compare ${COMPARE_SECONDS:-200} "$OUT/compare.log" $PY benchmarks/compare_trl.py $SIZE \
  --steps ${COMPARE_STEPS:-4} --runs unirl-hf,trl-hf --work "$W" --json "$OUT/compare.json"
tail -n 6 "$OUT/compare.log" >>"$S"
fi

# 1a. unirl again with rollout.hf_cache=static (transformers compiles decoding, once: the cache is sized for the
# run's longest call; the first step pays for it): the same table, to set beside TRL's row above.
if [[ $PARTS == *" compare-static "* ]]; then
part compare-static ${COMPARE_SECONDS:-200} "$OUT/compare_static.log" $PY benchmarks/compare_trl.py $SIZE \
  --steps ${STATIC_STEPS:-${COMPARE_STEPS:-4}} --runs unirl-hf --unirl-override=rollout.hf_cache=static ${STATIC_OVERRIDES:-} --work "$W" --json "$OUT/compare_static.json"
tail -n 3 "$OUT/compare_static.log" >>"$S"
fi

# 1b. unirl with source.max_staleness=1 (issue 34): a producer thread samples the next batch with a copy of the
# weights while the trainer updates, on the one GPU. Its s/step is the trainer's; the rollout column is its wait.
if [[ $PARTS == *" compare-async "* ]]; then
# With the static cache too: compiled decoding leaves the host (and the interpreter lock) to the trainer.
for cache in ${ASYNC_CACHES:-dynamic static}; do
  name=compare-async; [[ $cache == static ]] && name=compare-async-static
  part $name ${COMPARE_SECONDS:-200} "$OUT/${name//-/_}.log" $PY benchmarks/compare_trl.py $SIZE \
    --steps ${ASYNC_STEPS:-5} --runs unirl-hf --unirl-override=source.max_staleness=1 \
    --unirl-override=rollout.hf_cache=$cache ${ASYNC_OVERRIDES:-} --work "$W" --json "$OUT/${name//-/_}.json"
  tail -n 3 "$OUT/${name//-/_}.log" >>"$S"
done
fi

# 1c. The rollout alone: generate as TRL calls it against HFEngine (same model, prompts and seed), ~80 s.
# PROFILE_FLAGS=--profile adds torch.profiler tables for two variants (~60 s more each on an H200).
if [[ $PARTS == *" profile "* ]]; then
part profile ${PROFILE_SECONDS:-120} "$OUT/profile.log" $PY benchmarks/generate_profile.py --device $DEVICE \
  --dtype $DTYPE --shape $SHAPE --prompts 16 --group 8 --new-tokens ${NEW_TOKENS:-128} --repeats 2 ${PROFILE_FLAGS:-} \
  --variants trl,trl+logprobs,unirl,unirl-static,unirl-packed --work "$W" --json "$OUT/profile.json"
tail -n 7 "$OUT/profile.log" >>"$S"
fi

# 2. The tiny configs on CUDA (vLLM is not on this machine: the transformers engine).
if [[ $PARTS == *" tiny "* ]]; then
R=${TMPDIR:-/tmp}/unirl-runs
rm -rf "$R"
part tiny-text 90 "$OUT/tiny.log" $PY -m unirl.cli train text --config tiny --output-dir "$R/text" \
  rollout.engine=hf trainer.total_steps=60 trainer.eval_every=30 trainer.save_every=0 trainer.progress=false
part tiny-diffusion 60 "$OUT/tiny.log" $PY -m unirl.cli train diffusion --config tiny --output-dir "$R/diffusion" \
  trainer.total_steps=10 trainer.eval_every=0 trainer.save_every=0 trainer.progress=false
for run in text diffusion; do
  { echo "== $run: run_info.json, first and last metrics rows"; cat "$R/$run/run_info.json"
    grep reward/mean "$R/$run/metrics.jsonl" | sed -n '1p;$p'; grep eval/ "$R/$run/metrics.jsonl"; } >>"$OUT/tiny.log" 2>&1
done
grep -h '"eval/accuracy"' "$R/text/metrics.jsonl" 2>/dev/null | $PY -c "import sys, json; \
print('tiny text eval/accuracy:', [round(json.loads(l)['eval/accuracy'], 3) for l in sys.stdin])" >>"$S" 2>&1
fi

# 3. The suite, on 8 workers of 2 threads, in whatever time is left (TOTAL_SECONDS in all, default 7
# minutes). On an H100 that was 4 minutes and 494 of ~1,300 tests (2026-11-26).
if [[ $PARTS == *" suite "* ]]; then
TARGETS=${SUITE:-tests}
if [[ -n ${SUITE_REST:-} ]]; then  # the tests an earlier part did not reach
  TARGETS=$($PY benchmarks/suite_rest.py "$SUITE_REST") || { echo "SUITE_REST=$SUITE_REST: no list, stopping" >>"$S"; exit 2; }
fi
export OMP_NUM_THREADS=2
LEFT=$((${TOTAL_SECONDS:-410} - ($(date +%s) - T0)))
[[ -n $TARGETS ]] && part suite "$((LEFT > 60 ? LEFT : 60))" "$OUT/suite.log" $PY -m pytest -n 8 -p no:cacheprovider \
  -v -rfEs --timeout 240 --junitxml="$OUT/suite.xml" $TARGETS
tail -n 3 "$OUT/suite.log" >>"$S"
grep -E "^(FAILED|ERROR) " "$OUT/suite.log" >>"$S"
fi
echo "total: $(($(date +%s) - T0)) s" >>"$S"
cat "$S"
