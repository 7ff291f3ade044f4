#!/usr/bin/env python3
"""Red-team pass over a built fsdp.cpp: feeds the real `fsdp` binary broken configs, mutated
checkpoints, hostile safetensors files, killed / stopped / preempted ranks and numerical faults,
and counts how each trial ended. docs/redteam.md says what each category does and holds the
measured table.

  scripts/redteam/redteam.py                       # every category (about 15 min on 2 cores)
  scripts/redteam/redteam.py --quick               # a few trials per category
  scripts/redteam/redteam.py --category checkpoint --out runs/redteam

Outcomes of a trial:
  handled   a non-zero exit with a message naming what was wrong (the key, file, tensor, rank)
  ok        accepted, and the result is right (a resume gives the unmutated resume's losses)
  unnamed   a non-zero exit whose message does not name what was wrong
  silent    exit 0 where the input had to be refused, or a wrong result (different losses)
  crash     a signal, an abort, an uncaught exception ("terminate called")
  hang      the trial's timeout passed
  blamed    the launcher's headline names another rank than the one that was faulted
Exit status: 0 when no trial is unnamed, silent, crash, hang or blamed; 1 otherwise.
"""
import argparse
import concurrent.futures
import copy
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BAD = ("unnamed", "silent", "crash", "hang", "blamed")
# libtorch's c10d logs warnings with "Exception raised from ..." traces on the way to a clean
# failure: only these mean the process died badly.
CRASH_MARKS = ("terminate called", "Segmentation fault", "core dumped", "signal 6", "signal 11",
               "Aborted (core")


class Trial:
    def __init__(self, category, name, outcome, detail="", code=None, seconds=0.0):
        self.category, self.name, self.outcome = category, name, outcome
        self.detail, self.code, self.seconds = detail, code, seconds

    def to_json(self):
        return {"category": self.category, "trial": self.name, "outcome": self.outcome,
                "exit": self.code, "seconds": round(self.seconds, 2), "detail": self.detail}


def run(argv, timeout, env=None):
    """Runs argv; returns (exit code or None on timeout, output, seconds)."""
    start = time.time()
    e = dict(os.environ)
    e["CUDA_VISIBLE_DEVICES"] = "-1"  # the CPU, as the test suite
    if env:
        e.update(env)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=e,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out.decode(errors="replace"), time.time() - start
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, out.decode(errors="replace"), time.time() - start


def first_error(out):
    for line in out.splitlines():
        low = line.lower()
        if any(w in low for w in ("error", "invalid", "refus", "failed", "cannot", "not ", "missing",
                                  "must", "expected", "mismatch", "unknown")):
            return line.strip()[:300]
    lines = [l for l in out.splitlines() if l.strip()]
    return lines[-1][:300] if lines else ""


def classify(code, out, names, expect):
    """expect: 'refuse' (must exit non-zero naming one of `names`), 'accept' (must exit 0) or
    'either' (exit 0 or a named refusal). Returns (outcome, detail)."""
    if code is None:
        return "hang", out.strip().splitlines()[-1][:300] if out.strip() else ""
    if code < 0 or code in (134, 139) or any(m in out for m in CRASH_MARKS):
        mark = next((m for m in CRASH_MARKS if m in out), f"exit {code}")
        return "crash", mark + ": " + first_error(out)
    if code == 0:
        if expect == "refuse":
            return "silent", "accepted"
        return "ok", ""
    detail = first_error(out)
    if expect == "accept":
        return "unnamed", f"refused a valid input: {detail}"
    if any(n and n in out for n in names):
        return "handled", detail
    return "unnamed", detail


def losses(run_dir):
    out = {}
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return out
    for line in open(path):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "loss" in r and "step" in r:
            out[r["step"]] = r["loss"]
    return out


class Harness:
    def __init__(self, args):
        self.fsdp = args.fsdp
        self.out = os.path.abspath(args.out)
        self.quick = args.quick
        self.jobs = args.jobs
        self.rng = random.Random(20261124)
        self.trials = []
        os.makedirs(self.out, exist_ok=True)
        self.work = os.path.join(self.out, "work")
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        self.counter = 0

    def fresh(self, tag):
        self.counter += 1
        d = os.path.join(self.work, f"{tag}_{self.counter}")
        shutil.rmtree(d, ignore_errors=True)
        return d

    def sample(self, items, quick_n):
        return items[:quick_n] if self.quick else items

    def train(self, run_dir, sets, timeout=90, env=None, config=None):
        argv = [self.fsdp, "train", config or os.path.join(ROOT, "configs/default.yaml"),
                "--quiet", "--set", f"run.dir={run_dir}", "--set", "metrics.progress_bar=off",
                "--set", "training.eval_interval=0", "--set", "model.n_layers=2"]
        for s in sets:
            argv += ["--set", s]
        return run(argv, timeout, env)

    def add(self, t):
        self.trials.append(t)
        mark = "" if t.outcome in ("handled", "ok") else "   <--"
        print(f"  {t.category:<12} {t.outcome:<8} {t.name[:70]:<70} {t.detail[:90]}{mark}",
              flush=True)

    def parallel(self, fn, items):
        with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
            for t in pool.map(fn, items):
                self.add(t)

    # ---- configs --------------------------------------------------------------------------
    def configs(self):
        base_text = open(os.path.join(ROOT, "configs/default.yaml")).read()
        # A 1-step, 1-rank, checkpoint-free base, so that a valid mutation costs a second.
        pins = {"steps": "1", "nproc": "1", "enabled": "false", "eval_interval": "0",
                "n_layers": "1"}
        lines = base_text.splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^(\s+)([a-z_0-9]+):\s*(\S.*?)?\s*(#.*)?$", line)
            if m and m.group(2) in pins:
                lines[i] = f"{m.group(1)}{m.group(2)}: {pins[m.group(2)]}"
        base = lines
        keys = []
        section = None
        for i, line in enumerate(base):
            top = re.match(r"^([a-z_]+):\s*$", line)
            if top:
                section = top.group(1)
                continue
            m = re.match(r"^(\s+)([a-z_0-9]+):\s*(\S.*?)?\s*(#.*)?$", line)
            if m and section:
                keys.append((i, section, m.group(2), m.group(1), m.group(3) or ""))
        cases = []
        string_like = {"name", "dir", "path", "init_from", "load", "profile_dir", "arch", "jsonl"}
        for (i, section, key, indent, value) in keys:
            full = f"{section}.{key}"
            # A refusal is named when it names the key, or the value where the value is a path.
            muts = [
                ("typo", f"{indent}{key}x: {value}", "refuse", [f"{key}x"]),
                ("banana", f"{indent}{key}: banana", "either", [full, key, "'banana'",
                                                                 "file banana", "banana:"]),
                ("negative", f"{indent}{key}: -3", "either", [full, key, "file -3", "-3:"]),
                ("huge", f"{indent}{key}: 1.0e+300", "either",
                 [full, key, "file 1.0e+300", "1.0e+300:"]),
                ("list", f"{indent}{key}: [1, 2]", "either" if key in ("freeze",) else "refuse",
                 [full, key]),
                ("deleted", None, "either", [full, key]),
            ]
            if key in string_like:
                muts = [m for m in muts if m[0] != "list"]
            for tag, new, expect, names in muts:
                cases.append((f"{full} {tag}", i, new, expect, names))
        # Whole-file faults.
        extra = [
            ("second YAML document", "append", "---\ntraining:\n  steps: 5\n", "refuse",
             ["document"]),
            ("unknown section", "append", "bogus:\n  key: 1\n", "refuse", ["bogus"]),
            ("duplicate key", "append", "training:\n  steps: 2\n", "either", ["training"]),
            ("tab indentation", "replace", base_text.replace("  steps", "\tsteps", 1), "refuse",
             ["line", "yaml", "YAML"]),
            ("not a mapping", "replace", "- just\n- a list\n", "refuse", ["mapping", "map"]),
            ("empty file", "replace", "", "either", ["empty", "config"]),
            ("binary garbage", "replace", "\x00\xff\xfe garbage \x01", "refuse", ["yaml", "YAML",
                                                                                  "line"]),
        ]
        cases = self.sample(cases, 40)
        print(f"config: {len(cases) + len(extra)} mutations of configs/default.yaml", flush=True)

        def one(case):
            name, idx, new, expect, names = case
            d = self.fresh("cfg")
            os.makedirs(d)
            text = list(base)
            if new is None:
                del text[idx]
            else:
                text[idx] = new
            path = os.path.join(d, "config.yaml")
            open(path, "w").write("\n".join(text) + "\n")
            # A deleted key takes its default: training.steps' 200 steps run in ~4 s on a quiet
            # machine but past a minute beside a parallel test suite, which is not a hang.
            code, out, secs = run([self.fsdp, "train", path, "--quiet", "--set",
                                   f"run.dir={d}/run"], 60 if new is not None else 240)
            outcome, detail = classify(code, out, names + ["config.yaml:"], expect)
            shutil.rmtree(d, ignore_errors=True)
            return Trial("config", name, outcome, detail, code, secs)

        def whole(case):
            name, how, text, expect, names = case
            d = self.fresh("cfg")
            os.makedirs(d)
            path = os.path.join(d, "config.yaml")
            body = "\n".join(base) + "\n" + text if how == "append" else text
            open(path, "w", errors="surrogateescape").write(body)
            code, out, secs = run([self.fsdp, "train", path, "--quiet", "--set",
                                   f"run.dir={d}/run"], 60)
            outcome, detail = classify(code, out, names + ["config.yaml"], expect)
            shutil.rmtree(d, ignore_errors=True)
            return Trial("config", name, outcome, detail, code, secs)

        self.parallel(one, cases)
        self.parallel(whole, extra)

    # ---- checkpoints ------------------------------------------------------------------------
    def make_checkpoint(self):
        d = os.path.join(self.work, "ckpt_source")
        code, out, _ = self.train(d, ["training.steps=4", "training.log_interval=1",
                                      "checkpoint.enabled=true", "checkpoint.interval=4",
                                      "checkpoint.async=false"], timeout=120)
        if code != 0:
            sys.exit(f"redteam: could not make the source checkpoint:\n{out}")
        return os.path.join(d, "checkpoints", "step_000000004")

    def resume(self, ckpt, extra=(), timeout=90):
        d = self.fresh("resume")
        code, out, secs = self.train(d, ["training.steps=6", "training.log_interval=1",
                                         f"checkpoint.load={ckpt}", "checkpoint.enabled=false"]
                                     + list(extra), timeout=timeout)
        got = losses(d)
        shutil.rmtree(d, ignore_errors=True)
        return code, out, secs, got

    def checkpoints(self):
        src = self.make_checkpoint()
        code, out, _, want = self.resume(src)
        if code != 0 or 5 not in want:
            sys.exit(f"redteam: the unmutated resume failed:\n{out}")
        meta0 = json.load(open(os.path.join(src, "metadata.json")))
        files = ["metadata.json"] + [f["file"] if isinstance(f, dict) else f
                                     for f in meta0["files"]]
        cases = []  # (name, mutate(folder), expect, names, resume extra sets)

        def file_op(fname, op):
            def mutate(folder):
                p = os.path.join(folder, fname)
                data = open(p, "rb").read()
                if op == "delete":
                    os.remove(p)
                elif op == "empty":
                    open(p, "wb").close()
                elif op == "half":
                    open(p, "wb").write(data[: len(data) // 2])
                elif op == "minus1":
                    open(p, "wb").write(data[:-1])
                elif op == "append":
                    open(p, "ab").write(b"\0")
                elif op == "directory":
                    os.remove(p)
                    os.mkdir(p)
                elif op == "fifo":
                    os.remove(p)
                    os.mkfifo(p)
            return mutate

        for f in files:
            for op in ("delete", "empty", "half", "minus1", "append", "directory", "fifo"):
                # Bytes after a shard file's chunks, or after metadata.json's closing brace (a
                # NUL, or its trailing newline gone), change no tensor: either answer is right.
                benign = op == "append" or (op == "minus1" and f == "metadata.json")
                expect = "either" if benign else "refuse"
                cases.append((f"{f} {op}", file_op(f, op), expect, [f], []))

        def flip(fname, offset):
            def mutate(folder):
                p = os.path.join(folder, fname)
                data = bytearray(open(p, "rb").read())
                data[offset % len(data)] ^= 0x5A
                open(p, "wb").write(bytes(data))
            return mutate

        for f in files[1:]:
            size = os.path.getsize(os.path.join(src, f))
            for k in range(20):
                cases.append((f"{f} byte {k} flipped", flip(f, self.rng.randrange(max(size, 1))),
                              "refuse", [f], []))

        def meta_edit(fn):
            def mutate(folder):
                p = os.path.join(folder, "metadata.json")
                m = json.load(open(p))
                fn(m)
                open(p, "w").write(json.dumps(m))
            return mutate

        tensors = meta0["tensors"]
        picks = self.rng.sample(range(len(tensors)), min(20, len(tensors)))
        for ti in picks:
            t = tensors[ti]
            name = t["name"]

            def dtype(to, ti=ti):
                return lambda m: m["tensors"][ti].__setitem__("dtype", to)

            def shape(ti=ti):
                def f(m):
                    s = m["tensors"][ti]["shape"]
                    m["tensors"][ti]["shape"] = [s[0] + 1] + s[1:] if s else [2]
                return f

            def drop(ti=ti):
                return lambda m: m["tensors"].pop(ti)

            def rename(ti=ti):
                return lambda m: m["tensors"][ti].__setitem__("name",
                                                              m["tensors"][ti]["name"] + "_x")

            def dup(ti=ti):
                return lambda m: m["tensors"].append(copy.deepcopy(m["tensors"][ti]))

            def chunk(field, delta, ti=ti):
                def f(m):
                    c = m["tensors"][ti]["chunks"][0]
                    if field == "rows":
                        c["rows"] = [c["rows"][0], c["rows"][1] + delta]
                    else:
                        c[field] = c[field] + delta
                return f

            def add_tensor(ti=ti):
                def f(m):
                    t2 = copy.deepcopy(m["tensors"][ti])
                    t2["name"] = t2["name"].replace("model/", "model/extra_")
                    m["tensors"].append(t2)
                return f

            for tag, fn in [("dtype F32->I32", dtype("I32")), ("dtype F32->BF16", dtype("BF16")),
                            ("dtype bogus", dtype("Q7")), ("shape +1", shape()),
                            ("dropped", drop()), ("renamed", rename()), ("duplicated", dup()),
                            ("extra tensor", add_tensor()), ("chunk rows +1", chunk("rows", 1)),
                            ("chunk offset +4", chunk("offset", 4)),
                            ("chunk nbytes -4", chunk("nbytes", -4)),
                            ("chunk crc +1", chunk("crc32", 1))]:
                cases.append((f"{name} {tag}", meta_edit(fn), "refuse",
                              [name, name.split("/")[-1], "metadata.json"], []))

        def top(fn):
            return meta_edit(fn)

        opt = lambda m: m["extra"]["optimizer"]
        cases += [
            ("metadata version 2", top(lambda m: m.__setitem__("version", 2)), "refuse",
             ["version"], []),
            ("metadata format renamed", top(lambda m: m.__setitem__("format", "other")), "refuse",
             ["format"], []),
            ("metadata step 5 in folder 4", top(lambda m: m.__setitem__("step", 5)), "refuse",
             ["step"], []),
            ("metadata world_size 3", top(lambda m: m.__setitem__("world_size", 3)), "either",
             ["world_size", "world size"], []),
            ("metadata strategy no_shard", top(lambda m: m.__setitem__("strategy", "no_shard")),
             "either", ["strategy"], []),
            ("optimizer name sgd", top(lambda m: opt(m).__setitem__("name", "sgd")), "refuse",
             ["optimizer"], []),
            ("optimizer state exp_avg_sq dropped",
             top(lambda m: opt(m).__setitem__("state", ["exp_avg"])), "refuse",
             ["exp_avg_sq", "optimizer"], []),
            ("optimizer hyper-parameter lr dropped",
             top(lambda m: opt(m)["hyperparameters"].pop("lr")), "refuse", ["lr", "optimizer"],
             []),
            # The step tensors are still there and are read: the same resume is right too.
            ("optimizer step flag false", top(lambda m: opt(m).__setitem__("step", False)),
             "either", ["step"], []),
            ("data batch -1", top(lambda m: m["extra"]["data"].__setitem__("batch", -1)),
             "refuse", ["batch", "data"], []),
            ("metadata not JSON", file_op("metadata.json", "half"), "refuse", ["metadata.json"],
             []),
        ]
        # The checkpoint of another run: a different model or optimizer.
        cases += [
            ("into 1-layer model", lambda f: None, "refuse", ["layers.1", "n_layers", "model"],
             ["model.n_layers=1"]),
            ("into 3-layer model", lambda f: None, "refuse", ["layers.2", "n_layers", "model"],
             ["model.n_layers=3"]),
            ("into dim 64", lambda f: None, "refuse", ["shape", "dim"], ["model.dim=64"]),
            ("into SGD", lambda f: None, "refuse", ["optimizer", "sgd", "adamw"],
             ["optimizer.name=sgd"]),
            ("into SGD without its optimizer", lambda f: None, "accept", [],
             ["optimizer.name=sgd", "checkpoint.load_optimizer=false"]),
            ("into bf16 mixed precision", lambda f: None, "accept", [],
             ["training.mixed_precision=bf16"]),
        ]
        reshard = [("onto 1 rank", ["parallelism.nproc=1", "training.micro_batch_size=16"]),
                   ("onto 4 ranks", ["parallelism.nproc=4", "training.micro_batch_size=4"]),
                   ("onto hybrid 2x2", ["parallelism.nproc=4", "training.micro_batch_size=4",
                                        "parallelism.strategy=hybrid_shard",
                                        "parallelism.data_parallel_replicate_degree=2",
                                        "parallelism.data_parallel_shard_degree=2"])]
        cases = self.sample(cases, 25)
        print(f"checkpoint: {len(cases) + len(reshard)} mutations of a 2-rank checkpoint, each "
              "resumed for 2 steps", flush=True)

        def one(case):
            name, mutate, expect, names, extra = case
            parent = self.fresh("ckpt")
            folder = os.path.join(parent, os.path.basename(src))  # step_000000004, as saved
            shutil.copytree(src, folder)
            mutate(folder)
            code, out, secs, got = self.resume(folder, extra)
            verify_code, verify_out, _ = run([self.fsdp, "checkpoint", "inspect", folder,
                                              "--verify"], 60)
            shutil.rmtree(parent, ignore_errors=True)
            outcome, detail = classify(code, out, names + [parent], expect)
            if outcome == "ok" and not extra and got != want:
                outcome, detail = "silent", f"resumed with other losses: {got} vs {want}"
            if outcome == "handled" and verify_code == 0 and expect == "refuse" and not extra:
                detail += " (inspect --verify said it was fine)"
            if verify_code is None or (verify_code < 0):
                outcome, detail = "crash" if verify_code else "hang", "inspect --verify " + \
                    first_error(verify_out)
            return Trial("checkpoint", name, outcome, detail, code, secs)

        for t in map(one, cases):
            self.add(t)
        for name, extra in reshard:
            code, out, secs, got = self.resume(src, extra)
            outcome, detail = classify(code, out, [], "accept")
            if outcome == "ok":
                diff = max((abs(got.get(s, 1e9) - want[s]) / abs(want[s]) for s in want),
                           default=1e9)
                if diff > 1e-4:
                    outcome, detail = "silent", f"losses differ by {diff:.2e} relative"
                else:
                    detail = f"losses within {diff:.1e}"
            self.add(Trial("checkpoint", name, outcome, detail, code, secs))

    # ---- safetensors for model.init_from ---------------------------------------------------
    def safetensors(self):
        ck = os.path.join(self.work, "ckpt_source", "checkpoints")
        if not os.path.isdir(ck):
            self.make_checkpoint()
        good = os.path.join(self.work, "good.safetensors")
        code, out, _ = run([self.fsdp, "checkpoint", "export", ck, "--out", good], 60)
        if code != 0:
            sys.exit(f"redteam: export failed:\n{out}")
        raw = open(good, "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        data = raw[8 + n:]
        names = [k for k in header if k != "__metadata__"]

        def build(h, body, pad_header=True):
            text = json.dumps(h).encode()
            if pad_header:
                text += b" " * ((8 - len(text) % 8) % 8)
            return struct.pack("<Q", len(text)) + text + body

        cases = []  # (name, bytes or special, expect)
        cases.append(("valid file", raw, "accept"))
        for delta in (-8, -4, -1, 1, 4):
            b = bytearray(raw)
            b[:8] = struct.pack("<Q", n + delta)
            cases.append((f"header length {delta:+d}", bytes(b), "refuse"))
        cases.append(("header length huge", struct.pack("<Q", 1 << 62) + raw[8:], "refuse"))
        cases.append(("trailing bytes", raw + b"\0" * 16, "refuse"))
        cases.append(("truncated data", raw[:-5], "refuse"))
        cases.append(("truncated header", raw[: 8 + n // 2], "refuse"))
        cases.append(("only the length", raw[:8], "refuse"))
        cases.append(("empty file", b"", "refuse"))
        cases.append(("non-UTF-8 header", struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc", "refuse"))
        cases.append(("header not an object", build([1, 2], data), "refuse"))
        meta = dict(header)
        meta["__metadata__"] = {"format": 3}
        cases.append(("non-string metadata", build(meta, data), "refuse"))
        for k in self.sample(names, 4)[:8]:
            for tag, fn in [
                ("hole", lambda e: e.__setitem__("data_offsets", [e["data_offsets"][0] + 4,
                                                                  e["data_offsets"][1]])),
                ("past the end", lambda e: e.__setitem__("data_offsets",
                                                         [e["data_offsets"][0],
                                                          len(data) + 64])),
                ("negative shape", lambda e: e.__setitem__("shape", [-1] + e["shape"][1:])),
                ("shape too large", lambda e: e.__setitem__("shape", [e["shape"][0] * 2] +
                                                            e["shape"][1:])),
                ("unknown dtype", lambda e: e.__setitem__("dtype", "F31")),
                ("dtype I32", lambda e: e.__setitem__("dtype", "I32")),
                ("offsets reversed", lambda e: e.__setitem__("data_offsets",
                                                             e["data_offsets"][::-1])),
            ]:
                h = copy.deepcopy(header)
                fn(h[k])
                cases.append((f"{k}: {tag}", build(h, data), "refuse"))
            h = copy.deepcopy(header)
            h.pop(k)
            cases.append((f"{k}: missing", build(h, data), "refuse"))
            h = copy.deepcopy(header)
            h[k + "_extra"] = copy.deepcopy(h[k])
            cases.append((f"{k}: extra tensor overlapping", build(h, data), "refuse"))
        # Duplicate keys need hand-written JSON.
        k0 = names[0]
        dup_text = json.dumps(header)[:-1] + f', "{k0}": ' + json.dumps(header[k0]) + "}"
        dup_text = dup_text.encode()
        cases.append(("duplicate key", struct.pack("<Q", len(dup_text)) + dup_text + data,
                      "refuse"))
        # NaN weights (a valid file): training must stop at the first non-finite loss.
        nan = bytearray(raw)
        first = header[names[0]]
        s0 = 8 + n + first["data_offsets"][0]
        nan[s0:s0 + 4] = struct.pack("<f", float("nan"))
        cases.append(("a NaN weight", bytes(nan), "refuse"))
        specials = ["directory", "fifo", "symlink loop", "missing path", "dev/zero"]
        cases = self.sample(cases, 12)
        print(f"safetensors: {len(cases) + len(specials)} files for model.init_from", flush=True)

        def one(case):
            name, body, expect = case
            d = self.fresh("st")
            os.makedirs(d)
            path = os.path.join(d, "w.safetensors")
            open(path, "wb").write(body)
            code, out, secs = self.train(os.path.join(d, "run"), [
                "parallelism.nproc=1", "training.steps=2", "training.log_interval=1",
                f"model.init_from={path}"], timeout=60)
            outcome, detail = classify(code, out, ["w.safetensors", "init_from", "non-finite",
                                                   "nan", "NaN"], expect)
            shutil.rmtree(d, ignore_errors=True)
            return Trial("safetensors", name, outcome, detail, code, secs)

        def special(kind):
            d = self.fresh("st")
            os.makedirs(d)
            path = os.path.join(d, "w.safetensors")
            if kind == "directory":
                os.mkdir(path)
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "symlink loop":
                os.symlink(path, path)
            elif kind == "dev/zero":
                path = "/dev/zero"
            code, out, secs = self.train(os.path.join(d, "run"), [
                "parallelism.nproc=1", "training.steps=1", f"model.init_from={path}"], timeout=60)
            outcome, detail = classify(code, out, [path, "init_from"], "refuse")
            shutil.rmtree(d, ignore_errors=True)
            return Trial("safetensors", kind, outcome, detail, code, secs)

        self.parallel(one, cases)
        self.parallel(special, specials)

    # ---- ranks killed, stopped, preempted ---------------------------------------------------
    def rank_pids(self, launcher_pid):
        """{rank: pid} of the `fsdp train` rank processes under the launcher."""
        out = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                stat = open(f"/proc/{pid}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            for kv in env:
                if kv.startswith(b"RANK="):
                    out[int(kv[5:])] = int(pid)
        return out

    def fault(self, name, sets, when, sig, victim, expect_exit, env=None, after=None,
              timeout=120):
        """Starts a 2-rank run, waits until `when(run_dir)` holds, sends `sig` to rank
        `victim`, and checks the group's end."""
        d = self.fresh("sig")
        argv = [self.fsdp, "train", os.path.join(ROOT, "configs/default.yaml"), "--quiet",
                "--set", f"run.dir={d}", "--set", "metrics.progress_bar=off", "--set",
                "training.eval_interval=0", "--set", "model.n_layers=2", "--set",
                "training.log_interval=1"]
        for s in sets:
            argv += ["--set", s]
        e = dict(os.environ, CUDA_VISIBLE_DEVICES="-1", **(env or {}))
        start = time.time()
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=e,
                             start_new_session=True)
        sent_at = None
        while time.time() - start < timeout and p.poll() is None:
            if when(d):
                ranks = self.rank_pids(p.pid)
                if victim in ranks:
                    os.kill(ranks[victim], sig)
                    sent_at = time.time()
                    break
            time.sleep(0.05)
        try:
            out, _ = p.communicate(timeout=max(5, timeout - (time.time() - start)))
            code = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            code = None
        out = out.decode(errors="replace")
        for pid in self.rank_pids(p.pid).values():  # a stopped rank left behind
            os.kill(pid, signal.SIGKILL)
        secs = time.time() - (sent_at or start)
        if sent_at is None:
            outcome, detail = "ok", "the run ended before the fault could be injected"
        elif code is None:
            outcome, detail = "hang", f"not ended {timeout} s after the fault"
        elif expect_exit in (0, 143):  # 143: stopped by SIGTERM after saving (preempted)
            outcome, detail = (("ok", "") if code == expect_exit
                               else ("unnamed", f"exit {code}: {first_error(out)}"))
        else:
            headline = next((l for l in out.splitlines() if "fsdp launch:" in l and
                             "failed" in l), "")
            if code == 0:
                outcome, detail = "silent", "exit 0 after the fault"
            elif f"rank {victim}" not in headline:
                outcome, detail = "blamed", headline[:200] or first_error(out)
            else:
                outcome, detail = "handled", f"{headline[:160]} ({secs:.1f} s after the fault)"
        if after is not None and outcome in ("handled", "ok"):
            outcome2, detail2 = after(d)
            if outcome2 != "ok":
                outcome, detail = outcome2, detail2
        shutil.rmtree(d, ignore_errors=True)
        return Trial("ranks", name, outcome, detail, code, secs)

    def resumable(self, d):
        code, out, _ = self.train(d + "_resumed", ["training.steps=410", "checkpoint.load=latest",
                                                   f"checkpoint.dir={d}/checkpoints",
                                                   "checkpoint.enabled=false"], timeout=120)
        if code != 0:
            return "silent", "load=latest after the fault failed: " + first_error(out)
        got = losses(d + "_resumed")
        shutil.rmtree(d + "_resumed", ignore_errors=True)
        return ("ok", "") if got else ("silent", "resumed run recorded no step")

    def ranks(self):
        def steps_done(k):
            return lambda d: len(losses(d)) >= k

        def checkpoints_done(k):
            def f(d):
                c = os.path.join(d, "checkpoints")
                return os.path.isdir(c) and len([x for x in os.listdir(c)
                                                 if re.fullmatch(r"step_\d+", x)]) >= k
            return f

        long_run = ["training.steps=400"]
        ckpt = ["training.steps=400", "checkpoint.enabled=true", "checkpoint.interval=1",
                "checkpoint.keep_latest_k=8"]
        trials = []
        for k in range(3):
            trials.append((f"SIGKILL rank {k % 2} at step {3 + k}",
                           dict(sets=long_run, when=steps_done(3 + k), sig=signal.SIGKILL,
                                victim=k % 2, expect_exit=1)))
        for k in range(10):
            trials.append((f"SIGKILL rank {k % 2} during saves (after {2 + k % 4} checkpoints, "
                           f"async {k % 3 != 0})",
                           dict(sets=ckpt + [f"checkpoint.async={'true' if k % 3 else 'false'}"],
                                when=checkpoints_done(2 + k % 4), sig=signal.SIGKILL,
                                victim=k % 2, expect_exit=1, after=self.resumable)))
        for k in range(2):
            trials.append((f"SIGSTOP rank {1 - k} (collective timeout 6 s)",
                           dict(sets=long_run, when=steps_done(3), sig=signal.SIGSTOP,
                                victim=1 - k, expect_exit=1,
                                env={"FSDP_COLLECTIVE_TIMEOUT_S": "6"}, timeout=90)))
        for k, interval in enumerate((1, 2, 5)):
            for asy in ("true", "false"):
                trials.append((f"SIGTERM rank 0, interval {interval}, async {asy}",
                               dict(sets=["training.steps=400", "checkpoint.enabled=true",
                                          f"checkpoint.interval={interval}",
                                          "checkpoint.keep_latest_k=1",
                                          f"checkpoint.async={asy}"],
                                    when=checkpoints_done(1), sig=signal.SIGTERM, victim=0,
                                    expect_exit=143, after=self.resumable)))
        for asy in ("true", "false"):  # between log steps (Note [SIGTERM at every step])
            trials.append((f"SIGTERM rank 1, log interval 50, interval 5, async {asy}",
                           dict(sets=["training.steps=400", "checkpoint.enabled=true",
                                      "checkpoint.interval=5", "checkpoint.keep_latest_k=1",
                                      f"checkpoint.async={asy}", "training.log_interval=50"],
                                when=checkpoints_done(1), sig=signal.SIGTERM, victim=1,
                                expect_exit=143, after=self.resumable)))
        trials = self.sample(trials, 4)
        print(f"ranks: {len(trials)} runs with a rank killed, stopped or preempted", flush=True)
        for name, kw in trials:
            self.add(self.fault(name, **kw))

    # ---- numerical faults ---------------------------------------------------------------------
    def numeric(self):
        # (name, sets, env): diverging runs must stop; one non-finite step between finite ones
        # (FSDP_TEST_NONFINITE=R@S: rank R's loss is NaN in step S) must stop with on_nonfinite:
        # stop and train on with skip, through offload's overlapped and delayed host steps too.
        one_nan = {"FSDP_TEST_NONFINITE": "0@3"}
        bf16_kept_last = ["training.mixed_precision=bf16", "training.grad_accum_steps=2",
                          "parallelism.reshard_between_micro_batches=false",
                          "training.grad_sync=last"]
        skip = ["training.on_nonfinite=skip"]
        cases = [("lr 1e12, stop", ["optimizer.lr=1e12"], None),
                 ("lr 1e12, skip", ["optimizer.lr=1e12"] + skip, None),
                 ("lr 1e12, async saves", ["optimizer.lr=1e12", "checkpoint.async=true"], None),
                 ("lr 1e12, bf16", ["optimizer.lr=1e12", "training.mixed_precision=bf16"], None),
                 ("NaN at step 3, stop, offload params",
                  ["parallelism.offload=params", "checkpoint.async=true"], one_nan),
                 ("NaN at step 3, stop, offload params delayed update, async saves",
                  ["parallelism.offload=params", "parallelism.offload_delayed_update=on",
                   "checkpoint.async=true"] + bf16_kept_last, one_nan),
                 ("NaN at step 3, skip, offload params", ["parallelism.offload=params"] + skip,
                  one_nan),
                 ("NaN at step 3, skip, offload params bf16 kept + last, async saves",
                  ["parallelism.offload=params", "checkpoint.async=true"] + bf16_kept_last + skip,
                  one_nan),
                 ("NaN at step 3, skip, offload params delayed update",
                  ["parallelism.offload=params", "parallelism.offload_delayed_update=on"]
                  + bf16_kept_last + skip, one_nan),
                 ("NaN at step 3 on rank 1 of 2, skip, offload optimizer delayed update",
                  ["parallelism.offload=optimizer", "parallelism.offload_delayed_update=on",
                   "parallelism.nproc=2"] + skip, {"FSDP_TEST_NONFINITE": "1@3"})]
        print(f"numeric: {len(cases)} runs with non-finite steps, saving every step", flush=True)
        for name, sets, env in cases:
            d = self.fresh("num")
            one_step = env is not None and "training.on_nonfinite=skip" in sets
            code, out, secs = self.train(d, ["training.steps=20", "training.log_interval=1",
                                             "checkpoint.enabled=true", "checkpoint.interval=1",
                                             "checkpoint.keep_latest_k=2"] + sets, timeout=120,
                                         env=env)
            outcome, detail = classify(code, out, ["non-finite", "nan", "NaN", "diverged"],
                                       "accept" if one_step else "refuse")
            ck = os.path.join(d, "checkpoints")
            bad = []
            for s in sorted(os.listdir(ck)) if os.path.isdir(ck) else []:
                if not re.fullmatch(r"step_\d+", s):
                    continue
                vcode, vout, _ = run([self.fsdp, "checkpoint", "inspect", os.path.join(ck, s),
                                      "--verify"], 60)
                if vcode != 0:
                    bad.append(s)
            recorded = []  # the step records (a save adds its own record of the same step)
            if os.path.exists(os.path.join(d, "metrics.jsonl")):
                for line in open(os.path.join(d, "metrics.jsonl")):
                    r = json.loads(line) if line.strip() else {}
                    if "loss" in r:
                        recorded.append(r["step"])
            seen = losses(d)
            if bad:
                outcome, detail = "silent", f"non-finite or broken checkpoints kept: {bad}"
            elif len(recorded) != len(set(recorded)):
                outcome, detail = "silent", "metrics.jsonl repeats a step"
            elif one_step and outcome == "ok" and (
                    sorted(seen) != list(range(1, 21)) or seen[3] is not None or
                    any(v is None or not math.isfinite(v) for k, v in seen.items() if k != 3)):
                outcome, detail = "silent", f"not one skipped step 3 among finite ones: {seen}"
            shutil.rmtree(d, ignore_errors=True)
            self.add(Trial("numeric", name, outcome, detail, code, secs))

    # ---- environment --------------------------------------------------------------------------
    def environment(self):
        cfg = os.path.join(ROOT, "configs/default.yaml")
        base = [self.fsdp, "train", cfg, "--quiet", "--set", "training.steps=1", "--set",
                "parallelism.nproc=1", "--set", "metrics.progress_bar=off"]
        cases = [
            ("RANK beyond WORLD_SIZE", {"RANK": "5", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
             ["RANK", "WORLD_SIZE"]),
            ("WORLD_SIZE not a number", {"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0",
                                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
             ["WORLD_SIZE"]),
            ("MASTER_PORT out of range", {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"},
             ["MASTER_PORT"]),
            ("MASTER_ADDR unresolvable", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                          "MASTER_ADDR": "no-such-host.invalid",
                                          "MASTER_PORT": "29999",
                                          "FSDP_RENDEZVOUS_TIMEOUT_S": "5"},
             ["no-such-host.invalid"]),
            ("rendezvous nobody joins", {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29998",
                                         "FSDP_RENDEZVOUS_TIMEOUT_S": "5"},
             ["127.0.0.1", "rendezvous"]),
            ("LOCAL_RANK negative", {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1",
                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
             ["LOCAL_RANK"]),
            ("collective timeout not a number", {"FSDP_COLLECTIVE_TIMEOUT_S": "soon"},
             ["FSDP_COLLECTIVE_TIMEOUT_S"]),
        ]
        print(f"environment: {len(cases) + 4} runs", flush=True)
        for name, env, names in cases:
            d = self.fresh("env")
            code, out, secs = run(base + ["--set", f"run.dir={d}"], 60, env)
            outcome, detail = classify(code, out, names, "refuse")
            self.add(Trial("environment", name, outcome, detail, code, secs))
            shutil.rmtree(d, ignore_errors=True)
        # An unwritable run.dir, /dev/full for metrics, two runs in one run.dir, nproc absurd.
        d = self.fresh("env")
        os.makedirs(d)
        os.chmod(d, 0o500)
        code, out, secs = run(base + ["--set", f"run.dir={d}/run"], 60)
        os.chmod(d, 0o700)
        self.add(Trial("environment", "unwritable run.dir",
                       *classify(code, out, [d], "refuse") if os.geteuid() != 0 else
                       ("ok", "skipped: root can write anywhere"), code, secs))
        code, out, secs = run(base + ["--set", "run.dir=/dev/full"], 60)
        self.add(Trial("environment", "run.dir is /dev/full", *classify(code, out, ["/dev/full"],
                                                                         "refuse"), code, secs))
        code, out, secs = run(base + ["--set", "parallelism.nproc=100000", "--set",
                                      f"run.dir={self.fresh('env')}"], 60)
        self.add(Trial("environment", "nproc 100000", *classify(code, out, ["nproc"], "refuse"),
                       code, secs))
        d = self.fresh("env")
        first = subprocess.Popen(base[:4] + ["--set", "training.steps=300", "--set",
                                              "parallelism.nproc=1", "--set", f"run.dir={d}"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 env=dict(os.environ, CUDA_VISIBLE_DEVICES="-1"),
                                 start_new_session=True)
        for _ in range(200):
            if os.path.exists(os.path.join(d, ".fsdp.lock")):
                break
            time.sleep(0.05)
        code, out, secs = run(base + ["--set", f"run.dir={d}"], 60)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        self.add(Trial("environment", "second run in a busy run.dir",
                       *classify(code, out, [".fsdp.lock", d], "refuse"), code, secs))
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--category", default="all",
                    help="all, or a comma list of: config, checkpoint, safetensors, ranks, "
                         "numeric, environment")
    ap.add_argument("--quick", action="store_true", help="a few trials per category")
    ap.add_argument("--jobs", type=int, default=2, help="one-rank trials run side by side")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "redteam"))
    ap.add_argument("--fsdp", default=os.path.join(ROOT, "build", "bin", "fsdp"))
    args = ap.parse_args()
    if not os.access(args.fsdp, os.X_OK):
        sys.exit(f"redteam: no fsdp binary at {args.fsdp} (make build, or --fsdp PATH)")
    order = ["config", "checkpoint", "safetensors", "ranks", "numeric", "environment"]
    wanted = order if args.category == "all" else args.category.split(",")
    unknown = [c for c in wanted if c not in order]
    if unknown:
        sys.exit(f"redteam: unknown category {unknown}; valid: {', '.join(order)}")
    h = Harness(args)
    start = time.time()
    for c in order:
        if c in wanted:
            getattr(h, {"config": "configs", "checkpoint": "checkpoints", "ranks": "ranks"}.get(
                c, c))()
    outcomes = ["handled", "ok", "unnamed", "silent", "crash", "hang", "blamed"]
    print(f"\n{'category':<12} {'trials':>6} " + " ".join(f"{o:>8}" for o in outcomes))
    rows = {}
    for c in order:
        ts = [t for t in h.trials if t.category == c]
        if not ts:
            continue
        counts = [sum(t.outcome == o for t in ts) for o in outcomes]
        rows[c] = dict(zip(outcomes, counts), trials=len(ts))
        print(f"{c:<12} {len(ts):>6} " + " ".join(f"{n:>8}" for n in counts))
    total = [sum(t.outcome == o for t in h.trials) for o in outcomes]
    print(f"{'all':<12} {len(h.trials):>6} " + " ".join(f"{n:>8}" for n in total))
    elapsed = time.time() - start
    print(f"{elapsed:.0f} s; every trial in {os.path.join(args.out, 'redteam.json')}")
    json.dump({"fsdp": args.fsdp, "seconds": elapsed, "summary": rows,
               "trials": [t.to_json() for t in h.trials]},
              open(os.path.join(args.out, "redteam.json"), "w"), indent=1)
    shutil.rmtree(h.work, ignore_errors=True)
    return 1 if any(t.outcome in BAD for t in h.trials) else 0


if __name__ == "__main__":
    sys.exit(main())
