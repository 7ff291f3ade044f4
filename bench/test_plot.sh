#!/usr/bin/env bash
# Smoke test for bench/plot.py: writes small synthetic inputs (a compare run of two engines with
# three repeats each, and a sweep of two models x three strategies x world sizes 1,2,4,8) into a
# temporary directory, runs `plot.py compare` and `plot.py sweep` on them, and checks that every
# PNG exists and starts with the PNG signature. Also checks that a missing file and a missing
# column fail with a message that names them. Exits non-zero on any failure.
#
#   bench/test_plot.sh            # temp dir, removed afterwards
#   bench/test_plot.sh OUT_DIR    # keep inputs and PNGs in OUT_DIR (to look at the charts)
#
# Python: $PYTHON, else the bootstrap venv (scripts/bootstrap.sh installs matplotlib there).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -z "${PYTHON:-}" ]; then
  PYTHON="${FSDP_CACHE_DIR:-$HOME/.cache/fsdp.cpp}/venv-torch-${FSDP_TORCH_VERSION:-2.11.0}/bin/python"
  [ -x "$PYTHON" ] || PYTHON=python3
fi
"$PYTHON" -c 'import matplotlib, numpy' 2>/dev/null ||
  { echo "test_plot: $PYTHON lacks matplotlib/numpy (run scripts/bootstrap.sh)" >&2; exit 1; }

if [ $# -ge 1 ]; then
  WORK="$1"; mkdir -p "$WORK"
else
  WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
fi

"$PYTHON" - "$WORK" <<'EOF'
import csv, json, math, os, random, sys
root = sys.argv[1]
rng = random.Random(0)

# --- compare: two engines, 3 repeats, 60 steps, eval and checkpoint records interleaved ------
cdir = os.path.join(root, "compare")
steps, warm = 60, 5
engines = {"fsdp.cpp": dict(base=0.058, rss=412 * 2**20, comm=0.006, dir="fsdp_cpp"),
           "fsdp2": dict(base=0.066, rss=655 * 2**20, comm=0.009, dir="fsdp2")}
base_loss = [5.55 * math.exp(-s / 18) + 1.6 + 0.05 * rng.gauss(0, 1) for s in range(1, steps + 1)]
runs, summary = [], {}
for name, e in engines.items():
    for rep in range(3):
        sub = f"{e['dir']}_{rep}"
        os.makedirs(os.path.join(cdir, sub), exist_ok=True)
        with open(os.path.join(cdir, sub, "metrics.jsonl"), "w") as f:
            for s in range(1, steps + 1):
                loss = base_loss[s - 1]
                if name == "fsdp2" and s > 3:  # identical for 3 steps, then float reordering noise
                    loss += rng.gauss(0, 2e-6) * s / 10
                t = e["base"] * (1 + 0.04 * rng.gauss(0, 1)) * (3.0 if s == 1 else 1.3 if s <= warm else 1.0)
                f.write(json.dumps({"step": s, "loss": loss, "grad_norm": 1.0, "lr": 3e-3,
                                    "step_time_s": t, "tokens_per_s": 1024 / t,
                                    "comm_wait_s": e["comm"]}) + "\n")
                if s % 20 == 0:
                    f.write(json.dumps({"step": s, "val_loss": loss + 0.02}) + "\n")
                if s == 30:
                    f.write(json.dumps({"step": s, "checkpoint": "ckpt/step_30"}) + "\n")
        runs.append({"engine": name, "repeat": rep, "metrics": f"{sub}/metrics.jsonl"})
    summary[name] = {"metrics": f"{e['dir']}_0/metrics.jsonl", "median_step_s": e["base"],
                     "tokens_per_s": 1024 / e["base"], "peak_rss_bytes": e["rss"],
                     "comm_wait_s": e["comm"]}
a, b = summary["fsdp.cpp"], summary["fsdp2"]
with open(os.path.join(cdir, "compare.json"), "w") as f:
    json.dump({"config": "configs/default.yaml", "world_size": 4, "machine": "synthetic (test_plot.sh)",
               "date": "2025-01-01", "engines": summary, "warmup_steps": warm,
               "ratios": {"step_time": a["median_step_s"] / b["median_step_s"],
                          "memory": a["peak_rss_bytes"] / b["peak_rss_bytes"]},
               "max_loss_abs_diff": 1.1e-5, "runs": runs}, f, indent=1)

# --- sweep: 2 models x 3 strategies x world sizes 1,2,4,8 ----------------------------------------
sdir = os.path.join(root, "sweep")
os.makedirs(sdir, exist_ok=True)
cols = ["model", "params", "strategy", "world_size", "tokens_per_s", "tokens_per_s_per_rank",
        "step_time_s", "peak_tensor_bytes", "state_bytes", "peak_rss_bytes",
        "comm_wire_bytes_per_step", "theory_state_bytes", "theory_wire_bytes_per_step",
        "predicted_step_time_s", "predicted_peak_bytes"]
models = {"gpt_tiny": (834304, 9000.0, 22 * 2**20), "llama_7m": (7_090_176, 1150.0, 70 * 2**20)}
tokens_per_rank = 1024
bw = 400e6  # bytes/s, loopback gloo
with open(os.path.join(sdir, "sweep.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=cols)
    w.writeheader()
    for model, (P, tps1, act) in models.items():
        for strat in ("full_shard", "shard_grad_op", "no_shard"):
            for N in (1, 2, 4, 8):
                frac = (N - 1) / N
                state = {"full_shard": 16 * P / N, "shard_grad_op": 4 * P + 12 * P / N,
                         "no_shard": 16 * P}[strat]
                wire = {"full_shard": 3, "shard_grad_op": 2, "no_shard": 2}[strat] * frac * 4 * P
                temp = {"full_shard": 2 * 4 * P / 6, "shard_grad_op": 4 * P / N, "no_shard": 4 * P}[strat]
                compute = tokens_per_rank / tps1
                pred_t = compute * (1 + 0.03 * math.log2(N)) + wire / bw
                t = pred_t * (1 + abs(rng.gauss(0.06, 0.04)))
                peak = state + act + temp
                w.writerow({"model": model, "params": P, "strategy": strat, "world_size": N,
                            "tokens_per_s": round(tokens_per_rank * N / t, 1),
                            "tokens_per_s_per_rank": round(tokens_per_rank / t, 1),
                            "step_time_s": round(t, 5),
                            "peak_tensor_bytes": int(peak * (1 + 0.05 * rng.random())),
                            "state_bytes": int(state * 1.002 + 4096),
                            "peak_rss_bytes": int(peak + 380 * 2**20),
                            "comm_wire_bytes_per_step": int(wire * 1.01 + (256 * N if N > 1 else 0)),
                            "theory_state_bytes": int(state),
                            "theory_wire_bytes_per_step": int(wire),
                            "predicted_step_time_s": round(pred_t, 5),
                            # an empty prediction must be tolerated
                            "predicted_peak_bytes": "" if (strat == "no_shard" and N == 8) else int(peak)})
EOF

fail=0
check_png() {
  if [ ! -s "$1" ]; then echo "test_plot: FAIL: $1 missing or empty" >&2; fail=1; return; fi
  if [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" != "89504e470d0a1a0a" ]; then
    echo "test_plot: FAIL: $1 is not a PNG" >&2; fail=1; return
  fi
  echo "test_plot: ok $1 ($(wc -c <"$1") bytes)"
}

"$PYTHON" "$HERE/plot.py" compare "$WORK/compare" || fail=1
check_png "$WORK/compare/compare.png"
"$PYTHON" "$HERE/plot.py" sweep "$WORK/sweep" || fail=1
for p in sweep_throughput sweep_memory sweep_comm; do check_png "$WORK/sweep/$p.png"; done

# Errors name the file and the key/column.
expect_error() {  # expect_error PATTERN ARGS...
  local pat="$1"; shift
  local out
  if out=$("$PYTHON" "$HERE/plot.py" "$@" 2>&1); then
    echo "test_plot: FAIL: plot.py $* succeeded, expected an error" >&2; fail=1
  elif ! grep -qF -- "$pat" <<<"$out"; then
    echo "test_plot: FAIL: plot.py $*: error does not mention '$pat': $out" >&2; fail=1
  else
    echo "test_plot: ok error: $out"
  fi
}
mkdir -p "$WORK/bad_missing" "$WORK/bad_col" "$WORK/bad_key"
expect_error "bad_missing/sweep.csv" sweep "$WORK/bad_missing"
expect_error "bad_missing/compare.json" compare "$WORK/bad_missing"
cut -d, -f1-5 "$WORK/sweep/sweep.csv" >"$WORK/bad_col/sweep.csv"
expect_error '"tokens_per_s_per_rank"' sweep "$WORK/bad_col"
"$PYTHON" - "$WORK" <<'EOF'
import json, shutil, sys, os
w = sys.argv[1]
c = json.load(open(os.path.join(w, "compare", "compare.json")))
del c["engines"]["fsdp2"]["peak_rss_bytes"]
json.dump(c, open(os.path.join(w, "bad_key", "compare.json"), "w"))
EOF
expect_error '"peak_rss_bytes"' compare "$WORK/bad_key"

if [ "$fail" -ne 0 ]; then echo "test_plot: FAILED" >&2; exit 1; fi
echo "test_plot: all passed"
