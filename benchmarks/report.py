"""Writes the performance page, docs/performance.md, and its plots, docs/img/performance/*.png,
from the results files in benchmarks/results/ (one per benchmark and machine).

    python benchmarks/report.py            # regenerate the page and the plots
    python benchmarks/report.py --check    # exit 1 when the committed page or plots differ
    python benchmarks/report.py --out DIR  # write DIR/performance.md and DIR/img/performance/

The page states what the files hold and says so where a figure is missing. The plots are
drawn with matplotlib's Agg backend at a fixed size and resolution, with no date or software
in their metadata; each PNG carries the data it plots as JSON in its "Description" text
chunk, which ``--check`` compares (the markdown byte for byte).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
IMG = "img/performance"                    # relative to docs/
FIGSIZE, DPI = (7.5, 3.4), 100

MACHINES = {
    2: "the development VM: x86_64, 2 cores, 24 GiB",
    16: "a lent GPU machine's 16 CPU cores (Intel Xeon, one NUMA node), CPU replicas",
}
COLORS = {"AllReduce": "C0", "Gossip": "C1", "Downpour": "C2", "Boosting": "C3"}
STRATEGIES = (("allreduce", "AllReduce"), ("gossip", "Gossip"), ("downpour", "Downpour"),
              ("boosting", "Boosting"))


# --- reading -----------------------------------------------------------------------------

def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def command(doc: dict | None, default: str) -> str:
    """The command a results file records (its --out dropped: the file is named beside it),
    or the benchmark's documented one."""
    cmd = (doc or {}).get("command") if isinstance(doc, dict) else None
    if not isinstance(cmd, str) or not cmd.startswith("benchmarks/"):
        return default
    words, out = cmd.split(), []
    skip = False
    for w in words:
        if skip:
            skip = False
            continue
        if w == "--out":
            skip = True
            continue
        out.append(w)
    return "python " + " ".join(out)


def machine(doc: dict | None, cpus: int | None = None) -> str:
    """The machine a results file ran on, in words (its cores; torch when recorded)."""
    doc = doc or {}
    n = cpus or doc.get("cpus")
    text = MACHINES.get(n, f"{n} cores")
    return f"{text}, torch {doc['torch']}" if doc.get("torch") else text


# --- formatting --------------------------------------------------------------------------

def n0(x) -> str:
    return "–" if x is None else f"{round(x):,}"


def r2(x, suffix: str = "×") -> str:
    return "–" if x is None else f"{x:.2f}{suffix}"


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"


def secs(x) -> str:
    return "never" if x is None else f"{x:.2f} s"


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def table(head: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    align = align or "l" + "r" * (len(head) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    return ["| " + " | ".join(head) + " |", "| " + " | ".join(sep) + " |",
            *["| " + " | ".join(r) + " |" for r in rows], ""]


def source(name: str, doc: dict | None, default_cmd: str, cpus: int | None = None) -> str:
    at = (doc or {}).get("spark_dl_commit")
    return (f"Command: `{command(doc, default_cmd)}`. Machine: {machine(doc, cpus)}"
            + (f"; spark_dl as at {at}" if at else "")
            + f". Results file: `benchmarks/results/{name}`.")


def missing(name: str, what: str) -> str:
    return f"Not measured: `benchmarks/results/{name}` is missing ({what})."


def opened(p: Page, name: str, title: str, what: str) -> dict | None:
    """A section's heading and its results file; None (the page says what is missing) when
    the file is not there."""
    p.section(title)
    doc = load(name)
    if doc is None:
        p.add(missing(name, what))
    return doc


# --- the page ----------------------------------------------------------------------------

class Page:
    def __init__(self):
        self.lines: list[str] = []
        self.figures: dict[str, dict] = {}
        self.glance: list[list[str]] = []
        self.heading = ""

    def add(self, *items):
        """Paragraphs (strings, each followed by a blank line) and tables (lists of lines)."""
        for it in items:
            self.lines.extend(it if isinstance(it, list) else [it, ""])

    def section(self, title: str):
        self.heading = title
        self.add(f"## {title}")

    def at_a_glance(self, what: str, against: str, result: str, where: str):
        link = f"[{self.heading.replace('`', '').split(':')[0]}](#{slug(self.heading)})"
        self.glance.append([what, against, result, where, link])

    def figure(self, name: str, spec: dict, alt: str):
        self.figures[name] = spec
        self.add(f"![{alt}]({IMG}/{name}.png)")


# --- the sections ------------------------------------------------------------------------

def allreduce(p: Page):
    name = "allreduce.json"
    doc = opened(p, name, "Training with `fit`: AllReduce against plain PyTorch and TorchDistributor", "bench_allreduce.py")
    if doc is None:
        return
    p.add(f"The thesis CNN and FC net on the first {doc['rows']:,} shipped digits, SGD, "
          f"{doc['epochs']} epochs, 2 replicas of 1 thread on `local[2]`; TorchDistributor runs "
          "DDP (gloo) with 2 processes of 1 thread on the same session; plain PyTorch is one "
          "process over an in-memory tensor. Steady samples/s: epochs 2 on, medians of "
          f"{doc['repeats']} interleaved runs. The limit of 2 replicas is twice plain PyTorch "
          "with 1 thread.")
    rows = []
    for c in doc["configs"]:
        s, w = c["steady_samples_per_s"], c["fit_wall_s"]
        model = "FC 784-480-160-10" if c["model"] == "fc" else "thesis CNN"
        walls = f"{w['spark_dl']:.1f} s / {w['torchdist']:.1f} s"
        rows.append([f"{model}, batch {c['batch_per_replica']}", n0(s["plain-1t"]),
                     n0(s["plain-2t"]), f"**{n0(s['spark_dl'])}**", n0(s["torchdist"]),
                     r2(c["spark_dl_vs_limit"], ""), r2(c["spark_dl_vs_torchdist_steady"]),
                     walls, c["torchdist_runs_ok"]])
        if c["model"] == "cnn" and c["batch_per_replica"] == 16:
            result = (f"{r2(c['spark_dl_vs_torchdist_steady'])} the samples/s, "
                      f"{r2(c['spark_dl_vs_torchdist_wall'])} the wall time")
            p.at_a_glance("`fit`, AllReduce, 2 replicas", "TorchDistributor (DDP, gloo)",
                          result, "2 cores")
    p.add(table(["model, batch a replica", "plain, 1 thread", "plain, 2 threads",
                 "spark_dl, 2 × 1", "TorchDistributor, 2 × 1", "spark_dl of the limit",
                 "spark_dl / TorchDistributor", "wall time of a fit, spark_dl / TorchDistributor",
                 "TorchDistributor runs that finished"], rows))
    p.add(source(name, doc, "python benchmarks/bench_allreduce.py --repeats 5"))


def step_cost(p: Page):
    p.section("A step against N processes that do not communicate")
    p.add("Where a DDP step's time goes with N processes of one thread (the thesis CNN at "
          "batch 16, the same batch every step): one process alone, N processes that never "
          "communicate (what sharing the machine costs by itself: the ceiling of any "
          "launcher), and each way of averaging the gradients; the slowest rank's ms a step, "
          "medians of interleaved runs. \"Of the limit\" is one process's step over the "
          "setup's: N × one process's samples/s is the limit.")
    labels = {"one": "one process (the calibration)",
              "nocomm": "N processes, no communication",
              "ddp": "DDP, gloo's all-reduce (TorchDistributor's path)",
              "flat-gloo": "the flat gradient through gloo",
              "ddp-shm": "DDP with spark_dl's shared-memory hook",
              "flat-shm": "the flat gradient through shared memory (fit's AllReduce)",
              "run-fixed": "the hook's loop inside `spark_dl.run`, a fixed batch",
              "run-ctx": "the same with the context's batches"}
    docs = [(n, load(n)) for n in ("ddp-step-cost.json", "ddp-step-cost-16.json")]
    cols = [(n, d) for n, d in docs if d is not None]
    for n, d in docs:
        if d is None:
            p.add(missing(n, "ddp_step_cost.py"))
    if not cols:
        return
    rows = []
    for k, lab in labels.items():
        cells = []
        for _, d in cols:
            v, one = d["summary"].get(k), d["summary"]["one"]["ms_per_step"]
            cells += (["", ""] if v is None else
                      [f"{v['ms_per_step']:.2f}", r2(one / v["ms_per_step"], "")])
        rows.append([lab, *cells])
    head = ["setup"]
    for _, d in cols:
        head += [f"ms a step, N = {d['world']}", f"of the limit, N = {d['world']}"]
    p.add(table(head, rows))
    for n, d in cols:
        if d["world"] >= 16:
            s = d["summary"]
            one = s["one"]["ms_per_step"]
            result = (f"{r2(one / s['flat-shm']['ms_per_step'], '')} of the limit, where "
                      f"{d['world']} processes that never communicate get "
                      f"{r2(one / s['nocomm']['ms_per_step'], '')}")
            p.at_a_glance(f"fit's all-reduce step, {d['world']} processes",
                          f"{d['world']} processes that do not communicate", result,
                          f"{d['cpus']} cores")
        p.add(source(n, d, "python benchmarks/ddp_step_cost.py --repeats 5"))


def run_own_loop(p: Page):
    p.section("Your own DDP loop: `spark_dl.run` against TorchDistributor and Ray Train")
    p.add("One DDP function (the thesis CNN, SGD with momentum, batch 16 a process, 1 thread a "
          "process) under each launcher on `local[N]`; `comm_hook=\"shm\"` sends DDP's "
          "gradients through shared memory. Steady samples/s: epochs 2 on; wall: from the call "
          "with a DataFrame (the peers: files) to rank 0's model on the driver.")
    names = {"plain-1t": "plain PyTorch, 1 process, 1 thread",
             "torchdist": "TorchDistributor.run", "ray": "Ray Train on Ray-on-Spark",
             "spark_dl": "spark_dl.run", "spark_dl+hook": "spark_dl.run, `comm_hook=\"shm\"`"}
    short = {"torchdist": "TorchDistributor", "ray": "Ray Train", "spark_dl": "spark_dl.run",
             "spark_dl+hook": "spark_dl.run + shm hook"}
    groups = []
    for name, procs, cores in (("run.json", 2, 2), ("run-16.json", 16, 16)):
        doc = load(name)
        p.add(f"**{procs} processes, {cores} cores**")
        if doc is None:
            p.add(missing(name, "bench_run.py"))
            continue
        s = doc["summary"]
        rate, wall, frac = s["steady_samples_per_s"], s["wall_s"], s["fraction_of_limit"]
        rows = []
        for k, lab in names.items():
            if k not in rate:
                rows.append([lab, "not measured", "", ""])
                continue
            rows.append([lab, n0(rate[k]), "" if k == "plain-1t" else r2(frac.get(k), ""),
                         "–" if wall.get(k) is None else f"{wall[k]:.1f} s"])
        p.add(table(["launcher", "steady samples/s", "of the limit", "wall time"], rows))
        vs = (f"{r2(s['hook_vs_torchdist_steady'])} the samples/s, "
              f"{r2(s['hook_vs_torchdist_wall'])} the wall time")
        ray = ""
        if s.get("ray"):
            ray = (f"; against Ray Train: {r2(s['hook_vs_ray_steady'])} and "
                   f"{r2(s['hook_vs_ray_wall'])} (its cluster's start, "
                   f"{s['ray']['startup_s']:.0f} s, not counted)")
        p.add(f"`comm_hook=\"shm\"` against TorchDistributor: {vs}{ray}.")
        p.add(source(name, doc, "python benchmarks/bench_run.py --repeats 5"))
        groups.append({"label": f"{procs} processes, {cores} cores",
                       "bars": {lab: round(rate[k] / rate["plain-1t"], 3)
                                for k, lab in short.items() if k in rate}})
        against = "TorchDistributor.run" + (", Ray Train" if s.get("ray") else "")
        result = vs + (f" (Ray Train: {r2(s['hook_vs_ray_steady'])}, "
                       f"{r2(s['hook_vs_ray_wall'])})" if s.get("ray") else "")
        p.at_a_glance(f"`spark_dl.run` with the shm hook, {procs} processes", against, result,
                      f"{cores} cores")
    if groups:
        p.figure("peers", {"kind": "bars", "title": "Steady samples/s over one plain process",
                           "ylabel": "× plain PyTorch, 1 process", "groups": groups,
                           "hline": 1.0},
                 "Steady samples/s of each launcher over one plain PyTorch process")


WORKLOAD_SYSTEMS = {
    "plain": "plain PyTorch, one process, all threads",
    "ceiling": "the ceiling: N one-thread processes at once, never communicating",
    "allreduce-1": "`fit`, AllReduce, 1 replica",
    "allreduce": "`fit`, AllReduce", "downpour": "`fit`, Downpour", "gossip": "`fit`, Gossip",
    "localsgd": "`fit`, LocalSGD", "run": "`spark_dl.run`, DDP",
    "run+hook": "`spark_dl.run`, DDP with `comm_hook=\"shm\"`",
    "torchdist": "TorchDistributor, the same DDP function",
}


WORKLOAD_TITLES = {"resnet18": "ResNet-18", "transformer": "Transformer"}


def workloads(p: Page):
    name = "workloads.json"
    doc = opened(p, name, "The models users bring: ResNet-18 and a transformer",
                 "bench_workloads.py")
    if doc is None:
        return
    n, cfg = doc["replicas"], doc["configs"]
    r, t = cfg.get("resnet18", {}), cfg.get("transformer", {})
    params = doc.get("parameters", {})
    p.add(f"N = {n} replicas or processes of one thread on `local[{n}]`, {doc['epochs']} "
          f"epochs, samples/s of the epochs after the first, medians of "
          f"{doc['repeats_done']} interleaved repeats. The ceiling is what the machine does "
          "with N processes that never communicate, each on its own rows, measured in the "
          "same repeat: every ratio below is against it. Plain PyTorch runs one process "
          "with N threads. Wall time: from the DataFrame to the returned model. Outside the "
          "epochs: a fit's wall time less its epochs' seconds (where it went: the raw "
          "runs' `info[\"phases\"]`).")
    models = []
    if r:
        models.append(f"ResNet-18 (CIFAR-style, width {r['width']}, "
                      f"{params.get('resnet18', 0) / 1e6:.1f}M parameters, BatchNorm) on "
                      f"{doc['rows']['resnet18']:,} distorted digits padded to 32×32, stored as "
                      f"uint8 Parquet, batch {r['batch']}, SGD")
    if t:
        models.append(f"a decoder-only transformer ({t['layers']} layers, width {t['width']}, "
                      f"{t['heads']} heads, context {t['context']}, "
                      f"{params.get('transformer', 0) / 1e6:.1f}M parameters) on "
                      f"{doc['rows']['transformer']:,} windows of tinyshakespeare's characters "
                      f"as integer token ids, batch {t['batch']}, Adam, "
                      "`loss=\"sequence_cross_entropy\"`")
    p.add("Workloads: " + "; ".join(models) + ".")
    if doc.get("label"):
        p.add(f"Run: {doc['label']}.")
    entries = doc["summary"]["entries"]
    for w, title in WORKLOAD_TITLES.items():
        mine = [e for e in entries if e["workload"] == w]
        if not mine:
            continue
        rows = []
        for e in mine:
            out, frac = e.get("outside_epochs_s"), e.get("outside_epochs_fraction")
            outside = "–" if out is None else f"{out:.1f} s" + (
                "" if frac is None else f" ({100 * frac:.0f}%)")
            rows.append([WORKLOAD_SYSTEMS.get(e["system"], e["system"]), n0(e["samples_per_s"]),
                         r2(e["ratio_to_ceiling"], ""),
                         "–" if e.get("wall_s") is None else f"{e['wall_s']:.1f} s",
                         outside, e["runs_ok"]])
            if e["system"] == "allreduce":
                p.at_a_glance(f"`fit`, AllReduce, {n} replicas, {title}",
                              "the ceiling (N processes that never communicate)",
                              f"{r2(e['ratio_to_ceiling'], '')} of its samples/s",
                              f"{doc.get('cpus')} cores")
        p.add(f"**{title}**")
        p.add(table(["system", "samples/s", "of the ceiling", "wall time", "outside the epochs",
                     "runs that finished"], rows))
    p.add(source(name, doc, "python benchmarks/bench_workloads.py"))


# the latest run that timed each workload to its target (a run of its own may train longer)
TARGET_RUNS = {"resnet18": "workloads-small.json", "transformer": "workloads-small-transformer.json"}


def workloads_target(p: Page):
    p.section("The models users bring: time to a target")
    p.add("The workloads above at a size this machine trains in minutes, validated every "
          "quarter epoch on the held-out rows (validation's time kept out of the clock). Time "
          "to the target: the training seconds until the held-out accuracy first reaches it "
          "(ResNet) or the held-out loss first falls to it, in nats per character "
          "(transformer); medians of interleaved repeats, one seed each. One replica runs one "
          "thread, as each of N replicas does.")
    rows, sources = [], []
    for w, name in TARGET_RUNS.items():
        doc = load(name)
        if doc is None:
            p.add(missing(name, f"bench_workloads.py --size small --workloads {w}"))
            continue
        n, cfg, entries = doc["replicas"], doc["configs"][w], doc["summary"]["entries"]
        ratio = doc["summary"].get("allreduce_time_to_target_vs_one_replica", {}).get(w)
        size = (f"width {cfg['width']}, {doc['rows'][w]:,} rows" if w == "resnet18" else
                f"{cfg['layers']} layers, width {cfg['width']}, context {cfg['context']}, "
                f"{doc['rows'][w]:,} windows")
        one = next((e for e in entries if (e["workload"], e["system"]) == (w, "allreduce-1")),
                   {})
        for e in entries:
            if e["workload"] != w or e["system"] not in ("allreduce-1", "allreduce"):
                continue
            ttt = e.get("time_to_target_s")
            many = e["system"] == "allreduce"
            rate = e["samples_per_s"] / one["samples_per_s"] \
                if many and one.get("samples_per_s") else None
            rows.append([f"{WORKLOAD_TITLES[w]} ({size}), {doc['epochs']} epochs",
                         str(n) if many else "1", n0(e["samples_per_s"]),
                         r2(rate) if many else "", f"{e.get('target')}",
                         "–" if ttt is None else f"{ttt:.1f} s", e.get("reached", "–"),
                         r2(ratio) if many else ""])
        if ratio is not None:
            p.at_a_glance(f"`fit`, AllReduce, {n} replicas, {WORKLOAD_TITLES[w]}: time to the "
                          "target", "one replica's", r2(ratio), f"{doc.get('cpus')} cores")
        sources.append(f"{WORKLOAD_TITLES[w]}: " + source(name, doc, "python benchmarks/"
                                                               "bench_workloads.py --size small"))
    if rows:
        p.add(table(["workload", "replicas", "samples/s", "samples/s over one", "target",
                     "time to the target", "runs that reached it", "time over one"], rows,
                    "lrrrrrrr"))
        p.add("Where N replicas' time over one is above one over their samples/s over one, "
              "they need more samples to reach the target than one replica: a global batch "
              "N times one replica's.")
    for line in sources:
        p.add(line)


def scaling(p: Page):
    p.section("Scaling: samples/s and time to accuracy against replicas")
    p.add("The thesis CNN on the demo's 48,000 distorted digits, validated on 2,000 held-out "
          "real digits every quarter epoch; SGD at lr 0.02 for one replica's batch of 16, "
          "momentum 0.9, halved every epoch, `lr_scaling=\"auto\"`; every strategy with its "
          "defaults, one thread a replica, interleaved, one seed a repeat shared by every "
          "system. Time to 98% is the training time to the first validation at or above it "
          "(the median over the seeds that reached it); × one replica is the ratio of the "
          "medians (\"same seed\": the median of the seed-by-seed ratios; Gossip's one-replica "
          "reference is AllReduce's). The limit of R replicas is R × plain PyTorch's "
          "samples/s; the ceiling is what the machine does with R one-thread processes that "
          "never communicate, measured in the same run (\"–\": a run without it). With validations a quarter epoch apart, a seed that needs a quarter "
          "epoch more moves a 6-seed median: read the ratios of one run, not their third digit.")
    panels_rate, panels_time = [], []
    for name, cores in (("scaling.json", 2), ("scaling-16.json", 16)):
        doc = load(name)
        p.add(f"**{cores} cores**")
        if doc is None:
            p.add(missing(name, "bench_scaling.py"))
            continue
        s = doc["summary"]
        top = max(v["replicas"] for v in s.values())
        plain = s["plain-1t"]
        rows = [["plain PyTorch, 1 thread", "1", secs(plain["time_to_target_s"]),
                 plain["reached"], "", n0(plain["samples_per_s"]), "1.00", "1.00",
                 pct(plain["final_accuracy"])]]
        ceil = s.get(f"ceiling-{top}")
        if ceil:
            rows.append([f"the ceiling: {top} processes that never communicate", str(top),
                         "", "", "", n0(ceil["samples_per_s"]),
                         r2(ceil["fraction_of_limit"], ""), "1.00", ""])
        rate_lines, time_lines = [], []
        for key, label in STRATEGIES:
            one = s.get(f"{key}-1") or (s.get("allreduce-1") if key == "gossip" else None)
            many = s.get(f"{key}-{top}")
            if many is None:
                rows.append([label, str(top), "not measured", "", "", "", "", "", ""])
                continue
            if f"{key}-1" in s:
                o = s[f"{key}-1"]
                rows.append([label, "1", secs(o["time_to_target_s"]), o["reached"], "",
                             n0(o["samples_per_s"]), r2(o["fraction_of_limit"], ""),
                             r2(o.get("fraction_of_ceiling"), ""), pct(o["final_accuracy"])])
            ratio = many.get("time_vs_one_replica")
            same = many.get("time_vs_one_replica_same_seed")
            cell = f"**{r2(ratio)}** (same seed {r2(same)})" if ratio else "–"
            rows.append([label, str(top), secs(many["time_to_target_s"]), many["reached"],
                         cell, n0(many["samples_per_s"]), r2(many["fraction_of_limit"], ""),
                         r2(many.get("fraction_of_ceiling"), ""), pct(many["final_accuracy"])])
            rate_lines.append({"label": label, "x": [1, top],
                               "y": [one["samples_per_s"] if one else None,
                                     many["samples_per_s"]]})
            time_lines.append({"label": label, "x": [1, top],
                               "y": [one["time_to_target_s"] if one else None,
                                     many["time_to_target_s"]]})
            if key == "allreduce":
                result = (f"{r2(ratio)} the time to 98%, "
                          f"{r2(many['fraction_of_limit'], '')} of the limit"
                          + (f", {r2(many['fraction_of_ceiling'], '')} of the ceiling"
                             if many.get("fraction_of_ceiling") else ""))
                p.at_a_glance(f"`fit`, AllReduce, {top} replicas", "one replica", result,
                              f"{cores} cores")
        rate_lines.append({"label": "limit (R × plain PyTorch)", "x": [1, top],
                           "y": [plain["samples_per_s"], top * plain["samples_per_s"]],
                           "style": "dashed"})
        p.add(table(["strategy", "replicas", "time to 98%", "seeds that reached it",
                     "× one replica", "samples/s", "of the limit", "of the ceiling",
                     "final accuracy"], rows, "lrrrrrrrr"))
        p.add(f"Seeds {doc.get('seeds')}; {doc.get('epochs')} epochs; "
              f"`{doc.get('spark_master')}`.")
        p.add(source(name, doc, "python benchmarks/bench_scaling.py --repeats 3", cores))
        panels_rate.append({"title": f"{cores} cores", "lines": rate_lines})
        panels_time.append({"title": f"{cores} cores", "lines": time_lines})
    if panels_rate:
        p.figure("scaling-samples", {"kind": "lines", "title": "Steady samples/s",
                                     "xlabel": "replicas", "ylabel": "samples/s",
                                     "panels": panels_rate},
                 "Samples per second against replicas, with the limit")
        p.figure("scaling-time", {"kind": "lines", "title": "Training time to 98% held out",
                                  "xlabel": "replicas", "ylabel": "seconds",
                                  "panels": panels_time},
                 "Time to 98% accuracy against replicas")


def downpour(p: Page):
    name = "downpour.json"
    doc = opened(p, name, "Asynchronous SGD: Downpour against AllReduce and Elephas", "bench_downpour.py --elephas")
    if doc is None:
        return
    p.add(f"The thesis CNN on the first {doc['rows']:,} shipped digits (validation: the last "
          f"2,000), SGD lr 0.05, batch {doc['batch_per_replica']} a replica, {doc['epochs']} "
          f"epochs, 2 replicas of 1 thread on `local[2]`, medians of {doc['repeats']} "
          "interleaved runs. Elephas 7.3 (TensorFlow, in its own virtual environment) trains "
          "the same CNN in Keras in its asynchronous mode; it reports no epoch times, so its "
          "rate is the difference of a 1-epoch and a 5-epoch fit. This results file "
          f"({doc['date']}) predates Downpour's current staleness rule, averaged server and "
          "cap; the comparison with Elephas has not been run again since.")
    labels = {"plain-1t": "plain PyTorch, 1 thread", "allreduce": "AllReduce",
              "downpour-1-1": "Downpour, async, push and fetch every step",
              "downpour-1-1-ovl": "… with `overlap=True`",
              "downpour-4-4": "Downpour, every 4 steps, lr / 4",
              "downpour-sync": "Downpour, synchronous",
              "elephas-epoch": "Elephas, async, frequency \"epoch\" (its default)",
              "elephas-batch": "Elephas, async, frequency \"batch\""}
    rows = []
    s = doc["summary"]
    for k, lab in labels.items():
        v = s.get(k)
        if v is None:
            rows.append([lab, "not measured", "", "", ""])
            continue
        acc = v["val_accuracy_per_epoch_median"]
        last = str(max(int(e) for e in acc))
        t97 = v.get("time_to_97_s_median")
        rows.append([lab, n0(v["steady_samples_per_s"]), r2(v["vs_allreduce"], ""),
                     f"{pct(acc['1'])} / {pct(acc[last])}",
                     f"{t97:.2f} s ({v['runs_reaching_97']})" if t97
                     else f"never ({v['runs_reaching_97']})"])
    p.add(table(["system", "steady samples/s", "/ AllReduce",
                 "accuracy after epoch 1 / 5 (medians)", "time to 97%"], rows))
    d1 = s.get("downpour-1-1", {})
    if "vs_elephas-batch" in d1:
        result = (f"{r2(d1['vs_elephas-batch'])} the samples/s of its per-batch mode, "
                  f"{r2(d1['vs_elephas-epoch'])} of its default")
        p.at_a_glance("Downpour, 2 async replicas", "Elephas 7.3, async", result, "2 cores")
    p.add(source(name, doc, "python benchmarks/bench_downpour.py --repeats 5 --elephas"))


def parameter_server(p: Page):
    p.section("The parameter server: transport and pushes a second")
    name, doc = "ps.json", load("ps.json")
    if doc is None:
        p.add(missing(name, "bench_ps.py"))
    else:
        p.add(f"Push + pull round trip of a {doc['params']:,}-parameter model (2 × "
              f"{doc['params'] * 4 // 1_000_000} MB of float32) on loopback, one client, "
              f"medians of {doc['repeats']} interleaved runs; GB/s counts float32 bytes both "
              "ways (bfloat16: its float32-equivalent rate).")
        labels = {"socket": "plain socket (no framing, no checks)",
                  "ps-1shard": "parameter server, 1 shard",
                  "ps-4shards": "parameter server, 4 shards",
                  "ps-bf16": "parameter server, 1 shard, bfloat16 on the wire"}
        p.add(table(["system", "GB/s", "/ plain socket"],
                    [[lab, f"{doc['gb_per_s'][k]:.2f}", r2(doc["ratio_vs_socket"][k], "")]
                     for k, lab in labels.items() if k in doc["gb_per_s"]]))
        p.add(source(name, doc, "python benchmarks/bench_ps.py --repeats 3"))
    p.add("**Pushes a second against clients.** K client processes push the thesis CNN's "
          "gradient (4,414 values) and take the values back as fast as they can; the server "
          "has Downpour's settings for asynchronous replicas and runs in a process of its "
          "own. Demand: the pushes a second that 16 one-thread replicas would make (16 × "
          "plain PyTorch's steps a second on that machine).")
    panels, rows, sources = [], [], []
    for name, cores in (("ps-capacity.json", 2), ("ps-capacity-16.json", 16)):
        doc = load(name)
        if doc is None:
            sources.append(missing(name, "bench_ps_capacity.py"))
            continue
        s = doc["summary"]
        lines = []
        panels.append({"title": f"{cores} cores", "lines": lines,
                       "hlines": [{"label": "16 replicas' demand",
                                   "y": s["plain-1t"]["demand_16_replicas"]}]})
        for srv in sorted({k.split(" K=")[0] for k in s if " K=" in k and "/" not in k}):
            base = srv != "server@HEAD"
            if cores == 2:
                label = (f"a thread per connection ({srv.split('@')[1]})" if base
                         else "one event-loop thread")
            else:
                label = "a thread each below 8 clients, the loop from 8 (as shipped)"
            ks = sorted(int(k.split("K=")[1]) for k in s if k.startswith(srv + " K="))
            pts = [s[f"{srv} K={k}"] for k in ks]
            lines.append({"label": label, "x": ks, "y": [v["pushes_per_s"] for v in pts]})
            for k, v in zip(ks, pts):
                rows.append([f"{label}, {cores} cores", str(k), n0(v["pushes_per_s"]),
                             f"{v['server_cpu_us_per_push']:.0f} µs",
                             r2(v["of_16_replicas_demand"], "")])
            if cores == 16 and not base and 16 in ks:
                v = s[f"{srv} K=16"]
                result = (f"{n0(v['pushes_per_s'])} pushes/s, "
                          f"{r2(v['of_16_replicas_demand'])} the demand")
                p.at_a_glance("parameter server, 16 clients", "16 replicas' pushes", result,
                              "16 cores")
        sources.append(source(name, doc, "python benchmarks/bench_ps_capacity.py --clients "
                                         "1,4,16 --pushes 1500 --repeats 5", cores))
    if rows:
        p.add(table(["server", "clients", "pushes/s", "server CPU a push",
                     "of 16 replicas' demand"], rows))
        p.figure("ps-capacity", {"kind": "lines", "title": "Parameter server: pushes a second",
                                 "xlabel": "clients", "ylabel": "pushes/s",
                                 "panels": panels},
                 "The parameter server's pushes a second against clients")
    p.add(*sources)


def gossip(p: Page):
    name = "gossip.json"
    doc = opened(p, name, "Gossip (RD-PSGD) against AllReduce and D-PSGD", "bench_gossip.py")
    if doc is None:
        return
    p.add("The thesis CNN on 8,000 distorted digits, SGD lr 0.05, batch 16 a replica; "
          "final accuracy after equal epochs (medians over 5 seeds) and the bytes a replica "
          "sends a step (AllReduce: what a ring sends over a network, 2 (R − 1)/R × the "
          "gradient). Priced epoch: the cost model's time at 100 Mbit/s and 1 Gbit/s with "
          "100 µs latency (priced, not measured: there are no shaped links here).")
    labels = {"allreduce": "AllReduce", "dpsgd": "D-PSGD (`Gossip(alpha=1)`)",
              "rdpsgd-0.5": "RD-PSGD α 0.5", "rdpsgd-0.1": "RD-PSGD α 0.1",
              "rdpsgd-0.05": "RD-PSGD α 0.05", "plain-1t": "plain PyTorch, 1 thread"}
    rows = []
    for conf, run in doc.items():
        s = run["summary"]
        for k, lab in labels.items():
            if k not in s:
                continue
            v = s[k]
            priced = v.get("priced_epoch_s")
            rows.append([f"{conf}: {lab}", pct(v["val_accuracy_final_median"]),
                         n0(v.get("bytes_per_replica_per_step")),
                         n0(v.get("steady_samples_per_s")),
                         f"{priced['100Mbit']:.2f} / {priced['1Gbit']:.2f} s" if priced else ""])
    p.add(table(["configuration, system", "final accuracy", "bytes a replica a step",
                 "samples/s", "priced epoch, 100 Mbit / 1 Gbit"], rows))
    commands = "; ".join(f"`{command(run, '')}`" for run in doc.values())
    first = next(iter(doc.values()))
    p.add(f"Commands: {commands}. Machine: {machine(first)}. Results file: "
          f"`benchmarks/results/{name}`.")


def localsgd(p: Page):
    p.section("Local SGD and DiLoCo against AllReduce")
    docs = [(n, load(n)) for n in ("localsgd.json", "localsgd-seeds1-2.json")]
    docs = [(n, d) for n, d in docs if d is not None]
    if not docs:
        p.add(missing("localsgd.json", "bench_localsgd.py"))
        return
    d0 = docs[0][1]
    p.add(f"The thesis CNN on the demo's {d0['samples']:,} distorted digits, "
          f"{d0['replicas']} replicas, {d0['epochs']} epoch, batch {d0['batch']}, "
          f"lr {d0['lr']}; AllReduce validates its last weights (`average=0`). The bytes a "
          "replica sends per sample it trains on, and the held-out accuracy at the end.")
    runs: dict[str, list] = {}
    for _, d in docs:
        for r in d["raw"]["runs"]:
            runs.setdefault(r["system"], []).append(r)
    labels = {"allreduce": "AllReduce (every step)", "localsgd-8": "LocalSGD, every 8 steps",
              "localsgd-32": "LocalSGD, every 32 steps",
              "diloco-32": "DiLoCo, every 32 steps (outer lr 0.7, momentum 0.9)"}
    rows = []
    for k, lab in labels.items():
        rs = sorted(runs.get(k, []), key=lambda r: r["seed"])
        if rs:
            rows.append([lab, n0(rs[0]["bytes_per_sample"]),
                         pct(statistics.median(r["final_accuracy"] for r in rs)),
                         " / ".join(pct(r["final_accuracy"]) for r in rs)])
    seeds = sorted({r["seed"] for rs in runs.values() for r in rs})
    p.add(table(["system", "bytes a replica a sample", "final accuracy, median",
                 f"seeds {', '.join(map(str, seeds))}"], rows))
    p.add(*[source(n, d, "python benchmarks/bench_localsgd.py") for n, d in docs])


def balance(p: Page):
    name = "balance.json"
    doc = opened(p, name, "Heterogeneous replicas: the speed-proportional split", "bench_balance.py")
    if doc is None:
        return
    p.add(f"The thesis CNN, 2 replicas on `local[2]`, {doc['batch_per_replica']} rows a "
          f"replica a step, lr {doc['lr']} × {doc['lr_decay']} an epoch, {doc['epochs']} "
          "epochs; one replica made about 2× slower for real (a CPU-bound process on its "
          "core), for the whole fit (\"slowed\") or from its second epoch on (\"slowed "
          f"late\"; epochs 2 on). Medians of {doc['repeats']} seeds.")
    labels = {"unslowed/unbalanced": "no slowdown, `AllReduce()`",
              "slowed/unbalanced": "slowed, `AllReduce()`",
              "slowed/speed": "slowed, `balance=\"speed\"`",
              "slowed/speed-wrap": "slowed, `balance=\"speed\", balance_rows=\"wrap\"`",
              "slowed/adaptive": "slowed, `balance=\"adaptive\"`",
              "slowed-late/unbalanced": "slowed late, `AllReduce()`",
              "slowed-late/speed": "slowed late, `balance=\"speed\"`",
              "slowed-late/adaptive": "slowed late, `balance=\"adaptive\"`"}
    s = doc["summary"]
    rows = []
    for k, lab in labels.items():
        v = s.get(k)
        if v is None:
            continue
        split = v.get("split_per_epoch_median")
        moved = f"{split[0][0]} : {split[0][1]} → {split[-1][0]} : {split[-1][1]}" \
            if split else ""
        rows.append([lab, f"{v['epoch_s_median']:.2f} s",
                     r2(v["epoch_time_vs_unbalanced"], "") if "epoch_time_vs_unbalanced" in v
                     else "", moved, pct(v["val_accuracy_final_median"])])
    p.add(table(["scenario, system", "epoch", "/ unbalanced", "split, first → last epoch",
                 "final accuracy"], rows))
    p.add(source(name, doc, "python benchmarks/bench_balance.py --repeats 5"))


def amp(p: Page):
    name = "amp.json"
    doc = opened(p, name, "Mixed precision (bf16) on the CPU", "bench_amp.py")
    if doc is None:
        return
    p.add(f"`amp=\"bf16\"` against float32, 2 replicas on `local[2]`, {doc['rows']:,} "
          f"distorted digits, batch {doc['batch']}, {doc['epochs']} epochs, medians of "
          f"{doc['repeats']} seeds. This CPU has no bf16 matrix units; the GPU's figures are "
          f"under [GPU executors](#{slug('GPU executors')}).")
    labels = {"allreduce": "AllReduce, thesis CNN", "downpour": "Downpour, thesis CNN",
              "mp-fc": "`Downpour(partitions=2)`, FC 784-480-160-10"}
    s = doc["summary"]
    rows = []
    for k, lab in labels.items():
        a, b = s.get(f"{k}/fp32"), s.get(f"{k}/bf16")
        if a is None or b is None:
            continue
        rows.append([lab, pct(a["val_accuracy_final_median"]),
                     pct(b["val_accuracy_final_median"]), r2(b.get("speed_vs_fp32"), ""),
                     r2(b["ps_bytes_vs_fp32"], "") if b.get("ps_bytes_vs_fp32") else ""])
    p.add(table(["engine", "float32 accuracy", "bf16 accuracy", "bf16 speed / float32",
                 "server bytes, bf16 / float32"], rows))
    p.add(source(name, doc, "python benchmarks/bench_amp.py --repeats 5"))


def model_parallel(p: Page):
    name = "model_parallel.json"
    doc = opened(p, name, "Model parallelism: measured against the cost model", "bench_model_parallel.py")
    if doc is None:
        return
    p.add(f"A training step (batch {doc['batch']}, float32) of nets split by columns over 2 "
          "processes of 1 thread (gloo on loopback), against plain PyTorch with 1 and 2 "
          "threads; \"predicted\": the 1-thread step / 2 plus the counted messages and bytes "
          "priced with the link the run probed; \"planner\": what `partitions=\"auto\"` "
          f"predicts. Medians of {doc['repeats']} interleaved runs.")
    rows = []
    for net, v in doc["nets"].items():
        s = v["summary"]
        c, t = s.get("collective-F2", {}), s.get("thesis-F2")
        counted = (f"{c.get('messages_per_step', 0):.0f} / "
                   f"{c.get('bytes_per_step', 0) / 1e6:.2f} MB")
        rows.append([{"cnn": "thesis CNN", "ssda": "SSDA 256-1280-1280-256"}.get(net, net),
                     f"{s['plain-1t']['step_ms']:.1f}", f"{s['plain-2t']['step_ms']:.1f}",
                     f"{c.get('step_ms', 0):.1f}", f"{c.get('predicted_ms', 0):.1f}",
                     f"{c.get('predicted_planner_ms', 0):.1f}",
                     f"{t['step_ms']:.1f}" if t else "–", counted])
    p.add(table(["net", "plain 1 thread (ms)", "plain 2 threads", "split F = 2",
                 "predicted", "planner", "thesis's master algorithm, F = 2",
                 "messages / bytes a step"], rows))
    p.add(source(name, doc, "python benchmarks/bench_model_parallel.py --repeats 5"))


def counting(p: Page):
    name = "counting.json"
    doc = opened(p, name, "A synchronous parameter server against ring all-reduce (MCNN)", "bench_counting.py")
    if doc is None:
        return
    p.add(f"MCNN (133,705 parameters) on {doc['scenes']} synthetic counting scenes of "
          f"{doc['size']}×{doc['size']}, batch {doc['batch_per_worker']} a worker, Adam, "
          f"{doc['epochs']} epochs; images/s of the last epoch, medians of {doc['repeats']}. "
          "4 workers run on `local-cluster[4,1,1024]`: 4 one-core executors on 2 cores.")
    labels = {"ps-sync": "`Downpour(mode=\"sync\")`", "ring": "ring all-reduce (gloo)",
              "allreduce-shm": "shared-memory all-reduce (the default on one host)"}
    rows = []
    for k, v in doc["summary"].items():
        kind, n = k.split(" x")
        rows.append([n, labels.get(kind, kind), n0(v["images_per_s"]),
                     n0(v["bytes_per_worker_step"]),
                     f"{v['communication_s']:.2f} / {v['other_s']:.2f} s"])
    p.add(table(["workers", "system", "images/s", "bytes a worker a step",
                 "communication / other, a worker"], rows, "llrrr"))
    p.add(source(name, doc, "python benchmarks/bench_counting.py --repeats 5"))


def data(p: Page):
    p.section("Data: generation, the Arrow bridge and streamed shards")
    name, doc = "data.json", load("data.json")
    if doc is None:
        p.add(missing(name, "bench_data.py"))
    else:
        g, st, tr = doc["generation"], doc["bridge_steady_state"], doc["bridge_with_training"]
        gen = (f"extended-MNIST generation, {g['samples']:,} digits, `{g['master']}` against "
               "one in-process core")
        rows = [[gen, n0(g["spark_2_executors_samples_per_s"]),
                 n0(g["in_process_1_core_samples_per_s"]), r2(g["ratio_spark_vs_1_core"], "")]]
        deliver = (f"the bridge's delivery per epoch, {st['rows']:,} rows, batch "
                   f"{st['batch_size']}, against a plain numpy loop")
        rows.append([deliver, n0(st["bridge_epoch_samples_per_s"]),
                     n0(st["plain_numpy_epoch_samples_per_s"]),
                     r2(st["ratio_bridge_vs_plain_per_epoch"], "")])
        for b in doc["bridge"]:
            fit = (f"a fit of {b['epochs']} epoch{'s' if b['epochs'] > 1 else ''}, the read "
                   "included, against torch's DataLoader")
            rows.append([fit, n0(b["bridge_samples_per_s"]),
                         n0(b["torch_dataloader_samples_per_s"]),
                         r2(b["ratio_bridge_vs_torch_dataloader"], "")])
        train = (f"the thesis CNN trained one epoch on {tr['rows']:,} rows, against the plain "
                 "loop")
        rows.append([train, n0(tr["bridge_samples_per_s"]),
                     n0(tr["plain_numpy_loop_samples_per_s"]),
                     r2(tr["ratio_bridge_vs_plain_numpy_loop"], "")])
        p.add(table(["what is timed", "spark_dl samples/s", "reference samples/s", "ratio"],
                    rows))
        p.add(f"The one-time read and check of a partition: "
              f"{st['read_seconds_per_partition']:.3f} s for {st['rows']:,} rows of 784 "
              "float32.")
        p.add(source(name, doc, "python benchmarks/bench_data.py --repeats 5"))
    name, doc = "stream.json", load("stream.json")
    if doc is None:
        p.add(missing(name, "bench_stream.py"))
        return
    t, sc, th, acc = doc["throughput"], doc["scaling"], doc["thesis_scale"], doc["accuracy"]
    rates = t["samples_per_s"]
    p.add(f"**Streamed shards** (data larger than memory). One epoch of the thesis CNN over "
          f"{t['rows']:,} digits: {n0(rates['stream'])} samples/s streamed from local disk, "
          f"{n0(rates['memory'])} in memory, {n0(rates['plain_pytorch'])} for plain PyTorch "
          f"({r2(t['ratio_stream_vs_plain'])}). Scaling: a fresh process spills N rows of 784 "
          f"uint8 pixels and trains one epoch of an {sc['model']} with a {sc['buffer']} "
          "buffer:")
    rows, xs, ep, rss = [], [], [], []
    for k, v in sc["median"].items():
        n = sc["base_rows"] * int(k.rstrip("x"))
        xs.append(n)
        ep.append(round(v["epoch_s"], 3))
        rss.append(round(v["peak_rss_mb"], 1))
        rows.append([k, n0(n), f"{v['spill_s']:.2f} s", f"{v['epoch_s']:.2f} s",
                     r2(sc["epoch_time_ratio"][k], ""), f"{v['peak_rss_mb']:.0f} MB"])
    xs.append(th["rows"])
    ep.append(round(th["epoch_s"], 3))
    rss.append(round(th["peak_rss_mb"], 1))
    rows.append([f"{th['factor']:.0f}x (the thesis's 8.1M digits)", n0(th["rows"]),
                 f"{th['spill_s']:.1f} s", f"{th['epoch_s']:.1f} s",
                 r2(th["epoch_time_ratio"], ""), f"{th['peak_rss_mb']:.0f} MB"])
    p.add(table(["data", "rows", "spill", "epoch", "epoch / 1x", "peak RSS"], rows))
    p.add(f"Accuracy after equal epochs ({acc['epochs']} epochs of {acc['rows']:,} digits, a "
          f"shuffle buffer of {acc['buffer_rows']:,} rows, {len(acc['seeds'])} seeds): "
          f"streamed {pct(acc['mean_accuracy']['stream'])}, a full in-memory shuffle "
          f"{pct(acc['mean_accuracy']['memory'])} (means).")
    p.figure("stream-memory", {"kind": "stream", "title": "Streamed shards",
                               "x": xs, "epoch_s": ep, "peak_rss_mb": rss},
             "Streamed shards: epoch time and peak memory against rows")
    result = (f"{r2(th['epoch_time_ratio_per_factor'])} the time a row, "
              f"{r2(th['peak_rss_ratio'])} the peak memory")
    p.at_a_glance(f"streamed shards, {th['factor']:.0f}× the data", "1× the data", result,
                  "2 cores")
    p.add(source(name, doc.get("machine"),
                 "python benchmarks/bench_stream.py --thesis-rows 8100000"))


def inference(p: Page):
    p.section("Batch inference: `TorchModel.transform` against a plain loop")
    rows, docs = [], []
    for name, where in (("inference.json", "`local[2]`, 2 tasks"),
                        ("inference-local-cluster.json", "2 executors of 1 core")):
        doc = load(name)
        if doc is None:
            p.add(missing(name, "bench_inference.py"))
            continue
        docs.append((name, doc))
        s = doc["summary"]
        rows.append([where, n0(s["plain-1t"]["samples_per_s"]),
                     n0(s["plain-2t"]["samples_per_s"]), n0(s["spark_dl"]["samples_per_s"]),
                     r2(s["spark_dl"]["vs_plain_1t"])])
        if "executors" in doc:
            p.at_a_glance("`TorchModel.transform`, 2 executors", "a plain loop, 1 thread",
                          f"{r2(s['spark_dl']['vs_plain_1t'])} the samples/s", "2 cores")
    if not docs:
        return
    d0 = docs[0][1]
    p.add(f"The thesis CNN predicts {d0['rows']:,} digits, batch {d0['batch']}, against the "
          "same model in a plain loop over the numpy array on the driver; medians of "
          f"{d0['repeats']}.")
    p.add(table(["spark_dl on", "plain, 1 thread", "plain, 2 threads", "spark_dl",
                 "spark_dl / plain 1 thread"], rows))
    cluster = " --master \"local-cluster[2,1,1024]\""
    p.add(*[source(n, d, "python benchmarks/bench_inference.py"
                   + (cluster if "executors" in d else "")) for n, d in docs])


def superres(p: Page):
    name = "superres.json"
    doc = opened(p, name, "Super-resolution stages and inference", "bench_superres.py")
    if doc is None:
        return
    p.add(f"One epoch over {doc['rows']:,} T91 patch pairs (σ = 20), Adam, global batch "
          f"{2 * doc['batch_per_replica']}: `fit` with 2 replicas on `{doc['master']}` against "
          "plain PyTorch on the same rows in one process; patch pairs a second in the last "
          f"epoch, medians of {doc['repeats']}. Inference: `super_resolve_folder` over "
          f"{doc['inference_images']} images, HR megapixels written a second.")
    s = doc["summary"]
    labels = {"ssda": "SSDA 1280-1280-256 fine-tuning", "cnn": "SRCNN (SSDA frozen)",
              "cascade": "the cascade end to end"}
    rows = [[lab, n0(s[k]["plain-1t"]["samples_per_s"]), n0(s[k]["plain-2t"]["samples_per_s"]),
             n0(s[k]["spark_dl"]["samples_per_s"]), r2(s[k]["spark_dl"]["vs_plain_2t"], "")]
            for k, lab in labels.items() if k in s]
    inf = s.get("inference_megapixels_per_s")
    if inf:
        rows.append(["inference, megapixels/s", f"{inf['plain-1t']['median']:.2f}",
                     f"{inf['plain-2t']['median']:.2f}", f"{inf['spark_dl']['median']:.2f}",
                     r2(inf["spark_dl"]["median"] / inf["plain-2t"]["median"], "")])
    p.add(table(["stage", "plain, 1 thread", "plain, 2 threads", "spark_dl, 2 executors",
                 "/ plain 2 threads"], rows))
    p.add(source(name, doc, "python benchmarks/bench_superres.py --rows 2048 --repeats 5"))


def gpu(p: Page):
    name = "gpu.json"
    doc = opened(p, name, "GPU executors", "gpu_check.sh on a GPU machine")
    if doc is None:
        return
    s = doc["summary"]
    p.add(f"Machine: {doc['machine']}; torch {doc['torch']}, `{doc['spark_master']}`. Plain "
          "PyTorch is a hand-written loop over a GPU tensor, run interleaved with the fits in "
          "the same process on the same rows, batch and optimizer; ratios of medians over 3 "
          "repeats.")
    rows, bars = [], {}
    names = {"allreduce": "AllReduce", "downpour": "Downpour (push overlapped)",
             "downpour-no-overlap": "`Downpour(overlap=False)`"}
    for net, v in s["one_replica_vs_plain"].items():
        for k, lab in names.items():
            if k in v:
                rows.append([f"one replica, {net}, batch 128", lab, r2(v[k])])
                bars[f"{lab.strip('`')}, {net}"] = v[k]
    for net, v in s["amp_vs_fp32_fit"].items():
        if "(" in net:                     # an earlier run's figure, kept in the file
            continue
        for k in ("bf16", "fp16"):
            rows.append([f"`amp=\"{k}\"` against float32, {net}", "AllReduce, one replica",
                         r2(v[k])])
            bars[f"{k} / float32, {net}"] = v[k]
    shared = s["two_replicas_share_the_gpu"]
    ran = sum(1 for v in shared.values() if v.startswith("ok"))
    rows.append(["two replicas on the one GPU", ", ".join(shared), f"{ran} of {len(shared)} ran"])
    rows.append(["char-LSTM on tinyshakespeare", s["char_lstm_best_config"],
                 f"{s['char_lstm_best_val_nats_per_char']:.3f} nats/char held out"])
    p.add(table(["case", "system", "result"], rows, "llr"))
    p.figure("gpu-ratios", {"kind": "hbars",
                            "title": "One GPU: × plain PyTorch on it, and × float32",
                            "bars": bars, "vline": 1.0},
             "GPU ratios: one replica against plain PyTorch, and mixed precision")
    cnn = s["one_replica_vs_plain"].get("thesis-cnn", {})
    if cnn:
        result = (f"{r2(cnn.get('allreduce'))} (AllReduce), {r2(cnn.get('downpour'))} "
                  "(Downpour), thesis CNN")
        p.at_a_glance("`fit` on one GPU, one replica", "plain PyTorch on the same GPU", result,
                      "1 GPU")
    p.add("Not measured: NCCL between distinct GPUs (the machine had one), the ships U-Net on "
          "the GPU.")
    p.add(f"Command: `bash benchmarks/gpu_check.sh` (on a lent machine: `bash "
          f"benchmarks/gpu_session.sh \"$OUT\"`). Results file: `benchmarks/results/{name}`; "
          "the same shared-GPU fits on CPU replicas: "
          "`benchmarks/results/gpu-shared-cpu-reference.json`.")


def not_measured(p: Page):
    p.section("Not measured")
    items = []
    s16 = (load("scaling-16.json") or {}).get("summary", {})
    for key, label in STRATEGIES:
        if not any(k.startswith(f"{key}-") and k != f"{key}-1" for k in s16):
            items.append(f"{label} at 16 replicas on 16 cores (`benchmarks/results/"
                         "scaling-16.json` has no such run).")
    at = (load("scaling-16.json") or {}).get("spark_dl_commit")
    if at:
        items.append(f"The 16-core scaling run is of spark_dl as at {at}: Downpour's default "
                     "staleness rule has changed since (`docs/guides/downpour.md`), and its "
                     "current default has not run on 16 cores.")
    if (load("run-16.json") or {}).get("summary", {}).get("ray") is None:
        items.append("Ray Train at 16 processes (`benchmarks/results/run-16.json` ran "
                     "without it).")
    items.append("Elephas on more than 2 cores, and against Downpour's current defaults.")
    items.append("Networks between machines: every figure here is one host's; Gossip's "
                 "low-bandwidth case is priced with the cost model, not measured.")
    p.add([f"- {i}" for i in items] + [""])


def build() -> Page:
    body = Page()
    for section in (allreduce, run_own_loop, step_cost, workloads, workloads_target, scaling,
                    downpour, parameter_server, gossip, localsgd, balance, amp, model_parallel,
                    counting, data, inference, superres, gpu, not_measured):
        section(body)
    p = Page()
    p.add("# Performance")
    p.add("What spark_dl's benchmarks measured, against what a user would otherwise run: "
          "plain single-process PyTorch (the calibration: the limit of N replicas is N × "
          "its rate), N processes that do not communicate, PySpark's TorchDistributor, Ray "
          "Train and Elephas. Every figure below is read from a results file in "
          "`benchmarks/results/` (the latest of each benchmark and machine; git keeps the "
          "older ones); what each benchmark measures is in `benchmarks/README.md`. The "
          "machines' speed drifts within an hour, so compare the ratios of one run, not rates "
          "across runs.")
    p.add("This page is generated: `python benchmarks/report.py` rewrites it and its plots "
          "from the results files, and `tests/test_docs.py` fails when it is out of date.")
    p.add("## At a glance")
    p.add(table(["spark_dl", "against", "result", "machine", "section"], body.glance,
                "lllll"))
    p.lines += body.lines
    p.figures = body.figures
    return p


# --- drawing -----------------------------------------------------------------------------

def draw(spec: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
                         "svg.hashsalt": "spark_dl"})
    kind = spec["kind"]
    if kind == "lines":
        panels = spec["panels"]
        fig, axes = plt.subplots(1, len(panels), figsize=FIGSIZE, squeeze=False)
        for ax, panel in zip(axes[0], panels):
            for i, ln in enumerate(panel["lines"]):
                pts = [(x, y) for x, y in zip(ln["x"], ln["y"]) if y is not None]
                if not pts:
                    continue
                dashed = ln.get("style") == "dashed"
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                        linestyle="--" if dashed else "-", label=ln["label"],
                        color="grey" if dashed else COLORS.get(ln["label"], f"C{i}"))
            for h in panel.get("hlines", []):
                ax.axhline(h["y"], linestyle=":", color="grey")
                ax.text(0.02, h["y"], h["label"], fontsize=7, va="bottom",
                        transform=ax.get_yaxis_transform())
            ax.set_ylim(bottom=0)
            xs = sorted({x for ln in panel["lines"] for x in ln["x"]})
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel(spec["xlabel"])
            ax.set_ylabel(spec["ylabel"])
            ax.set_title(panel["title"] or spec["title"])
            ax.legend(fontsize=7)
        if len(panels) > 1:
            fig.suptitle(spec["title"])
    elif kind == "bars":
        groups = spec["groups"]
        order = [k for g in groups for k in g["bars"]]
        labels = sorted(set(order), key=order.index)
        fig, ax = plt.subplots(figsize=FIGSIZE)
        width = 0.8 / len(groups)
        for i, g in enumerate(groups):
            xs = [j + (i - (len(groups) - 1) / 2) * width for j, k in enumerate(labels)
                  if k in g["bars"]]
            ys = [g["bars"][k] for k in labels if k in g["bars"]]
            bars = ax.bar(xs, ys, width, label=g["label"])
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(spec["hline"], color="grey", linestyle=":")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel(spec["ylabel"])
        ax.set_title(spec["title"])
        ax.legend(fontsize=7)
    elif kind == "hbars":
        items = list(spec["bars"].items())
        fig, ax = plt.subplots(figsize=(FIGSIZE[0], 0.35 * len(items) + 1.0))
        bars = ax.barh(range(len(items)), [v for _, v in items], color="tab:blue")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_yticks(range(len(items)), [k for k, _ in items])
        ax.invert_yaxis()
        ax.axvline(spec["vline"], color="grey", linestyle=":")
        ax.set_title(spec["title"])
    elif kind == "stream":
        fig, (a, b) = plt.subplots(1, 2, figsize=FIGSIZE)
        x = spec["x"]
        a.loglog(x, spec["epoch_s"], marker="o", label="measured")
        a.loglog(x, [spec["epoch_s"][0] * v / x[0] for v in x], linestyle="--",
                 color="grey", label="proportional to the rows")
        a.set_xlabel("rows")
        a.set_ylabel("seconds an epoch")
        a.set_title("Epoch time")
        a.legend(fontsize=7)
        b.semilogx(x, spec["peak_rss_mb"], marker="o")
        b.set_ylim(0, max(spec["peak_rss_mb"]) * 1.3)
        b.set_xlabel("rows")
        b.set_ylabel("MB")
        b.set_title("Peak memory (RSS) of the process")
        fig.suptitle(spec["title"])
    else:
        raise ValueError(f"unknown figure kind {kind!r}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata={"Software": None,
                                         "Description": json.dumps(spec, sort_keys=True)})
    plt.close(fig)


def markdown(page: Page) -> str:
    return "\n".join(page.lines).rstrip("\n") + "\n"


def write(out_docs: Path, page: Page) -> None:
    (out_docs / IMG).mkdir(parents=True, exist_ok=True)
    (out_docs / "performance.md").write_text(markdown(page))
    for old in (out_docs / IMG).glob("*.png"):
        if old.stem not in page.figures:
            old.unlink()
    for name, spec in page.figures.items():
        draw(spec, out_docs / IMG / f"{name}.png")


def plotted(path: Path) -> dict | None:
    from PIL import Image
    with Image.open(path) as im:
        text = im.text.get("Description")
    return json.loads(text) if text else None


def check(render: bool = False) -> list[str]:
    """What differs between the committed page and plots and what the results files give
    now (empty: nothing). The markdown is compared byte for byte; a plot by the data it was
    drawn from (its PNG's "Description"), or, with ``render``, by drawing it again into a
    temporary folder and comparing that PNG's data too."""
    page = build()
    docs = ROOT / "docs"
    problems = []
    if not PAGE.exists() or PAGE.read_text() != markdown(page):
        problems.append("docs/performance.md")
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in page.figures.items():
            committed = docs / IMG / f"{name}.png"
            want = json.loads(json.dumps(spec, sort_keys=True))
            if render:
                draw(spec, Path(tmp) / f"{name}.png")
                want = plotted(Path(tmp) / f"{name}.png")
            if not committed.exists() or plotted(committed) != want:
                problems.append(f"docs/{IMG}/{name}.png")
    extra = sorted(p.name for p in (docs / IMG).glob("*.png") if p.stem not in page.figures)
    problems += [f"docs/{IMG}/{n} (no longer drawn)" for n in extra]
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when docs/performance.md or its plots are out of date")
    ap.add_argument("--render", action="store_true",
                    help="with --check: draw the plots again and compare their data too")
    ap.add_argument("--out", type=Path, default=ROOT / "docs",
                    help="where performance.md and img/performance/ go (default: docs/)")
    args = ap.parse_args(argv)
    if args.check:
        problems = check(args.render)
        for p in problems:
            print(f"stale: {p}", file=sys.stderr)
        if problems:
            print("run: python benchmarks/report.py", file=sys.stderr)
        return 1 if problems else 0
    write(args.out, build())
    return 0


if __name__ == "__main__":
    sys.exit(main())
