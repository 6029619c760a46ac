#!/usr/bin/env bash
# The `study` stage of benchmarks/gpu_check.sh: one study packed by memory, then one job at a time, on GPU 0.
#
#   bash benchmarks/study_check.sh WORK_DIR ALPACA_JSON
#
# Both arms run the same 16 jobs (Gemma-2B shape with random weights, alpaca data, lora.r 8/16 x learning rate
# 1e-4/2e-4 x 4 seeds, 100 steps). The packed arm runs to its end; the one-at-a-time arm gets what is left of
# $STUDY_BUDGET_S (default 420 s, counted after the warm-up run that builds the random checkpoint) and stops there:
# its wall-clock for all 16 jobs is extrapolated from the jobs it completed (mean seconds per job x 16), and the
# results say how many that was. nvidia-smi samples utilisation and memory once a second during each arm. Results:
# WORK_DIR/{plan.txt, packed/, alone/, smi_*.csv, report_*.txt, study_compare.json}.
set -uo pipefail
WORK=$1 ALPACA=$2
BUDGET=${STUDY_BUDGET_S:-420}
mkdir -p "$WORK"
cd "$(dirname "$0")/.."
STUDY=(model=gemma_2b model.random_init=true hardware=gpu data=alpaca "data.path=$ALPACA" data.max_seq_len=512
  lora.r=8,16 trainer.learning_rate=1e-4,2e-4 seeds=4 trainer=default trainer.max_steps=100
  trainer.val_every_n_steps=50 trainer.limit_val_batches=8 trainer.sample_count=0
  trainer.checkpoint_every_n_steps=1000 logger=csv
  "hydra.job.config.override_dirname.exclude_keys=[model,model.random_init,hardware,data,data.path,data.max_seq_len,trainer,trainer.max_steps,trainer.val_every_n_steps,trainer.limit_val_batches,trainer.sample_count,trainer.checkpoint_every_n_steps,logger]")
# The model's random-weight checkpoint is built once, outside both arms' clocks.
python3 -m exp.train model=gemma_2b model.random_init=true hardware=gpu trainer=default trainer.max_steps=1 \
  trainer.sample_count=0 logger=none hydra.run.dir="$WORK/warm" > "$WORK/warm.txt" 2>&1
echo "warm-up run exit $?"

sample() { nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -i 0 -l 1 > "$1" & echo $!; }
t_start=$SECONDS
python3 -m exp.train -m hydra/launcher=gpus hydra.launcher.pack=true "hydra.launcher.devices=[0]" "${STUDY[@]}" \
  hydra.sweep.dir="$WORK/packed" --plan > "$WORK/plan.txt" 2>&1
cat "$WORK/plan.txt"

smi=$(sample "$WORK/smi_packed.csv"); t0=$SECONDS
python3 -m exp.train -m hydra/launcher=gpus hydra.launcher.pack=true "hydra.launcher.devices=[0]" "${STUDY[@]}" \
  hydra.sweep.dir="$WORK/packed" > "$WORK/packed.txt" 2>&1
echo "packed: exit $? after $((SECONDS - t0)) s"; kill "$smi"
python3 -m exp.report "$WORK/packed" > "$WORK/report_packed.txt" 2>&1; cat "$WORK/report_packed.txt"

left=$((BUDGET - (SECONDS - t_start)))
smi=$(sample "$WORK/smi_alone.csv"); t0=$SECONDS
timeout --signal=TERM --kill-after=30 "$((left > 30 ? left : 30))" python3 -m exp.train -m hydra/launcher=gpus \
  "hydra.launcher.devices=[0]" "${STUDY[@]}" hydra.sweep.dir="$WORK/alone" > "$WORK/alone.txt" 2>&1
echo "alone: exit $? after $((SECONDS - t0)) s (limit $left s)"; kill "$smi"
python3 -m exp.report "$WORK/alone" > "$WORK/report_alone.txt" 2>&1; tail -30 "$WORK/report_alone.txt"

python3 - "$WORK" <<'PY'
import csv, json, statistics, sys
from pathlib import Path

work = Path(sys.argv[1])

def arm(name):
    events = [json.loads(l) for l in (work / name / "placements.jsonl").read_text().splitlines()]
    ends = {e["job"]: e for e in events if e["event"] == "end"}
    wall = next((e["wall_clock_s"] for e in events if e["event"] == "launch_end"), None)
    plan = next(e for e in events if e["event"] == "plan")
    losses = {}
    for job, e in ends.items():
        s = work / name / job / "summary.json"
        if e["status"] == "completed" and s.exists():
            losses[job] = json.loads(s.read_text())["final_val"]["val/loss"]
    util = []
    smi = work / f"smi_{name}.csv"
    if smi.exists():
        util = [float(r[1]) for r in csv.reader(smi.open()) if len(r) == 3 and r[1].strip().replace(".", "").isdigit()]
    done = [e["seconds"] for e in ends.values() if e["status"] == "completed"]
    return {"wall_clock_s": wall, "completed": len(losses), "jobs": len(plan["jobs"]),
            "planned_wall_clock_s": plan["wall_clock_s"], "mean_job_s": statistics.mean(done) if done else None,
            "gpu_util_mean": statistics.mean(util) if util else None, "max_concurrent":
            max((e.get("running_before", 0) + 1 for e in events if e["event"] == "start"), default=0),
            "val_loss": losses}

packed, alone = arm("packed"), arm("alone")
if alone["completed"] < alone["jobs"] and alone["mean_job_s"]:
    alone["extrapolated_wall_clock_s"] = alone["mean_job_s"] * alone["jobs"]
both = sorted(set(packed["val_loss"]) & set(alone["val_loss"]))
diff = {j: packed["val_loss"][j] - alone["val_loss"][j] for j in both}
out = {"packed": packed, "alone": alone, "val_loss_diff_packed_minus_alone": diff,
       "max_abs_diff": max((abs(d) for d in diff.values()), default=None)}
(work / "study_compare.json").write_text(json.dumps(out, indent=2))
print(json.dumps({k: v for k, v in out.items() if k != "val_loss_diff_packed_minus_alone"}, indent=2)[:4000])
PY
