#!/usr/bin/env bash
# The GPU check, as one prepared run of at most 10 minutes: the gpu tests, then tokens/s and
# MFU of a ~1B Llama in bf16 under ZeRO-2 and ZeRO-3 against the plain DeepSpeed loop, then
# save and resume seconds against the disk. Writes OUT/gpu.json and OUT/gpu_table.md.
#
#     bash bench/gpu.sh [OUT]              # on the GPU host (OUT: bench/results/gpu)
#     GPU_BENCH_SIZE=tiny bash bench/gpu.sh OUT   # the same path on a CPU, in a few minutes
#
# Needs the repository's .venv (the README's install); installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results/gpu}"
size="${GPU_BENCH_SIZE:-1b}"
mkdir -p "$out"
py=.venv/bin/python
t0=$SECONDS

# 1. The gpu tests (skips name their reason; on a CPU they all skip). Their failure is
# recorded and the figures still run: the JSON says both.
set +e
timeout 240 .venv/bin/pytest -m gpu -q -rs -p no:cacheprovider --junitxml "$out/gpu_tests.xml" \
    > "$out/gpu_tests.log" 2>&1
tests_rc=$?
set -e
summary="$(grep -E '(passed|failed|skipped|error)' "$out/gpu_tests.log" | tail -n 1 | tr -d '=' | xargs)"
echo "pytest -m gpu: rc $tests_rc, $summary ($((SECONDS - t0)) s)"

# 2. and 3. The figures, inside what is left of the 10 minutes (less a margin for the exit).
budget=$((540 - (SECONDS - t0)))
"$py" bench/bench_gpu.py --out "$out" --size "$size" --budget-s "$budget" \
    --tests-rc "$tests_rc" --tests-summary "$summary"
echo "bench/gpu.sh: $((SECONDS - t0)) s; $out/gpu.json, $out/gpu_table.md"
exit "$tests_rc"
