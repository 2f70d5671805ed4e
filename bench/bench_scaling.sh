#!/usr/bin/env bash
# Scaling of cost with work: step time and checkpoint save time of the byte-level
# GPT for model sizes spanning 28x (0.9M -> 25.5M parameters, 2 ranks), and for 1 -> 2 -> 3
# ranks at 10.9M parameters; then bench/plot_scaling.py draws bench/scaling.png.
#   bash bench/bench_scaling.sh [OUT_DIR [PNG]]        (about 12 minutes on 2 cores)
# SCALING_QUICK=1: two tiny sizes, and 1 and 3 ranks at the smaller (a smoke test).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/scaling}
png=${2:-bench/scaling.png}
sizes=("128 4" "256 4" "384 6" "512 8") wide="384 6"
if [ "${SCALING_QUICK:-0}" = 1 ]; then
  sizes=("32 1" "64 1") wide="32 1"
fi
mkdir -p "$out"
DS=.venv/bin/deepspeed
export OMP_NUM_THREADS=1
port() {  # a free rendezvous port, drawn as the engine draws its own
  .venv/bin/python -c 'from wonderland_ds.launch.command import free_port; print(free_port())'
}
run() {  # NPROC DIM LAYERS
  local n=$1 dim=$2 layers=$3 name="pylm_d$2_l$3_n$1"
  $DS --num_gpus "$n" --no_ssh_check --master_addr 127.0.0.1 \
    --master_port $(port) bench/bench_engine.py --out "$out/$name.json" \
    --task pylm --dim "$dim" --layers "$layers" --micro 2 --gas 1 --zero 2 \
    --steps 8 --reps 1 --save 3 > "$out/$name.log" 2>&1
  echo "== $name"
}
# shellcheck disable=SC2086
for size in "${sizes[@]}"; do
  run 2 $size
done
# shellcheck disable=SC2086
run 1 $wide
# shellcheck disable=SC2086
run 3 $wide
.venv/bin/python bench/plot_scaling.py "$out" "$png"
