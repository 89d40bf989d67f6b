#!/usr/bin/env bash
# The next GPU run as one script: the checks no CPU can make, in order of value, each writing its log and its
# figures to $OUT as soon as it ends (so a run cut short by a timeout keeps what finished), each with its pass
# condition printed beside the verdict (bench/gpu_run_verdict.py reads them).
#
#   bash bench/gpu_run.sh --dry-run                      # the steps, their commands and pass conditions; no GPU
#   bash bench/gpu_run.sh [--site DIR] [--wheels DIR] [--budget SECONDS] [--only STEP]
#
#   --site DIR     a site directory to put first on PYTHONPATH (an offline vLLM unpacked there, docs/gpus.md)
#   --wheels DIR   wheels to install into --site first (pip --no-index --no-deps --target): peft, fla, einops, and
#                  transformers 5.19 where the machine has 5.17 (Qwen3.5's tower needs 5.19)
#   --budget S     seconds for all the steps (default 480); a step gets what is left, at most its own limit, and
#                  is skipped when less than 30 s is left
#   --only STEP    this step alone
#   env: OUT (logs and figures; default outputs/gpu_run), WORK (models, data, runs; default a fresh temporary
#        folder), PYTHON (default python3)
#
# Steps (a)-(d), then the GPU checks as time allows:
#   replay             routing replay with vLLM's own capture on a tiny Qwen3-VL-MoE, CUDA graphs on, full fine-tuning
#   qwen3_5            a tiny Qwen3.5 through vLLM (Triton GDN prefill) and the trainer's fla path, tuning timed apart
#   distill            a distillation teacher in bf16 with FSDP2 CPU offload on and off: the same first-step reverse KL
#   linear_attention   bench/bench_linear_attention.py --width 1
#   gpu_check_qwen3_5  bench/gpu_check.py --family qwen3_5 --lora
#   gpu_check_moe      bench/gpu_check.py --lora of the reduced MoE shapes (--layers)
# Mixture-of-experts steps need vLLM's MoE kernels (vllm/_moe_C*.so) in the vLLM that runs.
set -u
cd "$(dirname "$0")/.."

DRY=0 SITE="" WHEELS="" BUDGET=480 ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --site) SITE="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    --budget) BUDGET="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    *) echo "gpu_run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
PY="${PYTHON:-python3}"
OUT="${OUT:-outputs/gpu_run}"
WORK="${WORK:-}"
TRAIN="$PY -m torch.distributed.run --standalone --nproc_per_node=1 train_grpo.py configs/tiny.yaml"
COMMON="rollout.engine=vllm rollout.enforce_eager=false trainer.n_gpus_per_node=1 trainer.val_freq=0 \
trainer.val_before_train=false trainer.export_hf=false trainer.resume=none data.val_files="

# name | its own limit in seconds | the commands (run in one bash, $W the work folder, $DATA the train parquet)
STEPS=(replay qwen3_5 distill linear_attention gpu_check_qwen3_5 gpu_check_moe)
declare -A LIMIT=([replay]=150 [qwen3_5]=150 [distill]=150 [linear_attention]=100 [gpu_check_qwen3_5]=300
                  [gpu_check_moe]=400)
declare -A CMD=(
  [replay]="$PY scripts/make_tiny_model.py \$W/tiny_moe --family qwen3_vl_moe && $TRAIN $COMMON \
actor.model_path=\$W/tiny_moe data.train_files=\$DATA trainer.output_dir=\$W/replay trainer.max_steps=3 \
algorithm.routing_replay=r3"
  [qwen3_5]="$PY scripts/make_tiny_model.py \$W/tiny_qwen3_5 --family qwen3_5 && $TRAIN $COMMON \
actor.model_path=\$W/tiny_qwen3_5 data.train_files=\$DATA trainer.output_dir=\$W/qwen3_5 trainer.max_steps=2"
  [distill]="$PY scripts/make_tiny_model.py \$W/tiny && $PY scripts/make_tiny_model.py \$W/teacher --digit-logit 5 \
&& ${TRAIN/tiny.yaml/tiny_distill.yaml} $COMMON actor.model_path=\$W/tiny distill.model_path=\$W/teacher \
distill.offload=true data.train_files=\$DATA trainer.output_dir=\$W/distill_offload_on trainer.max_steps=1; \
${TRAIN/tiny.yaml/tiny_distill.yaml} $COMMON actor.model_path=\$W/tiny distill.model_path=\$W/teacher \
distill.offload=false data.train_files=\$DATA trainer.output_dir=\$W/distill_offload_off trainer.max_steps=1"
  [linear_attention]="$PY bench/bench_linear_attention.py --width 1 --repeats 2"
  [gpu_check_qwen3_5]="$PY bench/gpu_check.py --family qwen3_5 --lora --model-dir \$W/qwen3_5_9b --steps 2 \
--no-comparisons"
  [gpu_check_moe]="$PY bench/gpu_check.py --family qwen3_vl_moe --lora --layers 12 --model-dir \$W/vl_moe --steps 2 \
--no-comparisons && rm -rf \$W/vl_moe && $PY bench/gpu_check.py --family qwen3_5_moe --lora --layers 8 \
--model-dir \$W/q35_moe --steps 2 --no-comparisons"
)

if [ "$DRY" = 1 ]; then
  echo "gpu_run: ${#STEPS[@]} steps, in this order, within a budget of $BUDGET s (each at most its own limit)"
  i=0
  for s in "${STEPS[@]}"; do
    i=$((i + 1))
    echo "$i. $s (at most ${LIMIT[$s]} s): ${CMD[$s]}"
    echo "   pass: $($PY bench/gpu_run_verdict.py --describe "$s")"
  done
  exit 0
fi

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_run.sh needs a CUDA GPU (--dry-run does not)" >&2; exit 2; }
mkdir -p "$OUT"
W="${WORK:-$(mktemp -d)}"
export W OUT HF_HUB_OFFLINE=1
if [ -n "$SITE" ]; then
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if [ -n "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl > "$OUT/setup.log" 2>&1 \
      || { echo "gpu_run: installing $WHEELS into $SITE failed (setup.log)"; exit 2; }
  fi
fi
# the start of the log: what ran where (a log alone says which versions gave the figures)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import importlib.metadata as m
for p in ('torch', 'transformers', 'vllm', 'triton', 'flash-linear-attention', 'peft'):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, 'not installed')"
  git rev-parse --short HEAD 2>/dev/null; } > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
export DATA="$W/data/train.parquet"
"$PY" scripts/make_synthetic_data.py "$DATA" --rows 96 --seed 0 > /dev/null

start=$(date +%s) i=0 failed=0
for s in "${STEPS[@]}"; do
  i=$((i + 1))
  [ -n "$ONLY" ] && [ "$s" != "$ONLY" ] && continue
  left=$((BUDGET - ($(date +%s) - start)))
  limit=$(( left < LIMIT[$s] ? left : LIMIT[$s] ))
  if [ "$limit" -lt 30 ]; then
    echo "[gpu_run] $s: not run ($left s of the budget left)" | tee -a "$OUT/summary.txt"
    continue
  fi
  echo "[gpu_run] $i. $s (at most $limit s); pass: $($PY bench/gpu_run_verdict.py --describe "$s")"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "${CMD[$s]}" > "$OUT/${i}_$s.log" 2>&1
  code=$?
  verdict=$("$PY" bench/gpu_run_verdict.py "$s" "$W" "$OUT/${i}_$s.log" "$OUT/${i}_$s.json")
  [ $code = 124 ] && verdict="$verdict (timed out after $limit s)"
  [ $code != 0 ] && [ $code != 124 ] && verdict="$verdict (exit code $code; the log's end: $(tail -c 300 \
"$OUT/${i}_$s.log" | tr '\n' ' '))"
  echo "$verdict ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
  case "$verdict" in *": PASS"*) ;; *) failed=$((failed + 1)) ;; esac
done
echo "[gpu_run] done in $(( $(date +%s) - start )) s: $failed step(s) not passed; logs and figures in $OUT"
[ "$failed" = 0 ]
