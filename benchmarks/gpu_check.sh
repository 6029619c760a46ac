#!/usr/bin/env bash
# exp's whole GPU path in one command, on a CUDA machine with the project's dependencies (or their wheels in .whl/):
#
#   bash benchmarks/gpu_check.sh [STAGE ...]        (no stage: all of them, in this order)
#
#   tests        python -m pytest -m gpu (every GPU test; the 2-GPU ones skip on one GPU)
#   pytest       python -m pytest -m gpu $PYTEST_ARGS (some GPU tests: files, -k expressions)
#   varlen       python -m pytest -m gpu tests/test_gpu_varlen.py alone (the padding-free attention kernels)
#   kernels      python -m pytest -m gpu on tests/test_gpu_varlen.py and tests/test_gpu.py but its training run (the
#                attention kernels, liger's loss against exp's chunked loss, placement, the device diagnoses);
#                $KERNELS_K narrows it (a pytest -k expression)
#   synth7b      exp.bench exp-only, Gemma-7B 2048 x 8 random tokens, 12 steps, whole GPU (real data's reference)
#   readme       the one-GPU commands of README.md, as written (doctor, the 7B run, then the default run with
#                hardware=auto within what is left of the stage's time)
#   bench2b      exp.bench, Gemma-2B shape, 2048 x 8: baseline, exp within the baseline's peak
#   calibration  benchmarks/memory_calibration.py: the estimator on the fast path (liger / chunked, compile on / off)
#   bench7b      exp.bench headline, Gemma-7B shape, 2048 x 8: baseline, exp within the baseline's peak
#   whole        exp.bench, Gemma-7B 2048 x 8: exp on the whole GPU (against bench7b's baseline when it ran)
#   real         exp.bench real-data mode on $EXP_ALPACA (an alpaca_en_demo.json), Gemma-7B shape
#   lean         exp.bench, Gemma-7B 2048 x 8: exp within a quarter of the baseline's peak (baseline reused)
#   capacity     exp.bench, Gemma-7B seq 2048: exp at micro-batch 128 in one micro-batch, every layer recomputed,
#                their inputs in host memory (hardware.offload_checkpoints)
#   fuse         exp.bench headline with profile=true: baseline, exp, and exp with hardware.fuse_lora=true, within
#                the baseline's peak; the baseline from $BENCH_REFERENCE when given
#   wholefuse    exp.bench, Gemma-7B 2048 x 8: exp with hardware.fuse_lora=true on the whole GPU, profiled (against
#                $BENCH_REFERENCE or this call's latest headline result)
#   auto         README's `python -m exp.train hardware=auto` alone, to its end
#   profile7b    exp.bench headline with profile=true: exp as hardware=gpu runs it, and without kept dequantized
#                weights; the baseline from $BENCH_REFERENCE (a bench7b JSON of the same settings) when given
#   bench512     exp.bench, Gemma-7B 512 x 32: baseline and exp
#   multi        2 GPUs: python -m pytest -m gpu on tests/test_gpu_multi.py and tests/test_distributed.py (DDP, FSDP,
#                model parallelism, a killed launcher then resume=auto under DDP and FSDP, torchrun against exp's own
#                launcher, the packed sweep over both GPUs, the preflight's diagnoses); their records in multi/
#   multi7b      2 GPUs: benchmarks/multi_gpu.py, the Gemma-7B shape under one GPU, DDP, FSDP and model parallelism
#                (scaling, FSDP's peak against DDP's, where the weights live); on $EXP_ALPACA when given. Resumable:
#                called again on the same (warm) machine it keeps the runs that completed (outputs/multi_gpu)
#   realpf       exp.bench real-data mode on $EXP_ALPACA, Gemma-7B shape, 2048 x 8, $REAL_STEPS (40) steps: baseline
#                and exp (padding-free, varlen attention) on the same steps; then exp on 2048 x 8 random tokens
#   trainruns    python -m exp.train on $EXP_ALPACA for each of $TRAIN_MODELS (model:steps[:override,override...],
#                or `again`: the first one again, on the caches the first run left; default Gemma 3 1B for 20 steps,
#                again, Gemma 2 2B 20, the 7B shape 200, Gemma-2B 20, Gemma 3 4B 20); console logs and summary.json
#                (compile time and graph count) in train/
#   pfprofile    exp.bench real-data mode on $EXP_ALPACA, $PF_MODEL (Gemma-7B shape), exp only, 8 examples a step,
#                the first timed steps profiled: where a padding-free step's time goes and the device's idle share
#   liger        python -m pytest -m gpu: liger's fused loss in exp's chunks against exp's chunked loss alone
#   loop200      exp.bench real-data mode on $EXP_ALPACA, Gemma-7B shape, 2048 x 8: the hand-written loop's steps
#                $FIRST_STEP (0) to $FIRST_STEP + $LOOP_STEPS (100) of the seeded order (one part of its 200-step
#                wall-clock per call: a step's work depends on its examples, not on the adapters)
#   exp200       the same file and shape: exp's 200 steps in one invocation (wall-clock, compile included), beside
#                the loop's parts of the same file that earlier loop200 calls on this machine kept (reference=)
#   valprof      benchmarks/val_profile.py on $EXP_ALPACA, Gemma 3 1B, 10 steps: start-up imports, the CUDA probe, every
#                validation batch timed, three profiled
#   synthfam     exp.bench exp-only on random tokens, 2048 x 8, for each of $SYNTH_MODELS (the families' synthetic
#                full-length tokens/s)
#   study        docs/sweeps.md's packed study: 16 jobs, Gemma-2B shape on $EXP_ALPACA (lora.r 8/16 x learning rate
#                1e-4/2e-4 x seeds=4, 100 steps each), its --plan, then packed by memory on GPU 0, then the same
#                sweep one job at a time in what is left of the stage's time; called again on the same (warm)
#                machine it goes on with the one-at-a-time arm (benchmarks/study_check.sh); nvidia-smi sampled
#                once a second during both; exp.report of each; each job's final val/loss packed vs alone
#                (outputs/gpu_study/study_compare.json; $OUT/study.tgz: the study without its weights)
#   grouptests   python -m pytest -m gpu tests/test_gpu_group.py: jobs sharing one base on the GPU against each job alone
#   groupstudy   docs/sweeps.md's 16-job study with hydra.launcher.share_base=true (benchmarks/group_check.sh 2b grouped),
#                against the packed arm recorded in $GROUP_REFERENCE (default: benchmarks/results/study_h200_20261202b/packed)
#                and, when asked for with GROUP_ARMS="grouped packed", the packed arm again on this machine
#   group7b      the same grid, 8 jobs on the Gemma-7B shape, 30 steps: grouped and packed (benchmarks/group_check.sh 7b)
#                ($OUT/group_<shape>.tgz: the arms without their weights)
#   dpo7b        exp.bench objective=dpo, Gemma-7B shape, real pairs from $EXP_ALPACA (default .whl/alpaca_en_demo.json:
#                each example's output chosen, another's rejected), data.max_seq_len 1024 per side, $PREF_MICRO_BATCH (8)
#                pairs a step, 30 steps: the hand-written HF + PEFT + bitsandbytes DPO loop (reference: adapter off),
#                then exp within its peak (liger's chunked DPO loss); learning rate $PREF_LR (5e-6)
#                ($PREF_REFERENCE: an earlier result JSON of the same settings and card, whose baseline row stands in
#                for running the loop again; benchmarks/results/h100_20261207f holds the H100 loop's rows at lr 5e-6
#                and 5e-7). PREF_FUSED=1 adds exp with hardware.fuse_lora=true (which `auto` leaves off for DPO)
#   orpo7b       the same for ORPO, $ORPO_STEPS (30) steps
#   dpostart     DPO's first two steps on the Gemma-2B shape ($DPOSTART_MODEL) and dpo7b's pairs, exp with compiled
#                and with eager layers (DPOSTART_EAGER= leaves the eager one out): every first loss must be exactly
#                ln 2 (the reference runs the policy's compiled graph)
#   dpo7bfloor   dpo7b's pairs, $PREF_FLOOR_STEPS (12) steps: the hand-written loop, a second loop of the same math
#                and other numerics (`baseline prepare=false`: bf16 norms and embedding as exp's), then exp: how far
#                per-step DPO losses drift from rounding alone on the random-weight model, the floor for exp's.
#                PREF_FLOOR_ALL=1 adds a compiled loop (`baseline compile=true`) and exp with eager layers (about 4
#                minutes more)
#   preftests    python -m pytest -m gpu tests/test_gpu_objectives.py tests/test_reference_pass.py: liger's chunked
#                preference losses against exp's own on the GPU (bf16), a DPO run killed then resumed, fresh adapters
#                at exactly ln 2 through the compiled, kept, fused layers
#   loravariants exp.bench exp-only, Gemma-7B 2048 x 8 random tokens on the whole GPU, $LORA_STEPS (6) steps each:
#                plain LoRA, lora=dora, lora=rslora, lora=pissa, lora.init=olora, lora.plus_lr_ratio=16 (docs/lora.md;
#                $LORA_VARIANTS: others, comma-separated, e.g. "exp,exp lora.init=gaussian,exp lora.init=loftq,
#                exp +lora.rank_pattern.down_proj=64" for the inits and patterns the default list leaves out)
#   groupprof    benchmarks/group_profile.py: the 2b study's $GROUPPROF_JOBS (16) jobs as one group, 8 steps, each timed,
#                steps 4-6 under torch.profiler ($GROUPPROF_ARGS: more overrides, e.g. hardware.padding_free=false)
#
# Everything lands in $OUT (default benchmarks/results/gpu_check): log.txt (this console), results.tgz (bench and
# calibration JSON/Markdown, pytest and command logs, run summaries). Each stage has a time limit
# ($STAGE_TIMEOUT_<stage>, seconds), so one slow stage cannot take the rest of the call with it.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/benchmarks/results/gpu_check}
WORK=$(mktemp -d /tmp/gpu_check.XXXX)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
log() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }

# Wheels the GPU image lacks, carried in .whl/, installed beside the image's own packages.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { log "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$ROOT/src
else
  export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Random-weight checkpoints (17 GB for the 7B shape) are written once and read by every variant: RAM disk if it is
# large enough, else local disk.
shm_free=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 || echo 0)
if [ "${shm_free:-0}" -gt $((40 * 1024 * 1024)) ]; then export EXP_CACHE=${EXP_CACHE:-/dev/shm/exp-cache}; else export EXP_CACHE=${EXP_CACHE:-/tmp/exp-cache}; fi
ALPACA=${EXP_ALPACA:-}  # a real Alpaca file (alpaca_en_demo.json) for the real-data and study stages
[ -z "$ALPACA" ] && [ -f "$ROOT/.whl/alpaca_en_demo.json" ] && ALPACA=$ROOT/.whl/alpaca_en_demo.json

log "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)'); EXP_CACHE=$EXP_CACHE"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
python3 - <<'EOF'
import importlib.metadata as md, platform, torch
names = ["torch", "transformers", "peft", "bitsandbytes", "lightning", "liger-kernel", "triton", "hydra-core",
         "datasets", "wandb"]
def version(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "missing"
print("python", platform.python_version(), "cuda", torch.version.cuda, *(f"{n} {version(n)}" for n in names))
EOF

status=0
# GPU_CHECK_DEADLINE_S: seconds after this script's start by which every stage has ended (a stage's limit is cut to
# what is left, and a stage with less than a minute left is skipped), so a device call's own limit is never hit.
DEADLINE=${GPU_CHECK_DEADLINE_S:-}
stage() {  # stage NAME DEFAULT_TIMEOUT COMMAND...
  local name=$1 limit=$2; shift 2
  local var="STAGE_TIMEOUT_$name"
  limit=${!var:-$limit}
  if [ -n "$DEADLINE" ]; then
    local left=$((DEADLINE - SECONDS - 40))  # the stop's grace period and the results' packing
    if [ "$left" -lt 60 ]; then log "stage $name: skipped, $left s left before GPU_CHECK_DEADLINE_S"; status=1; return; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  log "stage $name: $* (limit ${limit}s)"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=20 "$limit" "$@"
  local rc=$?
  log "stage $name: exit $rc after $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
  wait_gpu_released
}
# A stage stopped at its limit leaves a process that is still saving or exiting (and holding GPU memory): the next
# stage's preflight would size itself to what that process leaves free. Wait (at most 60 s) until no process holds
# memory on the GPU.
wait_gpu_released() {
  local waited=0
  while [ $waited -lt 60 ] && [ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ]; do
    sleep 2; waited=$((waited + 2))
  done
  [ $waited -eq 0 ] || log "waited $waited s for the last stage's processes to release the GPU"
}
BENCH=(python3 -m exp.bench out_dir="$WORK/bench")
# The preference stages' learning rate: a preference one (TRL's DPOConfig default is 1e-6 for full weights, LoRA DPO
# recipes take 5e-6 to 5e-5). At the bench's SFT rate of 1e-4 the random-weight 7B's DPO loss swings between 0.3 and
# 7.7 within 30 steps (benchmarks/results/preference_h200_20261206), where two runs part from rounding alone.
PREF_LR=${PREF_LR:-5e-6}
PARTS=${LOOP_PARTS_DIR:-/tmp/gpu_check_loop_parts}  # the loop200 parts, kept across calls on one machine

run_stage() {
  if [[ $1 == real || $1 == study || $1 == groupstudy || $1 == group7b || $1 == groupprof || $1 == realpf || $1 == pfprofile || $1 == trainruns || $1 == valprof || $1 == loop200 || $1 == exp200 || $1 == dpo7b || $1 == orpo7b || $1 == dpo7bfloor || $1 == dpostart ]] && [ ! -f "$ALPACA" ]; then
    log "stage $1: needs EXP_ALPACA=<a real Alpaca file, e.g. alpaca_en_demo.json>"; status=1; return
  fi
  case $1 in
    tests)
      stage tests 420 bash -c "set -o pipefail; python3 -m pytest -m gpu -q -p no:cacheprovider -rA tests 2>&1 | tee $WORK/pytest_gpu.txt" ;;
    varlen)
      stage varlen 240 bash -c "set -o pipefail; python3 -m pytest -m gpu -q -p no:cacheprovider -rA tests/test_gpu_varlen.py 2>&1 | tee $WORK/pytest_gpu_varlen.txt" ;;
    kernels)
      stage kernels 240 bash -c "set -o pipefail; python3 -m pytest -m gpu -q -p no:cacheprovider -rA tests/test_gpu_varlen.py \
        tests/test_gpu.py -k \"${KERNELS_K:-not trains_on_one_gpu}\" 2>&1 | tee $WORK/pytest_gpu_kernels.txt" ;;
    synth7b)
      stage synth7b 240 "${BENCH[@]}" steps=12 variant=exp ;;
    readme)
      mkdir -p "$WORK/readme"
      stage readme 480 bash -c "
        set -x
        python3 -m exp.doctor model=gemma_7b hardware=gpu > $WORK/readme/doctor.txt 2>&1; echo doctor exit \$?
        python3 -m exp.train model=gemma_7b model.random_init=true hardware=gpu trainer.max_steps=20 > $WORK/readme/train_7b.txt 2>&1; echo train_7b exit \$?
        t0=\$SECONDS; python3 -m exp.train hardware=auto > $WORK/readme/train_auto.txt 2>&1; echo train_auto exit \$? after \$((SECONDS - t0)) s
        tail -12 $WORK/readme/*.txt
        for d in outputs/*/*/; do cp \$d/summary.json $WORK/readme/summary-\$(basename \$d).json 2>/dev/null; done" ;;
    bench2b)
      stage bench2b 420 "${BENCH[@]}" model=gemma_2b memory_budget=baseline variant=baseline variant=exp ;;
    calibration)
      stage calibration 420 python3 benchmarks/memory_calibration.py --models gemma_2b --grid 2048x2 2048x4 2048x8 \
        --ckpt none --losses liger chunked --compile both --out "$WORK/memory_calibration_fast_path" ;;
    bench7b)
      # Lean: a quarter of the baseline's peak at this shape (59.6 GiB measured on the H200).
      stage bench7b 600 "${BENCH[@]}" memory_budget=baseline variant=baseline variant=exp ;;
    whole)
      ref=$(ls -t "$WORK"/bench/bench-gemma_7b-2048x8-*.json 2>/dev/null | head -1)
      stage whole 300 "${BENCH[@]}" ${ref:+reference="$ref"} variant="exp hardware.memory_budget_gib=null" ;;
    real)
      stage real 540 "${BENCH[@]}" data="$ALPACA" seq=1024 micro_batch=16 steps=12 warmup=2 \
        variant=baseline variant=exp ;;
    lean)
      ref=$(ls -t "$WORK"/bench/bench-gemma_7b-2048x8-*.json 2>/dev/null | head -1)
      if [ -n "$ref" ]; then
        budget=$(python3 -c "import json,sys; r=[x for x in json.load(open(sys.argv[1]))['rows'] if x['is_reference']][0]; print(round(r['peak_memory_gib']/4, 2))" "$ref")
        stage lean 300 "${BENCH[@]}" reference="$ref" memory_budget="$budget" variant=exp
      else
        log "stage lean: no 7B headline result to take the baseline from (run bench7b first)"; status=1
      fi ;;
    capacity)
      stage capacity 420 "${BENCH[@]}" micro_batch=128 steps=3 warmup=1 \
        variant="exp hardware.auto_micro_batch=false hardware.offload_checkpoints=true" ;;
    fuse)
      if [ -n "${BENCH_REFERENCE:-}" ]; then base=(reference="$BENCH_REFERENCE"); else base=(variant=baseline); fi
      stage fuse 560 "${BENCH[@]}" memory_budget=baseline profile=true "${base[@]}" variant=exp \
        variant="exp hardware.fuse_lora=true" ;;
    wholefuse)
      ref=${BENCH_REFERENCE:-$(ls -t "$WORK"/bench/bench-gemma_7b-2048x8-*.json 2>/dev/null | head -1)}
      stage wholefuse 300 "${BENCH[@]}" ${ref:+reference="$ref"} profile=true \
        variant="exp hardware.memory_budget_gib=null hardware.fuse_lora=true" ;;
    auto)
      mkdir -p "$WORK/readme"
      stage auto 300 bash -c "t0=\$SECONDS; python3 -m exp.train hardware=auto > $WORK/readme/train_auto.txt 2>&1; \
        echo train_auto exit \$? after \$((SECONDS - t0)) s; tail -25 $WORK/readme/train_auto.txt
        for d in outputs/*/*/; do cp \$d/summary.json $WORK/readme/summary-\$(basename \$d).json 2>/dev/null; done" ;;
    profile7b)
      if [ -n "${BENCH_REFERENCE:-}" ]; then base=(reference="$BENCH_REFERENCE"); else base=(variant=baseline); fi
      stage profile7b 420 "${BENCH[@]}" memory_budget=baseline profile=true "${base[@]}" \
        variant="exp hardware.auto_dequantized_layers=false" variant=exp ;;
    bench512)
      stage bench512 420 "${BENCH[@]}" seq=512 micro_batch=32 steps=12 variant=baseline variant=exp ;;
    multi)
      mkdir -p "$WORK/multi"
      stage multi 580 bash -c "set -o pipefail; EXP_RESULTS_DIR=$WORK/multi python3 -m pytest -m gpu -q -p no:cacheprovider \
        -rA tests/test_gpu_multi.py tests/test_distributed.py 2>&1 | tee $WORK/pytest_gpu_multi.txt" ;;
    multi7b)
      mkdir -p "$WORK/multi"
      stage multi7b 580 python3 benchmarks/multi_gpu.py --out "$ROOT/outputs/multi_gpu" ${ALPACA:+--data "$ALPACA"}
      cp "$ROOT"/outputs/multi_gpu/*.json "$ROOT"/outputs/multi_gpu/*.md "$ROOT"/outputs/multi_gpu/*.log "$WORK/multi/" 2>/dev/null ;;
    study)
      # The study's directory survives between calls on a machine that stays warm: an invocation continues the
      # one-at-a-time arm where the last one stopped (benchmarks/study_check.sh). Its deadline leaves the stage
      # limit's last 30 s for the stop and the comparison.
      limit=${STAGE_TIMEOUT_study:-560}
      [ -n "$DEADLINE" ] && [ $((DEADLINE - SECONDS - 40)) -lt "$limit" ] && limit=$((DEADLINE - SECONDS - 40))
      STAGE_TIMEOUT_study=$limit stage study 560 env STUDY_DEADLINE_S=$((limit - 40)) \
        bash benchmarks/study_check.sh "$ROOT/outputs/gpu_study" "$ALPACA"
      # Everything but the weights (checkpoints, adapters, tokenizer files), for exp.report on another machine.
      tar -czf "$OUT/study.tgz" -C "$ROOT" --exclude='*.ckpt' --exclude='*.safetensors' --exclude='tokenizer*' \
        --exclude='*.partial' outputs/gpu_study $(cd "$ROOT" && ls -d multirun/study_warmup_* 2>/dev/null) ;;
    grouptests)
      stage grouptests 400 python3 -m pytest -m gpu -q -p no:cacheprovider -s tests/test_gpu_group.py ;;
    groupstudy|group7b)
      shape=2b; [ "$1" = group7b ] && shape=7b
      arms=${GROUP_ARMS:-grouped}; [ "$1" = group7b ] && arms=${GROUP_ARMS:-grouped packed}
      ref=""; [ "$shape" = 2b ] && ref=${GROUP_REFERENCE:-$ROOT/benchmarks/results/study_h200_20261202b/packed}
      stage "$1" 560 env GROUP_REFERENCE="$ref" bash benchmarks/group_check.sh "$ROOT/outputs/gpu_group_$shape" "$ALPACA" \
        "$shape" $arms
      tar -czf "$OUT/group_$shape.tgz" -C "$ROOT" --exclude='*.ckpt' --exclude='*.safetensors' --exclude='tokenizer*' \
        --exclude='*.partial' "outputs/gpu_group_$shape" ;;
    groupprof)
      rm -rf "$WORK/groupprof"
      stage groupprof 300 python3 benchmarks/group_profile.py "$WORK/groupprof" --jobs "${GROUPPROF_JOBS:-16}" \
        "data.path=$ALPACA" ${GROUPPROF_ARGS:-}
      rm -rf "$WORK"/groupprof/job*/adapter "$WORK"/groupprof/job*/checkpoints; gzip -f "$WORK/groupprof/trace.json" ;;
    realpf)
      # Real data, padding-free (hardware=gpu's default): baseline and exp on the same steps, and the synthetic
      # 2048 x 8 figure of the same build for the ratio.
      stage realpf 560 "${BENCH[@]}" data="$ALPACA" seq=2048 micro_batch=8 steps=${REAL_STEPS:-40} warmup=3 \
        variant=baseline variant=exp
      stage synth7b 200 "${BENCH[@]}" steps=12 variant=exp ;;
    trainruns)
      # README-style runs on the real file: $TRAIN_MODELS (model:steps) from this machine's first compile, then the
      # first model again on the warm caches (the compile cache's reuse); each run's summary.json kept.
      mkdir -p "$WORK/train"
      first=""
      for spec in ${TRAIN_MODELS:-gemma3_1b:20 again gemma2_2b:20 gemma_7b:200 gemma_2b:20 gemma3_4b:20}; do
        if [ "$spec" = again ]; then spec=$first; tag=again; else tag=first; fi
        [ -z "$first" ] && first=$spec
        m=${spec%%:*} rest=${spec#*:} extra=""
        n=${rest%%:*}
        if [[ $rest == *:* ]]; then extra=${rest#*:}; extra=${extra//,/ }; tag=${tag}_$(echo "$extra" | sed 's/[^ ]*=//g; s/ /_/g'); fi
        stage "train_${m}_${tag}" 420 bash -c "t0=\$SECONDS; python3 -m exp.train model=$m model.random_init=true hardware=gpu \
          data=alpaca data.path=$ALPACA data.max_seq_len=${TRAIN_SEQ:-2048} trainer=default trainer.max_steps=$n \
          trainer.val_every_n_steps=$n trainer.warmup_steps=0 logger=csv $extra hydra.run.dir=$WORK/train/${m}_${tag} \
          > $WORK/train/${m}_${tag}.txt 2>&1; echo exit \$? after \$((SECONDS - t0)) s; tail -9 $WORK/train/${m}_${tag}.txt"
        rm -rf "$WORK/train/${m}_${tag}/adapter" "$WORK/train/${m}_${tag}"/checkpoints
      done ;;
    pfprofile)
      # exp's real-data default (varlen attention) with its first timed steps profiled: device time by kind and the
      # device's idle share of the step.
      stage "pfprofile_${PF_MODEL:-gemma_7b}" 300 "${BENCH[@]}" model=${PF_MODEL:-gemma_7b} data="$ALPACA" seq=2048 \
        micro_batch=8 steps=8 warmup=3 profile=true variant=exp ;;
    loop200)
      # Each part's result is also kept in $PARTS (outside this call's work directory): a later call on the same
      # (warm) machine joins them to exp's run (exp200).
      stage loop200 580 "${BENCH[@]}" data="$ALPACA" seq=2048 micro_batch=8 steps=${LOOP_STEPS:-100} warmup=3 \
        first_step=${FIRST_STEP:-0} variant=baseline
      mkdir -p "$PARTS"
      part=$(ls -t "$WORK"/bench/bench-*.json 2>/dev/null | head -1)
      if [ -n "$part" ] && python3 -c "import json, sys; rows = json.load(open(sys.argv[1]))['rows']
sys.exit(not rows or any(r['status'] != 'ok' for r in rows))" "$part"; then
        cp "$part" "$PARTS/$(basename "$ALPACA" .json)-from-${FIRST_STEP:-0}.json"
      fi ;;
    exp200)
      # With the loop's parts of this file in $PARTS (earlier loop200 calls), they join into the baseline row; parts
      # that do not make the same 200 steps are refused before anything runs (exit 2), and exp then runs alone.
      export PARTS_REF
      PARTS_REF=$(ls "$PARTS/$(basename "$ALPACA" .json)"-from-*.json 2>/dev/null | paste -sd, -)
      exp200=("${BENCH[@]}" data="$ALPACA" seq=2048 micro_batch=8 steps=200 warmup=3 variant=exp)
      stage exp200 420 bash -c '"$@" ${PARTS_REF:+reference="$PARTS_REF"} || { rc=$?; [ $rc -eq 2 ] && [ -n "$PARTS_REF" ] && "$@"; }' \
        _ "${exp200[@]}" ;;
    dpo7b|orpo7b)
      objective=${1%7b}; steps=30; [ "$objective" = orpo ] && steps=${ORPO_STEPS:-30}
      stage "$1" 580 "${BENCH[@]}" objective="$objective" data="$ALPACA" seq=1024 micro_batch=${PREF_MICRO_BATCH:-8} \
        lr=$PREF_LR steps=$steps warmup=3 memory_budget=baseline variant=baseline variant=exp \
        ${PREF_FUSED:+"variant=exp hardware.fuse_lora=true"} ${PREF_REFERENCE:+reference=$PREF_REFERENCE} ;;
    dpostart)
      # The stage fails unless every variant's first loss is ln 2 to float32's last bit (1e-8; one step is 6e-8).
      stage dpostart 420 bash -c '"${@:2}" && python3 -c "
import glob, json, math, os, sys
rows = json.load(open(max(glob.glob(sys.argv[1] + \"/bench-*-dpo-*.json\"), key=os.path.getmtime)))[\"rows\"]
first = {r[\"variant\"]: (r.get(\"losses\") or [None])[0] for r in rows}
print(\"dpostart: first losses\", first)
sys.exit(any(v is None or abs(v - math.log(2)) > 1e-8 for v in first.values()))
" "$1"' _ "$WORK/bench" "${BENCH[@]}" model=${DPOSTART_MODEL:-gemma_2b} objective=dpo data="$ALPACA" seq=1024 \
        micro_batch=8 lr=$PREF_LR steps=2 warmup=1 variant=exp ${DPOSTART_EAGER-"variant=exp hardware.compile=false"} ;;
    dpo7bfloor)
      stage dpo7bfloor 580 "${BENCH[@]}" objective=dpo data="$ALPACA" seq=1024 micro_batch=${PREF_MICRO_BATCH:-8} \
        lr=$PREF_LR steps=${PREF_FLOOR_STEPS:-12} warmup=3 memory_budget=baseline variant=baseline \
        "variant=baseline prepare=false" \
        variant=exp ${PREF_FLOOR_ALL:+"variant=baseline compile=true" "variant=exp hardware.compile=false"} ;;
    preftests)
      stage preftests 560 bash -c "set -o pipefail; python3 -m pytest -m gpu -q -p no:cacheprovider -rA \
        tests/test_gpu_objectives.py tests/test_reference_pass.py tests/test_flat_pairs.py 2>&1 | tee $WORK/pytest_gpu_objectives.txt" ;;
    pytest)
      stage pytest 420 bash -c "set -o pipefail; python3 -m pytest -m gpu -v -p no:cacheprovider -rA ${PYTEST_ARGS:-tests} \
        2>&1 | tee $WORK/pytest_gpu_selected.txt" ;;
    liger)
      stage liger 180 bash -c "set -o pipefail; python3 -m pytest -m gpu -q -p no:cacheprovider -rA tests/test_gpu.py \
        -k liger 2>&1 | tee $WORK/pytest_gpu_liger.txt" ;;
    valprof)
      stage valprof 240 python3 benchmarks/val_profile.py model=${VALPROF_MODEL:-gemma3_1b} model.random_init=true \
        hardware=gpu data=alpaca data.path="$ALPACA" data.max_seq_len=2048 trainer=default trainer.max_steps=10 \
        trainer.val_every_n_steps=10 trainer.warmup_steps=0 logger=csv ;;
    loravariants)
      # Six fresh processes of the 7B shape in one stage: few steps each (2 untimed); the rows compare with `exp`.
      variants=(exp "exp lora=dora" "exp lora=rslora" "exp lora=pissa" "exp lora.init=olora" "exp lora.plus_lr_ratio=16")
      [ -n "${LORA_VARIANTS:-}" ] && IFS=, read -ra variants <<<"$LORA_VARIANTS"
      stage loravariants 560 "${BENCH[@]}" steps=${LORA_STEPS:-6} warmup=2 "${variants[@]/#/variant=}" ;;
    synthfam)
      for m in ${SYNTH_MODELS:-gemma_2b gemma2_2b gemma3_1b gemma3_4b}; do
        stage "synth_$m" 200 "${BENCH[@]}" model=$m seq=${TRAIN_SEQ:-2048} micro_batch=8 steps=12 variant=exp
      done ;;
    *) log "unknown stage $1"; status=1 ;;
  esac
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests readme bench2b calibration bench7b whole real lean capacity bench512 profile7b)
# Packed again after every stage: a call stopped at the device's own limit still returns what the stages before
# the stopped one measured.
pack() {
  cp -r "$WORK"/bench/*.md "$OUT"/ 2>/dev/null
  tar -czf "$OUT/results.tgz.part" -C "$WORK" . 2>/dev/null && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
}
for s in "${stages[@]}"; do run_stage "$s"; pack; done
log "done: status $status; $OUT/log.txt, $OUT/results.tgz"
exit $status
