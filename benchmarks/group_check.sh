#!/usr/bin/env bash
# The `groupstudy` and `group7b` stages of benchmarks/gpu_check.sh: a study whose jobs share one base
# (hydra.launcher.share_base=true, exp.study.group_fit) against the same study packed by memory, on GPU 0.
#
#   bash benchmarks/group_check.sh WORK ALPACA_JSON 2b|7b [ARM ...]      (ARM: grouped, packed; default: both)
#
# 2b: docs/sweeps.md's packed study (16 jobs, Gemma-2B shape with random weights on real alpaca data, lora.r 8/16 x
#     learning rate 1e-4/2e-4 x 4 seeds, $GROUP_STEPS (100) steps at 8 x 512, each job within
#     hardware.memory_budget_gib=7.5), validating on the whole held-out split (both arms score the same examples
#     whatever their batching).
# 7b: the same grid with 2 seeds (8 jobs) on the Gemma-7B shape, $GROUP_STEPS (30) steps, each job within 16 GiB.
# A warm-up job first (20 steps) builds the random-weight checkpoint outside the arms' clocks. Each arm: its --plan,
# the study with nvidia-smi sampled once a second, exp.report; then benchmarks/group_compare.py compares the arms
# (and $GROUP_REFERENCE, an earlier recorded arm's sweep directory, when given). An arm that completed is not run
# again (its directory is kept): call again to add the other arm. STUDY_ARGS replaces the settings, and
# STUDY_LAUNCHER_ARGS adds launcher settings (a CPU rehearsal: hydra.launcher.memory_gib=[8] for the packed arm).
set -uo pipefail
WORK=$1 ALPACA=$2 SHAPE=$3
shift 3
ARMS=("$@")
[ ${#ARMS[@]} -eq 0 ] && ARMS=(grouped packed)
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
cd "$(dirname "$0")/.."
EXCLUDE="hydra.job.config.override_dirname.exclude_keys=[model,model.random_init,hardware,hardware.memory_budget_gib,data,data.path,data.max_seq_len,trainer,trainer.max_steps,trainer.val_every_n_steps,trainer.limit_val_batches,trainer.sample_count,trainer.checkpoint_every_n_steps,logger]"
if [ -n "${STUDY_ARGS:-}" ]; then
  read -r -a STUDY <<< "$STUDY_ARGS"
  read -r -a WARM <<< "${STUDY_WARM_ARGS:-}"
else
  if [ "$SHAPE" = 7b ]; then
    COMMON=(model=gemma_7b model.random_init=true hardware=gpu hardware.memory_budget_gib=16 data=alpaca
      "data.path=$ALPACA" data.max_seq_len=512 trainer=default "trainer.max_steps=${GROUP_STEPS:-30}"
      trainer.val_every_n_steps=30 trainer.sample_count=0 trainer.checkpoint_every_n_steps=1000 logger=csv)
    STUDY=("${COMMON[@]}" lora.r=8,16 trainer.learning_rate=1e-4,2e-4 seeds=2 "$EXCLUDE")
  else
    COMMON=(model=gemma_2b model.random_init=true hardware=gpu hardware.memory_budget_gib=7.5 data=alpaca
      "data.path=$ALPACA" data.max_seq_len=512 trainer=default "trainer.max_steps=${GROUP_STEPS:-100}"
      trainer.val_every_n_steps=50 trainer.sample_count=0 trainer.checkpoint_every_n_steps=1000 logger=csv)
    STUDY=("${COMMON[@]}" lora.r=8,16 trainer.learning_rate=1e-4,2e-4 seeds=4 "$EXCLUDE")
  fi
  WARM=("${COMMON[@]}" trainer.max_steps=20 lora.r=8)
fi
LAUNCH=(python3 -m exp.train -m hydra/launcher=gpus "hydra.launcher.devices=[0]" ${STUDY_LAUNCHER_ARGS:-})
declare -A MODE=([grouped]="hydra.launcher.share_base=true" [packed]="hydra.launcher.pack=true")

sample() {  # sample FILE: nvidia-smi once a second into FILE, in the background; prints its pid
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -i 0 -l 1 > "$1" &
    echo $!
  fi
}
launched() { [ -f "$1/placements.jsonl" ] && grep -q '"launch_end"' "$1/placements.jsonl"; }

if [ ! -f "$WORK/warm.txt" ]; then
  "${LAUNCH[@]}" "${WARM[@]}" hydra.sweep.dir="$WORK/warmup" > "$WORK/warm.txt" 2>&1
  echo "warm-up run: exit $? ($(grep -h 'steps in' "$WORK/warm.txt" | tail -1))"
fi
for a in "${ARMS[@]}"; do
  launched "$WORK/$a" && continue
  "${LAUNCH[@]}" ${MODE[$a]} "${STUDY[@]}" hydra.sweep.dir="$WORK/$a" --plan > "$WORK/plan_$a.txt" 2>&1
  cat "$WORK/plan_$a.txt"
  smi=$(sample "$WORK/smi_$a.csv"); t0=$SECONDS
  "${LAUNCH[@]}" ${MODE[$a]} "${STUDY[@]}" hydra.sweep.dir="$WORK/$a" > "$WORK/$a.txt" 2>&1
  echo "$a: exit $? after $((SECONDS - t0)) s"; [ -n "$smi" ] && kill "$smi"
  python3 -m exp.report "$WORK/$a" > "$WORK/report_$a.txt" 2>&1 || echo "exp.report $a: exit $? (see report_$a.txt)"
done
python3 benchmarks/group_compare.py "$WORK" ${GROUP_REFERENCE:+"$GROUP_REFERENCE"}
