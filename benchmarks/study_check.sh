#!/usr/bin/env bash
# The `study` stage of benchmarks/gpu_check.sh: one study packed by memory, then the same study one job at a time,
# on GPU 0, and each job's final validation loss of the two compared.
#
#   bash benchmarks/study_check.sh STUDY_DIR ALPACA_JSON
#
# The study: 16 jobs, Gemma-2B shape with random weights on real alpaca data, lora.r 8/16 x learning rate 1e-4/2e-4
# x 4 seeds, 100 steps, each job within hardware.memory_budget_gib=7.5 (so the packer can hold all 16 at once; both
# arms run this same config, so the same choices and the same losses). Resumable: run it again with the same
# STUDY_DIR and it goes on where it stopped. The packed arm runs once (with a warm-up run before it that builds the
# random checkpoint and leaves a throughput record for the plan); the one-at-a-time arm runs until
# $STUDY_DEADLINE_S seconds after this script started (default 540), is stopped there, and the next invocation
# re-launches it: the launcher skips the jobs that completed and re-runs the one that was stopped. The comparison
# (study_compare.json) is written at every invocation from what exists; "alone.complete" says whether every job ran
# one at a time. nvidia-smi samples utilisation and memory once a second during each arm (when it exists).
#
# STUDY_ARGS replaces the study's settings (a CPU rehearsal of this script uses a tiny study).
set -uo pipefail
WORK=$1 ALPACA=$2
DEADLINE=${STUDY_DEADLINE_S:-540}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
cd "$(dirname "$0")/.."
if [ -n "${STUDY_ARGS:-}" ]; then
  read -r -a STUDY <<< "$STUDY_ARGS"
  read -r -a WARM <<< "${STUDY_WARM_ARGS:-}"
else
  COMMON=(model=gemma_2b model.random_init=true hardware=gpu hardware.memory_budget_gib=7.5 data=alpaca
    "data.path=$ALPACA" data.max_seq_len=512 trainer=default trainer.max_steps=100 trainer.val_every_n_steps=50
    trainer.limit_val_batches=8 trainer.sample_count=0 trainer.checkpoint_every_n_steps=1000 logger=csv)
  STUDY=("${COMMON[@]}" lora.r=8,16 trainer.learning_rate=1e-4,2e-4 seeds=4
    "hydra.job.config.override_dirname.exclude_keys=[model,model.random_init,hardware,hardware.memory_budget_gib,data,data.path,data.max_seq_len,trainer,trainer.max_steps,trainer.val_every_n_steps,trainer.limit_val_batches,trainer.sample_count,trainer.checkpoint_every_n_steps,logger]")
  # One job's settings for 20 steps, as a one-job sweep: builds the random-weight checkpoint outside both arms' clocks, and is the
  # completed run of the same model on this GPU that the plan takes its time per step from.
  WARM=("${COMMON[@]}" trainer.max_steps=20 lora.r=8)
fi
LAUNCH=(python3 -m exp.train -m hydra/launcher=gpus "hydra.launcher.devices=[0]" ${STUDY_LAUNCHER_ARGS:-})

sample() {  # sample FILE: nvidia-smi once a second into FILE, in the background; prints its pid
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -i 0 -l 1 > "$1" &
    echo $!
  fi
}
launched() { [ -f "$1/placements.jsonl" ] && grep -q '"launch_end"' "$1/placements.jsonl"; }

if ! launched "$WORK/packed"; then
  # Through the launcher, so that its record holds the job's whole wall-clock, the process's start included.
  "${LAUNCH[@]}" "${WARM[@]}" hydra.sweep.dir="multirun/study_warmup_$(date +%Y%m%d_%H%M%S)" > "$WORK/warm.txt" 2>&1
  echo "warm-up run: exit $? ($(grep -h 'steps in' "$WORK/warm.txt" | tail -1))"
  "${LAUNCH[@]}" hydra.launcher.pack=true "${STUDY[@]}" hydra.sweep.dir="$WORK/packed" --plan > "$WORK/plan.txt" 2>&1
  cat "$WORK/plan.txt"
  smi=$(sample "$WORK/smi_packed.csv"); t0=$SECONDS
  "${LAUNCH[@]}" hydra.launcher.pack=true "${STUDY[@]}" hydra.sweep.dir="$WORK/packed" > "$WORK/packed.txt" 2>&1
  echo "packed: exit $? after $((SECONDS - t0)) s"; [ -n "$smi" ] && kill "$smi"
  python3 -m exp.report "$WORK/packed" > "$WORK/report_packed.txt" 2>&1 || echo "exp.report packed: exit $? (see report_packed.txt)"
fi

# STUDY_ALONE_FROM: a one-at-a-time arm recorded earlier (its job directories, weights not needed): the re-launch
# below reuses the jobs it completed (same fingerprint) and runs the others. Only valid while the training code is
# the same as when it ran; the comparison then says how many jobs came from where (their launches).
if [ -n "${STUDY_ALONE_FROM:-}" ] && [ ! -d "$WORK/alone" ]; then
  cp -r "$STUDY_ALONE_FROM" "$WORK/alone" && echo "alone: continuing the arm recorded in $STUDY_ALONE_FROM"
fi
left=$((DEADLINE - SECONDS))
if [ "$left" -gt "${STUDY_MIN_LEFT_S:-60}" ] && ! launched "$WORK/alone"; then
  n=$(ls "$WORK"/smi_alone_*.csv 2>/dev/null | wc -l)
  smi=$(sample "$WORK/smi_alone_$n.csv"); t0=$SECONDS
  # At the deadline timeout's TERM reaches the launcher and the job it runs (one process group): the job stops as
  # a preempted run does, and the next invocation runs it again.
  timeout --signal=TERM --kill-after=30 "$left" "${LAUNCH[@]}" "${STUDY[@]}" hydra.sweep.dir="$WORK/alone" \
    >> "$WORK/alone.txt" 2>&1
  echo "alone: exit $? after $((SECONDS - t0)) s (limit $left s)"; [ -n "$smi" ] && kill "$smi"
fi
if launched "$WORK/alone"; then
  python3 -m exp.report "$WORK/alone" > "$WORK/report_alone.txt" 2>&1 || echo "exp.report alone: exit $? (see report_alone.txt)"
fi
python3 benchmarks/study_compare.py "$WORK"
