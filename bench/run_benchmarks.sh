#!/usr/bin/env bash
# Runs the engine benchmarks and prints their JSON; docs/performance.md quotes the output.
#   bash bench/run_benchmarks.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
mkdir -p "$out"
DS=.venv/bin/deepspeed
export OMP_NUM_THREADS=1
port() {  # a free rendezvous port, drawn as the engine draws its own
  .venv/bin/python -c 'from wonderland_ds.launch.command import free_port; print(free_port())'
}
launch() {  # NPROC OUT ARGS...
  local n=$1 name=$2; shift 2
  $DS --num_gpus "$n" --no_ssh_check --master_addr 127.0.0.1 --master_port $(port) \
    bench/bench_engine.py --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "== $name"; cat "$out/$name.json"
}
# 1. step time, wonderland (guards on) vs a plain DeepSpeed loop vs guards off, ZeRO 1/2/3
for z in 1 2 3; do launch 2 "steps_digits_z$z" --task digits --zero "$z" --steps 400 --reps 5; done
launch 2 steps_pylm_z2 --task pylm --zero 2 --micro 8 --gas 2 --steps 40 --reps 6
# 1b. pieces of the loop apart: metrics writing (DeepSpeed's vs batched), guard hooks; the
#     check's all-reduce blocking vs overlapped
.venv/bin/python bench/bench_parts.py --steps 400 --reps 5 --out "$out/parts.json"
for w in spin sleep; do
  .venv/bin/torchrun --nproc_per_node 2 --master_port $(port) \
    bench/bench_check_allreduce.py --reps 300 --work "$w" --out "$out/check_allreduce_$w.json" > /dev/null 2>&1
  echo "== check_allreduce_$w"; cat "$out/check_allreduce_$w.json"
done
# 1c. digits in shorter runs, 20 repetitions each: a steal burst spoils one, not one of five;
#     guards off and raw-again (the noise floor) beside, ZeRO-2 with the check not overlapped too
for z in 1 3; do launch 2 "steps_digits_20x_z$z" --task digits --zero "$z" --steps 100 --reps 20 --sides wonderland,guards-off,raw-again; done
launch 2 steps_digits_20x_z2 --task digits --zero 2 --steps 100 --reps 20 --sides wonderland,guards-off,raw-again,check-blocking
#     and what reading several steps in one gather saves
launch 2 steps_digits_30x_z1_reads --task digits --zero 1 --steps 100 --reps 30 --sides wonderland,reads-1,raw-again
#     and the language model, 8 repetitions
for z in 1 2 3; do launch 2 "steps_pylm_8x_z${z}" --task pylm --zero "$z" --micro 8 --gas 2 --steps 40 --reps 8 --sides wonderland,raw-again; done
# 2. checkpoint save: a ~25M-parameter GPT, ZeRO-2, 2 ranks; DeepSpeed sync against wonderland
#    with async_save_copy (wl_*) and without (serialize_*), alternating
launch 2 save_pylm_25m --task pylm --dim 512 --layers 8 --micro 2 --gas 1 --zero 2 --skip-steps --save 8
# 3. resume: launch to first step, same and changed topology, against plain DeepSpeed
.venv/bin/python bench/bench_resume.py --reps 6 --out "$out/resume.json"
# 3c. where a same-topology resume spends its time, phase by phase, both sides
.venv/bin/python bench/resume_timeline.py --reps 3 --out "$out/timeline.json"
# 3b. universal conversion alone: stock ds_to_universal vs wonderland's, in one process
.venv/bin/python bench/bench_convert.py --reps 5 --out "$out/convert.json"
# 4. scaling with model size and rank count, and its plot (bench/scaling.png)
bash bench/bench_scaling.sh "$out/scaling"
