#!/usr/bin/env python3
"""PNG charts for the fsdp.cpp benchmarks (matplotlib, Agg backend: no display needed).

  plot.py compare DIR   DIR/compare.json (+ the metrics.jsonl files it names) -> DIR/compare.png
  plot.py sweep DIR     DIR/sweep.csv -> DIR/sweep_throughput.png, sweep_memory.png, sweep_comm.png

Run it with the project's venv python (scripts/bootstrap.sh installs matplotlib there):
  ~/.cache/fsdp.cpp/venv-torch-2.11.0/bin/python bench/plot.py compare runs/compare

compare.json:
  {"config", "world_size", "machine", "date",
   "engines": {NAME: {"metrics": PATH, "median_step_s", "peak_rss_bytes",
                      "peak_memory_bytes" (optional: the memory compared, default the RSS),
                      "tokens_per_s" (optional), "comm_wait_s" (optional)}, ...},
   "memory_kind" (optional: what peak_memory_bytes is, e.g. "allocated (CUDA)"; default RSS),
   "ratios": {"step_time", "memory"} (optional; computed from the engines when absent),
   "max_loss_abs_diff" (optional), "warmup_steps" (optional, default: first 10% of the steps),
   "runs": [{"engine", "repeat", "metrics": PATH}, ...] (optional; default: the engines' metrics)}
  Paths are relative to DIR. metrics.jsonl lines are {"step", "loss", "step_time_s", ...};
  lines without "loss" (eval, checkpoint records) are skipped.

sweep.csv columns: model, params, strategy, world_size, tokens_per_s, tokens_per_s_per_rank,
  step_time_s, peak_tensor_bytes, state_bytes, peak_rss_bytes, comm_wire_bytes_per_step,
  theory_state_bytes, theory_wire_bytes_per_step, predicted_step_time_s, predicted_peak_bytes
  (an empty cell is a missing value: it is not drawn).

Only the standard library (csv, json), numpy and matplotlib are used.
"""

import argparse
import csv
import json
import math
import os
import sys


def die(msg):
    print(f"plot.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullLocator, FuncFormatter
    import numpy as np
except ImportError as e:  # pragma: no cover
    die(f"{e}; run scripts/bootstrap.sh and use its venv python "
        "(~/.cache/fsdp.cpp/venv-torch-<version>/bin/python), which has matplotlib and numpy")

DPI = 120
ENGINE_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
ENGINE_MARKERS = ["o", "x", "s", "^", "D"]
ENGINE_STYLES = ["-", "--", "-.", ":", "-"]
STRATEGY_ORDER = ["full_shard", "shard_grad_op", "hybrid_shard", "hsdp", "no_shard", "ddp"]
STRATEGY_COLORS = {"full_shard": "#1f77b4", "shard_grad_op": "#ff7f0e", "no_shard": "#2ca02c",
                   "ddp": "#2ca02c", "hybrid_shard": "#9467bd", "hsdp": "#9467bd"}
EXTRA_COLORS = ["#d62728", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


# --- helpers --------------------------------------------------------------------------------
def require_file(path):
    if not os.path.isfile(path):
        die(f"missing file {path}")
    return path


def need(obj, key, where):
    if not isinstance(obj, dict) or key not in obj:
        die(f"{where}: missing key \"{key}\"")
    return obj[key]


def need_number(obj, key, where):
    v = need(obj, key, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        die(f"{where}: key \"{key}\" is {v!r}, not a number")
    return float(v)


def byte_unit(max_bytes):
    """(divisor, name) so that values read as MiB or GiB."""
    if max_bytes >= 2 * 1024**3:
        return 1024.0**3, "GiB"
    if max_bytes >= 2 * 1024**2 or max_bytes == 0:
        return 1024.0**2, "MiB"
    return 1024.0, "KiB"


def fmt_bytes(b):
    div, unit = byte_unit(b)
    return f"{b / div:.3g} {unit}"


def save(fig, path):
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"wrote {path}")


# --- compare --------------------------------------------------------------------------------
def read_metrics(path):
    """(steps, losses, step_times) from a metrics.jsonl, skipping records without "loss"."""
    require_file(path)
    steps, losses, times = [], [], []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                die(f"{path}:{lineno}: not JSON ({e})")
            if not isinstance(rec, dict) or "loss" not in rec:
                continue  # eval / checkpoint / other records
            where = f"{path}:{lineno}"
            steps.append(int(need_number(rec, "step", where)))
            losses.append(need_number(rec, "loss", where))
            times.append(need_number(rec, "step_time_s", where))
    if not steps:
        die(f"{path}: no training records (lines with \"step\", \"loss\", \"step_time_s\")")
    order = np.argsort(steps, kind="stable")
    return (np.asarray(steps)[order], np.asarray(losses)[order], np.asarray(times)[order])


def ratio_label(names, values, given):
    """Ratio text; the direction (a/b or b/a) is taken from the given ratio when there is one."""
    a, b = values[0], values[1]
    fwd = a / b if b else float("nan")
    bwd = b / a if a else float("nan")
    if given is None:
        return f"{names[0]} / {names[1]} = {fwd:.2f}x"
    if not math.isfinite(bwd) or abs(given - fwd) <= abs(given - bwd):
        return f"{names[0]} / {names[1]} = {given:.2f}x"
    return f"{names[1]} / {names[0]} = {given:.2f}x"


def annotate_bars(ax, bars, texts):
    for bar, text in zip(bars, texts):
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8)


def cmd_compare(d):
    jpath = require_file(os.path.join(d, "compare.json"))
    try:
        with open(jpath) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        die(f"{jpath}: not JSON ({e})")
    for key in ("config", "world_size", "machine", "date"):
        need(cfg, key, jpath)
    engines = need(cfg, "engines", jpath)
    if not isinstance(engines, dict) or len(engines) < 2:
        die(f"{jpath}: \"engines\" must name at least two engines")
    names = list(engines)
    info = {}
    for n in names:  # every key first, then the files
        e = engines[n]
        where = f"{jpath}: engines.{n}"
        info[n] = {
            "path": os.path.join(d, need(e, "metrics", where)),
            "median": need_number(e, "median_step_s", where),
            "rss": need_number(e, "peak_memory_bytes", where) if e.get("peak_memory_bytes") is not None
                   else need_number(e, "peak_rss_bytes", where),
            "comm": need_number(e, "comm_wait_s", where) if e.get("comm_wait_s") is not None else None,
            "tps": need_number(e, "tokens_per_s", where) if e.get("tokens_per_s") is not None else None,
        }
    for n in names:
        info[n]["metrics"] = read_metrics(info[n]["path"])
    ratios = cfg.get("ratios") or {}
    runs = cfg.get("runs")
    if runs:
        run_data = []
        for i, r in enumerate(runs):
            where = f"{jpath}: runs[{i}]"
            eng = need(r, "engine", where)
            if eng not in info:
                die(f"{where}: engine \"{eng}\" is not in \"engines\"")
            run_data.append((eng, r.get("repeat", i), read_metrics(os.path.join(d, need(r, "metrics", where)))))
    else:
        run_data = [(n, 0, info[n]["metrics"]) for n in names]
    color = {n: ENGINE_COLORS[i % len(ENGINE_COLORS)] for i, n in enumerate(names)}
    marker = {n: ENGINE_MARKERS[i % len(ENGINE_MARKERS)] for i, n in enumerate(names)}
    style = {n: ENGINE_STYLES[i % len(ENGINE_STYLES)] for i, n in enumerate(names)}

    fig = plt.figure(figsize=(12, 8.5))
    gs = fig.add_gridspec(2, 2, hspace=0.32, wspace=0.22, left=0.06, right=0.98, top=0.89,
                          bottom=0.07)
    ax_loss = fig.add_subplot(gs[0, 0])
    ax_diff = fig.add_subplot(gs[0, 1])
    ax_time = fig.add_subplot(gs[1, 0])
    gs_bars = gs[1, 1].subgridspec(1, 2, wspace=0.38)
    ax_bt = fig.add_subplot(gs_bars[0])
    ax_bm = fig.add_subplot(gs_bars[1])

    # Loss vs step, overlaid.
    for n in names:
        s, l, _ = info[n]["metrics"]
        ax_loss.plot(s, l, style[n], color=color[n], marker=marker[n],
                     markevery=max(1, len(s) // 25), ms=5, lw=1.2, label=n,
                     mfc="none" if marker[n] in "osD^" else None)
    ax_loss.set_title("Training loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()

    # |loss difference| vs step (log y); exact zeros drawn at a floor with their own marker.
    ref = names[0]
    rs, rl, _ = info[ref]["metrics"]
    all_pos, diffs = [], []
    for n in names[1:]:
        s, l, _ = info[n]["metrics"]
        common, ia, ib = np.intersect1d(rs, s, return_indices=True)
        dl = np.abs(rl[ia] - l[ib])
        diffs.append((n, common, dl))
        all_pos.extend(dl[dl > 0].tolist())
    floor = min(all_pos) / 10 if all_pos else 1e-12
    zero_label_done = False
    for n, common, dl in diffs:
        lab = f"|{ref} - {n}|" if len(names) > 2 else f"|loss({ref}) - loss({n})|"
        pos = dl > 0
        if pos.any():
            ax_diff.plot(common[pos], dl[pos], "o-", color=color[n] if len(names) > 2 else "#444",
                         ms=3, lw=0.8, label=lab)
        elif len(common):
            ax_diff.text(0.5, 0.6, f"{ref} and {n}: identical loss at all {len(common)} common steps",
                         transform=ax_diff.transAxes, ha="center", fontsize=9)
        if (~pos).any():
            ax_diff.plot(common[~pos], np.full((~pos).sum(), floor), "v", color="#2ca02c", ms=5,
                         label=None if zero_label_done else f"identical (0), drawn at {floor:.1e}")
            zero_label_done = True
        if not len(common):
            ax_diff.text(0.5, 0.5, f"no common steps between {ref} and {n}",
                         transform=ax_diff.transAxes, ha="center")
    mad = cfg.get("max_loss_abs_diff")
    if isinstance(mad, (int, float)) and mad > 0:
        ax_diff.axhline(mad, color="#d62728", ls="--", lw=1, label=f"max |diff| = {mad:.2e}")
    ax_diff.set_yscale("log")
    ax_diff.set_title("Absolute loss difference")
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("|loss difference|")
    ax_diff.grid(alpha=0.3, which="both")
    ax_diff.legend(fontsize=8)

    # Step time vs step for every run, warm-up shaded.
    max_step = max(int(m[0].max()) for _, _, m in run_data)
    min_step = min(int(m[0].min()) for _, _, m in run_data)
    warm = cfg.get("warmup_steps")
    if isinstance(warm, (int, float)) and not isinstance(warm, bool):
        warm, warm_label = int(warm), f"warm-up ({int(warm)} steps, not in medians)"
    else:
        warm = max(1, (max_step - min_step + 1) // 10)
        warm_label = f"warm-up (assumed: first {warm} steps)"
    if warm > 0:
        ax_time.axvspan(min_step - 0.5, min_step + warm - 0.5, color="#999", alpha=0.25,
                        label=warm_label)
    seen = set()
    for eng, rep, (s, _, t) in run_data:
        lab = None if eng in seen else f"{eng} (each run)"
        seen.add(eng)
        ax_time.plot(s, t * 1e3, style[eng], color=color[eng], alpha=0.65, lw=1, label=lab)
        w = s < min_step + warm
        ax_time.plot(s[w], t[w] * 1e3, marker[eng], color=color[eng], ms=4, alpha=0.8,
                     mfc="none" if marker[eng] in "osD^" else None)
    for n in names:
        ax_time.axhline(info[n]["median"] * 1e3, color=color[n], ls=":", lw=1.5,
                        label=f"{n} median {info[n]['median'] * 1e3:.1f} ms")
    ax_time.set_title(f"Step time, {len(run_data)} run(s)")
    ax_time.set_xlabel("step")
    ax_time.set_ylabel("step time (ms)")
    ax_time.set_ylim(bottom=0)
    ax_time.grid(alpha=0.3)
    ax_time.legend(fontsize=8, ncol=2)

    # Bars: median step time (with comm wait share) and peak RSS per rank.
    x = np.arange(len(names))
    meds = [info[n]["median"] * 1e3 for n in names]
    bars = ax_bt.bar(x, meds, color=[color[n] for n in names], width=0.6)
    comm = [info[n]["comm"] for n in names]
    if any(c is not None for c in comm):
        ax_bt.bar(x, [(c or 0) * 1e3 for c in comm], width=0.6, fill=False, hatch="///",
                  edgecolor="k", lw=0, label="hatched: comm wait")
        ax_bt.legend(fontsize=7, loc="upper center", frameon=False)
    annotate_bars(ax_bt, bars, [f"{m:.1f} ms" for m in meds])
    ax_bt.set_xticks(x, names, fontsize=8)
    ax_bt.set_ylabel("median step time (ms)")
    ax_bt.set_ylim(0, max(meds) * 1.45)
    ax_bt.set_title("Median step time\n" + ratio_label(names, meds, ratios.get("step_time")),
                    fontsize=10)
    rss = [info[n]["rss"] for n in names]
    div, unit = byte_unit(max(rss))
    bars = ax_bm.bar(x, [r / div for r in rss], color=[color[n] for n in names], width=0.6)
    annotate_bars(ax_bm, bars, [fmt_bytes(r) for r in rss])
    ax_bm.set_xticks(x, names, fontsize=8)
    kind = cfg.get("memory_kind") or "RSS"
    ax_bm.set_ylabel(f"peak {kind} per rank ({unit})")
    ax_bm.set_ylim(0, max(rss) / div * 1.3)
    ax_bm.set_title(f"Peak {kind} per rank\n" + ratio_label(names, rss, ratios.get("memory")),
                    fontsize=10)
    for ax in (ax_bt, ax_bm):
        ax.grid(alpha=0.3, axis="y")

    sub = "   ".join(f"{n}: {info[n]['tps']:,.0f} tok/s" for n in names if info[n]["tps"])
    fig.suptitle(f"{cfg['config']}: {' vs '.join(names)}, world size {cfg['world_size']}\n"
                 f"{cfg['machine']}, {cfg['date']}" + (f"   ({sub})" if sub else ""),
                 fontsize=12)
    save(fig, os.path.join(d, "compare.png"))


# --- sweep ----------------------------------------------------------------------------------
SWEEP_COLUMNS = ["model", "params", "strategy", "world_size", "tokens_per_s",
                 "tokens_per_s_per_rank", "step_time_s", "peak_tensor_bytes", "state_bytes",
                 "peak_rss_bytes", "comm_wire_bytes_per_step", "theory_state_bytes",
                 "theory_wire_bytes_per_step", "predicted_step_time_s", "predicted_peak_bytes"]
NUMERIC = SWEEP_COLUMNS[3:] + ["params"]


def read_sweep(path):
    require_file(path)
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        for c in SWEEP_COLUMNS:
            if c not in header:
                die(f"{path}: missing column \"{c}\" (has: {', '.join(header) or 'no header'})")
        rows = []
        for lineno, r in enumerate(reader, 2):
            row = {"model": r["model"].strip(), "strategy": r["strategy"].strip()}
            for c in NUMERIC:
                v = (r.get(c) or "").strip()
                if v == "" or v.lower() in ("nan", "na", "none"):
                    row[c] = float("nan")
                    continue
                try:
                    row[c] = float(v)
                except ValueError:
                    die(f"{path}:{lineno}: column \"{c}\" is {v!r}, not a number")
            if math.isnan(row["world_size"]):
                die(f"{path}:{lineno}: column \"world_size\" is empty")
            rows.append(row)
    if not rows:
        die(f"{path}: no rows")
    return rows


def human_params(p):
    if not math.isfinite(p):
        return "?"
    for div, suf in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if p >= div:
            return f"{p / div:.3g}{suf}"
    return f"{p:.0f}"


def sweep_layout(rows, title):
    models = []
    for r in rows:
        if r["model"] not in models:
            models.append(r["model"])
    strategies = sorted({r["strategy"] for r in rows},
                        key=lambda s: (STRATEGY_ORDER.index(s) if s in STRATEGY_ORDER else 99, s))
    colors, extra = {}, iter(EXTRA_COLORS * 4)
    for s in strategies:
        colors[s] = STRATEGY_COLORS.get(s) or next(extra)
    worlds = sorted({int(r["world_size"]) for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(max(6, 6 * len(models)), 4.6), squeeze=False)
    axes = axes[0]
    fig.suptitle(title, fontsize=12)
    for ax, m in zip(axes, models):
        params = next((r["params"] for r in rows if r["model"] == m and math.isfinite(r["params"])),
                      float("nan"))
        ax.set_title(f"{m} ({human_params(params)} parameters)", fontsize=11)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(worlds))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        lo, hi = min(worlds), max(worlds)
        ax.set_xlim(lo / 1.25, hi * 1.25)
        ax.set_xlabel("world size (ranks)")
        ax.grid(alpha=0.3)
    return fig, axes, models, strategies, colors


def series(rows, model, strategy, col, scale=1.0):
    pts = sorted((r["world_size"], r[col]) for r in rows
                 if r["model"] == model and r["strategy"] == strategy and math.isfinite(r[col]))
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts]) / scale


class Panel:
    """Draws one sweep panel's series so that coinciding ones stay visible: a point that lands on
    an earlier point of the same kind is drawn smaller (concentric dots), and a line equal to an
    earlier line of the same kind widens the earlier one (a band around the thinner line)."""

    def __init__(self, ax, ymax):
        self.ax, self.tol = ax, 0.012 * (ymax if ymax > 0 else 1.0)
        self.points, self.lines = {}, {}

    def points_of(self, kind, x, y, color, ms, hollow=False):
        seen = self.points.setdefault(kind, [])
        for xi, yi in zip(x, y):
            size = ms
            for px, py, pms in seen:
                if px == xi and abs(py - yi) <= self.tol:
                    size = min(size, pms - 3.5)
            size = max(size, 3.0)
            self.ax.plot([xi], [yi], "o", color=color, ms=size, mew=1.5,
                         mfc="none" if hollow else color, zorder=3)
            seen.append((xi, yi, size))

    def line_of(self, kind, x, y, color, ls):
        if len(x) == 0:
            return
        (line,) = self.ax.plot(x, y, ls, color=color, lw=1.5, zorder=2)
        for other, ox, oy in self.lines.setdefault(kind, []):
            if len(ox) == len(x) and (ox == x).all() and (np.abs(oy - y) <= self.tol).all():
                other.set_linewidth(other.get_linewidth() + 3)
                other.set_zorder(other.get_zorder() - 0.1)
        self.lines[kind].append((line, x, y))


def finish_sweep(fig, strategies, colors, styles, path):
    handles = [Line2D([], [], color=colors[s], lw=3, label=s) for s in strategies]
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.065),
               ncol=len(handles), fontsize=9, frameon=False, title="colour: strategy",
               title_fontsize=9)
    fig.legend(handles=styles, loc="lower center", bbox_to_anchor=(0.5, 0.0),
               ncol=len(styles), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    save(fig, path)


def style_handle(label, marker=None, ls="none", hollow=False):
    return Line2D([], [], color="#444", marker=marker, ls=ls, lw=1.5, ms=6,
                  mfc="none" if hollow else "#444", label=label)


def panel_max(rows, model, cols):
    vals = [r[c] for r in rows if r["model"] == model for c in cols if math.isfinite(r[c])]
    return max(vals) if vals else 0.0


def cmd_sweep(d):
    rows = read_sweep(os.path.join(d, "sweep.csv"))

    # Throughput per rank: measured points, predicted dashed. The prediction is a step time;
    # per-rank tokens/s follows from the measured tokens per step (tokens/s x step time).
    for r in rows:
        tok_step = r["tokens_per_s"] * r["step_time_s"]
        p = r["predicted_step_time_s"]
        ok = math.isfinite(tok_step) and math.isfinite(p) and p > 0
        r["_predicted_tps_per_rank"] = tok_step / p / r["world_size"] if ok else float("nan")
    fig, axes, models, strategies, colors = sweep_layout(rows, "Throughput per rank")
    for ax, m in zip(axes, models):
        pan = Panel(ax, panel_max(rows, m, ("tokens_per_s_per_rank", "_predicted_tps_per_rank")))
        for s in strategies:
            pan.points_of("measured", *series(rows, m, s, "tokens_per_s_per_rank"), colors[s], 9)
            pan.line_of("predicted", *series(rows, m, s, "_predicted_tps_per_rank"), colors[s], "--")
        ax.set_ylabel("tokens/s per rank")
        ax.set_ylim(bottom=0)
    finish_sweep(fig, strategies, colors,
                 [style_handle("measured", "o"), style_handle("predicted (cost model)", ls="--")],
                 os.path.join(d, "sweep_throughput.png"))

    # Memory per rank.
    fig, axes, models, strategies, colors = sweep_layout(rows, "Memory per rank")
    for ax, m in zip(axes, models):
        ymax = panel_max(rows, m, ("peak_tensor_bytes", "state_bytes", "theory_state_bytes",
                                   "predicted_peak_bytes"))
        div, unit = byte_unit(ymax)
        pan = Panel(ax, ymax / div)
        for s in strategies:
            pan.points_of("peak", *series(rows, m, s, "peak_tensor_bytes", div), colors[s], 9)
            pan.points_of("state", *series(rows, m, s, "state_bytes", div), colors[s], 12,
                          hollow=True)
            pan.line_of("theory", *series(rows, m, s, "theory_state_bytes", div), colors[s], "-")
            pan.line_of("predicted", *series(rows, m, s, "predicted_peak_bytes", div), colors[s],
                        "--")
        ax.set_ylabel(f"bytes per rank ({unit})")
        ax.set_ylim(bottom=0)
    finish_sweep(fig, strategies, colors,
                 [style_handle("measured peak tensor bytes", "o"),
                  style_handle("measured state: params+grads+optimizer", "o", hollow=True),
                  style_handle("theory state (ZeRO; DDP 16 B/param)", ls="-"),
                  style_handle("predicted peak", ls="--")],
                 os.path.join(d, "sweep_memory.png"))

    # Communication: wire bytes per step per rank.
    fig, axes, models, strategies, colors = sweep_layout(rows, "Communication per rank and step")
    for ax, m in zip(axes, models):
        ymax = panel_max(rows, m, ("comm_wire_bytes_per_step", "theory_wire_bytes_per_step"))
        div, unit = byte_unit(ymax)
        pan = Panel(ax, ymax / div)
        for s in strategies:
            pan.points_of("measured", *series(rows, m, s, "comm_wire_bytes_per_step", div),
                          colors[s], 9)
            pan.line_of("theory", *series(rows, m, s, "theory_wire_bytes_per_step", div),
                        colors[s], "-")
        ax.set_ylabel(f"wire bytes per step per rank ({unit})")
        ax.set_ylim(bottom=0)
    finish_sweep(fig, strategies, colors,
                 [style_handle("measured", "o"), style_handle("theory (ring collectives)", ls="-")],
                 os.path.join(d, "sweep_comm.png"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("compare", help="DIR/compare.json -> DIR/compare.png")
    p.add_argument("dir")
    p = sub.add_parser("sweep", help="DIR/sweep.csv -> DIR/sweep_{throughput,memory,comm}.png")
    p.add_argument("dir")
    args = ap.parse_args()
    if not os.path.isdir(args.dir):
        die(f"missing directory {args.dir}")
    {"compare": cmd_compare, "sweep": cmd_sweep}[args.cmd](args.dir)


if __name__ == "__main__":
    main()
