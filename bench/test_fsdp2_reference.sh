#!/usr/bin/env bash
# End-to-end check of bench/fsdp2_reference.py: PyTorch FSDP2 (full_shard, 2 Gloo ranks on
# CPU, 2 micro-batches per step) must give the same per-step losses and gradient norms as one
# process without FSDP on the global batch, within fp32 tolerance. Generates its own small
# spec, init.safetensors and batches.bin; exits non-zero on a mismatch.
#
#   bench/test_fsdp2_reference.sh [FSDP_BINARY]
#
# Environment: FSDP_PYTHON (default: the project's venv python), FSDP_BIN (default:
# build/bin/fsdp; without it, torch.distributed.run launches the ranks), FSDP2_TEST_RTOL.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
script="$root/bench/fsdp2_reference.py"
cache="${FSDP_CACHE_DIR:-$HOME/.cache/fsdp.cpp}"
python="${FSDP_PYTHON:-$cache/venv-torch-2.11.0/bin/python}"
fsdp_bin="${1:-${FSDP_BIN:-$root/build/bin/fsdp}}"
rtol="${FSDP2_TEST_RTOL:-1e-5}"
nproc=2

if [[ ! -x "$python" ]]; then
  echo "test_fsdp2_reference: python '$python' not found (set FSDP_PYTHON)" >&2
  exit 1
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/fsdp2_reference_test.XXXXXX")"
trap 'rm -rf "$work"' EXIT

"$python" "$script" --make-test-inputs "$work/inputs" --preset gpt --world "$nproc" \
  --strategy full_shard --steps 4 --ga 2 --mb 2 --seq 32 --dim 64 --layers 2 --heads 4 >/dev/null

if [[ -x "$fsdp_bin" ]]; then
  launch=("$fsdp_bin" launch --nproc-per-node "$nproc" -- "$python")
else
  echo "test_fsdp2_reference: '$fsdp_bin' not found; launching with torch.distributed.run"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  launch=("$python" -m torch.distributed.run --standalone --nproc-per-node "$nproc")
fi
"${launch[@]}" "$script" --spec "$work/inputs/spec.json" --out "$work/fsdp2"
"$python" "$script" --reference --spec "$work/inputs/spec.json" --out "$work/reference" >/dev/null

# The output schema: every metrics field, one rank_stats file per rank, collectives counted.
"$python" - "$work/fsdp2" "$nproc" <<'EOF'
import json, os, sys
out, nproc = sys.argv[1], int(sys.argv[2])
rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
keys = {"step", "loss", "grad_norm", "lr", "step_time_s", "comm_wait_s", "comm_bytes", "tokens_per_s"}
assert len(rows) == 4, f"{len(rows)} metrics rows, expected 4"
for i, r in enumerate(rows):
    assert set(r) == keys, f"metrics keys {sorted(r)}"
    assert r["step"] == i + 1 and r["comm_bytes"] > 0 and r["comm_wait_s"] >= 0, r
for rank in range(nproc):
    s = json.load(open(os.path.join(out, "rank_stats", f"rank{rank}.json")))
    assert s["rank"] == rank and s["steps"] == 4 and s["peak_rss_bytes"] > 0, s
    assert s["comm_bytes_total"] == sum(r["comm_bytes"] for r in rows), s
print("test_fsdp2_reference: output schema ok")
EOF

"$python" "$script" --compare "$work/fsdp2/metrics.jsonl" "$work/reference/metrics.jsonl" --rtol "$rtol"

# parallelism.reshard_between_micro_batches: false (fsdp.cpp's keep mode, mirrored with FSDP2's
# set_reshard_after_forward / set_reshard_after_backward): the same losses, fewer bytes
# gathered (one all-gather per unit and step instead of one per forward and backward).
"$python" - "$work/inputs/spec.json" "$work/inputs/spec_keep.json" <<'EOF'
import json, sys
spec = json.load(open(sys.argv[1]))
spec["parallelism"]["reshard_between_micro_batches"] = False
json.dump(spec, open(sys.argv[2], "w"))
EOF
"${launch[@]}" "$script" --spec "$work/inputs/spec_keep.json" --out "$work/fsdp2_keep" >/dev/null
"$python" "$script" --compare "$work/fsdp2_keep/metrics.jsonl" "$work/reference/metrics.jsonl" --rtol "$rtol"
"$python" - "$work/fsdp2/metrics.jsonl" "$work/fsdp2_keep/metrics.jsonl" <<'EOF'
import json, sys
each, keep = ([json.loads(l)["comm_bytes"] for l in open(f)] for f in sys.argv[1:])
assert all(k < e for k, e in zip(keep, each)), f"comm bytes per step: keep {keep}, each micro-batch {each}"
print(f"test_fsdp2_reference: keeping the parameters gathers {keep[-1]} bytes per step, not {each[-1]}")
EOF
# parallelism.offload: params: FSDP2's CPUOffloadPolicy, the same losses; optimizer: refused,
# naming what FSDP2 has instead.
"$python" - "$work/inputs/spec.json" "$work/inputs" <<'EOF'
import json, sys
spec = json.load(open(sys.argv[1]))
for mode in ("params", "optimizer"):
    spec["parallelism"]["offload"] = mode
    json.dump(spec, open(f"{sys.argv[2]}/spec_offload_{mode}.json", "w"))
EOF
"${launch[@]}" "$script" --spec "$work/inputs/spec_offload_params.json" --out "$work/fsdp2_offload" \
  > "$work/offload.log"
grep -q "CPUOffloadPolicy" "$work/offload.log" || { cat "$work/offload.log"; exit 1; }
"$python" "$script" --compare "$work/fsdp2_offload/metrics.jsonl" "$work/reference/metrics.jsonl" --rtol "$rtol"
if "${launch[@]}" "$script" --spec "$work/inputs/spec_offload_optimizer.json" \
     --out "$work/fsdp2_offload_opt" > "$work/offload_opt.log" 2>&1; then
  echo "test_fsdp2_reference: offload optimizer was not refused" >&2
  exit 1
fi
grep -q "no FSDP2 equivalent" "$work/offload_opt.log" || { cat "$work/offload_opt.log"; exit 1; }
echo "test_fsdp2_reference: PASS"
