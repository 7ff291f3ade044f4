#!/usr/bin/env bash
# Two fsdp binaries on the same runs and plans: whether a change kept behaviour bit for bit.
#
#   scripts/compare_binaries.sh OLD_FSDP NEW_FSDP [WORK_DIR]
#
# Trains a set of short CPU runs that cover the engine's paths (FULL_SHARD, offload params and
# optimizer, the delayed update, activation checkpointing, HSDP with kept parameters, grad_sync
# last, DDP) with each binary and compares every metrics.jsonl loss, grad_norm and val_loss as
# text (the JSON writer prints the shortest round-trip form, so equal text is equal bits);
# then `fsdp plan --json` for every shipped config (8 and 1 ranks on h100, 8 on the cpu
# profile), compared whole but for the config's path. Prints one line per case and exits 1 on any difference.
# For a change that renames keys: OLD_SETS_SED, a sed expression applied to the --set items
# given to OLD_FSDP only (e.g. 's/offload_delayed_update=on/offload_delayed_update=true/'), and
# OLD_CONFIGS, the configs/ folder OLD_FSDP reads (default: this checkout's).
set -uo pipefail
old=${1:?usage: compare_binaries.sh OLD_FSDP NEW_FSDP [WORK_DIR]}
new=${2:?usage: compare_binaries.sh OLD_FSDP NEW_FSDP [WORK_DIR]}
work=${3:-$(mktemp -d /tmp/fsdp-compare.XXXXXX)}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$work/old" "$work/new"

common="training.steps=6 training.log_interval=1 training.eval_interval=3 model.n_layers=3
training.micro_batch_size=2"
cases=(
  "full_shard|parallelism.nproc=2"
  "offload_params_bf16|parallelism.nproc=2 parallelism.offload=params training.mixed_precision=bf16 training.grad_accum_steps=2"
  "offload_params_1rank|parallelism.nproc=1 parallelism.offload=params training.mixed_precision=bf16"
  "offload_optimizer|parallelism.nproc=2 parallelism.offload=optimizer training.grad_accum_steps=2"
  "delayed_params|parallelism.nproc=1 parallelism.offload=params training.mixed_precision=bf16 parallelism.offload_delayed_update=on training.grad_accum_steps=2 training.grad_sync=last parallelism.reshard_between_micro_batches=false"
  "delayed_optimizer_after2|parallelism.nproc=2 parallelism.offload=optimizer parallelism.offload_delayed_update=after:2"
  "ac_selective|parallelism.nproc=2 training.activation_checkpointing=selective model.arch=llama model.norm=rmsnorm model.activation=swiglu model.positions=rope"
  "ac_every2_clip0|parallelism.nproc=2 training.activation_checkpointing=every:2 training.max_grad_norm=0"
  "hsdp_kept|parallelism.nproc=4 parallelism.strategy=hybrid_shard parallelism.data_parallel_replicate_degree=2 parallelism.reshard_between_micro_batches=false training.grad_accum_steps=2"
  "grad_sync_last|parallelism.nproc=2 training.grad_accum_steps=3 training.grad_sync=last"
  "ddp|parallelism.nproc=2 parallelism.strategy=no_shard parallelism.data_parallel_replicate_degree=-1 parallelism.data_parallel_shard_degree=1"
  "skip_nonfinite|parallelism.nproc=2 parallelism.offload=params training.on_nonfinite=skip optimizer.lr=1e12"
)

differs=0
run_case() {  # binary tag name sets...
  local bin=$1 tag=$2 name=$3; shift 3
  local dir="$work/$tag/$name" args=()
  rm -rf "$dir"
  for s in $common "$@"; do
    [ "$tag" = old ] && [ -n "${OLD_SETS_SED:-}" ] && s=$(sed "$OLD_SETS_SED" <<<"$s")
    for item in $s; do args+=(--set "$item"); done  # a sed may make one item two
  done
  local configs="$root/configs"
  [ "$tag" = old ] && configs=${OLD_CONFIGS:-$configs}
  "$bin" train "$configs/default.yaml" --quiet --oversubscribe --set run.dir="$dir" \
    --set metrics.progress_bar=off "${args[@]}" >"$dir.log" 2>&1 || echo "exit $?" >>"$dir.log"
  grep -o '"\(step\|loss\|grad_norm\|val_loss\|skipped\)":[^,}]*' "$dir/metrics.jsonl" \
    2>/dev/null >"$dir.values"
}
for c in "${cases[@]}"; do
  name=${c%%|*}
  read -r -a sets <<<"${c#*|}"
  run_case "$old" old "$name" "${sets[@]}"
  run_case "$new" new "$name" "${sets[@]}"
  if [ ! -s "$work/new/$name.values" ]; then
    echo "FAIL  train $name: no values ($work/new/$name.log)"; differs=1
  elif cmp -s "$work/old/$name.values" "$work/new/$name.values"; then
    echo "same  train $name ($(grep -c '"loss"' "$work/new/$name.values") losses)"
  else
    echo "DIFF  train $name: diff $work/old/$name.values $work/new/$name.values"; differs=1
  fi
done

# The plans, compared without the config's path.
same_json() {
  python3 - "$1" "$2" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
for j in (a, b):
    j.pop("config", None)
sys.exit(0 if a == b else 1)
PY
}
for cfg in "$root"/configs/*.yaml; do
  for point in "8 h100" "1 h100" "8 cpu"; do
    read -r world gpu <<<"$point"
    name="plan_$(basename "$cfg" .yaml)_${world}_$gpu"
    for tag in old new; do
      bin=$new config=$cfg
      [ "$tag" = old ] && bin=$old && config=${OLD_CONFIGS:-$root/configs}/$(basename "$cfg")
      "$bin" plan "$config" --world-size "$world" --gpu "$gpu" --json "$work/$tag/$name.json" \
        >"$work/$tag/$name.log" 2>&1 || echo "exit $?" >>"$work/$tag/$name.log"
    done
    if [ -s "$work/new/$name.json" ] && same_json "$work/old/$name.json" "$work/new/$name.json"; then
      echo "same  $name"
    else
      echo "DIFF  $name: diff $work/old/$name.json $work/new/$name.json"; differs=1
    fi
  done
done
echo "work folder: $work"
exit $differs
