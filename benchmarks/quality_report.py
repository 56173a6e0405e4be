"""The tables and plots of docs/quality.md, from the workload summaries in
benchmarks/results/quality/ (mnist.json, char.json, ships.json, counting.json, superres.json,
superres-degradations.json; fc-lbfgs-100k.json).

    python benchmarks/quality_report.py            # rewrite the tables, draw docs/img/quality/
    python benchmarks/quality_report.py --check    # exit 1 when a table of the page is stale
    python benchmarks/quality_report.py --add mnist cnn-sgd runs/quality/cnn-sgd.json
                                      # a new run (benchmarks/quality_runs.sh) replaces a row

Each table sits in docs/quality.md between ``<!-- table: NAME -->`` and ``<!-- /table -->``;
the prose around it is the page's own. The plots are PNGs of fixed size and dpi without a
software stamp, so that the same results give the same bytes (for one matplotlib version).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "quality"
PAGE = ROOT / "docs" / "quality.md"
IMG = ROOT / "docs" / "img" / "quality"
IMAGES = ("baby", "bird", "butterfly", "head", "woman")
METHODS = (("bicubic", "bicubic"), ("thesis_conventional", "thesis's conventional"),
           ("conventional", "stages apart"), ("cascade", "cascade"))


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def rows_by_id(summary: dict) -> dict:
    out = {}
    for r in summary["rows"]:
        if "file" in r:                 # a run's own results file, not copied
            r = {**r, "run": json.loads((ROOT / r["file"]).read_text())}
        out[r["id"]] = r
    return out


def md(header: list[str], rows: list[list], align: str) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


# -- tables ----------------------------------------------------------------------------------
OPTIMIZERS = ("cnn-sgd", "cnn-adam", "fc-cg", "fc-adam", "fc-one-100k", "fc-cg-100k",
              "fc-lbfgs-100k")
ENGINES = (("cnn-one-cpu", "cnn-allreduce"), ("cnn-one-100k", "cnn-2x2"),
           ("fc-one-100k", "fc-2x2"), ("fcw-one", "fcw-2x2-local4", "fcw-2x2-cluster"))


def _where(run: dict) -> str:
    dev = run.get("device", "")
    if "H100" in dev:
        return "H100"
    return f"CPU, {run['threads']} thread{'s' * (run['threads'] != 1)}" if "threads" in run \
        else "CPU"


def t_mnist_optimizers(m: dict) -> str:
    rows = []
    for rid in OPTIMIZERS:
        r = m[rid]
        run = r["run"]
        size = f"{run['train_samples']:,} x {run['epochs']}"
        label = r.get("optimizer_label", r["label"]) + (" (**reduced size**)"
                                                        if run["train_samples"] < 200000 else "")
        seconds = f"{run['train_seconds']:.0f}" + (" (a shared core)" if r.get("shared_core")
                                                   else "")
        rows.append([label, size, _where(run), f"**{pct(run['test_accuracy'])}**",
                     pct(run["best_test_accuracy"]), seconds])
    return md(["model, optimizer", "digits x epochs", "where", "test accuracy",
               "best epoch", "training s"], rows, "llrrrr")


def t_mnist_engines(m: dict) -> str:
    rows = []
    for group in ENGINES:
        ref = m[group[0]]["run"]["test_accuracy"]
        for i, rid in enumerate(group):
            run = m[rid]["run"]
            delta = "" if i == 0 else f"{100 * (run['test_accuracy'] - ref):+.2f}"
            rows.append([m[rid]["label"], f"{run['train_samples']:,}",
                         f"**{pct(run['test_accuracy'])}**" if i else pct(run["test_accuracy"]),
                         delta, f"{run['train_seconds']:.0f}"])
    return md(["system", "digits", "test accuracy, epoch 8", "- one process (points)",
               "training s"], rows, "lrrrr")


def t_char(c: dict) -> str:
    rows = []
    for rid in ("rnn", "lstm", "lstm-best", "lstm-gpu", "lstm-2cores"):
        run = c[rid]["run"]
        curve = run["curve"]
        best = min(p.get("val_loss_ema", p["val_loss"]) for p in curve)
        where = "H100" if "H100" in run["device"] else f"CPU, {run['threads']} threads"
        rows.append([c[rid]["label"], f"{curve[-1]['updates']:,}", where,
                     f"{run['val_loss']:.3f}", f"**{best:.3f}**", f"{run['train_seconds']:.0f}"])
    return md(["model", "updates", "where", "val loss, last", "val loss, best", "training s"],
              rows, "lrlrrr")


def t_char_split(c: dict) -> str:
    rows = []
    ref = c["1x1"]["run"]["val_loss"]
    for rid in ("one-900", "1x1", "2x2"):
        run = c[rid]["run"]
        rows.append([c[rid]["label"], f"{run['updates'] * run.get('replicas', 1):,}",
                     f"{run['val_loss']:.4f}", f"{run['val_loss'] - ref:+.4f}",
                     f"{run['train_seconds']:.0f}"])
    return md(["system", "server updates", "val loss (nats/char)", "- Downpour 1 x 1",
               "training s"], rows, "lrrrr")


def t_ships(s: dict) -> str:
    rows = []
    for rid in ("one-lr0.004", "boosting-2", "boosting-4", "downpour-2", "downpour-4"):
        r = s[rid]
        ious = [x["iou"] for x in r["runs"]]
        seeds = [x["seed"] for x in r["runs"]]
        rows.append([r["label"], f"{min(seeds)}-{max(seeds)}",
                     " ".join(f"{v:.3f}" for v in ious), f"**{mean(ious):.3f}**",
                     f"{min(ious):.3f}"])
    return md(["system", "seeds", "IoU per seed", "mean", "lowest"], rows, "llrrr")


def t_counting(c: dict) -> str:
    rows = []
    for rid in ("mcnn", "mcnn-deconv"):
        run = c[rid]["run"]
        bins = " / ".join(f"{b['mae']:.2f}" for b in run["bins"])
        rows.append([c[rid]["label"], f"**{run['mae']:.2f}**", f"{run['rmse']:.2f}", bins,
                     f"{run['wall_seconds']:.0f}"])
    counts = " / ".join(b["counts"] for b in c["mcnn"]["run"]["bins"])
    return md(["model", "MAE", "RMSE", f"MAE by true count {counts}", "fit s"], rows, "lrrrr")


def _ps(d: dict) -> str:
    return f"{d['psnr']:.2f} / {d['ssim']:.3f}"


def t_table51(sr: dict) -> str:
    th = sr["thesis_table_5_1"]["rows"]
    rows = [[f"thesis: {name}", f"{v[0][0]:.2f} / {v[0][1]:.4f}", f"{v[1][0]:.2f} / {v[1][1]:.4f}",
             f"{v[2][0]:.2f} / {v[2][1]:.4f}", f"{v[2][0] - v[0][0]:+.2f}"]
            for name, v in th.items()]
    rep = sr["cascade"]["report"]
    for name in (*IMAGES, None):
        d = rep["images"][name] if name else rep["average"]
        label = f"ours: Set5 {name} (sigma 20)" if name else "**ours: Set5 average**"
        rows.append([label, _ps(d["thesis_conventional"]), "", _ps(d["cascade"]),
                     f"{d['cascade']['psnr'] - d['thesis_conventional']['psnr']:+.2f}"])
    return md(["image", "conventional (SSDA, then SRCNN)", "state of the art [SPA14a]",
               "cascade, tuned end to end", "cascade - conventional (dB)"], rows, "lrrrr")


def t_superres(sr: dict) -> str:
    rep = sr["cascade"]["report"]
    rows = []
    for name in (*IMAGES, None):
        d = rep["images"][name] if name else rep["average"]
        rows.append([name or "**average**", *(_ps(d[k]) for k, _ in METHODS),
                     _ps(d["cascade+"])])
    return md(["image", *(label for _, label in METHODS), "cascade, x8 self-ensemble"], rows,
              "lrrrrr")


_DEGRADATION = {"gaussian20": "Gaussian sigma 20", "gaussian25": "Gaussian sigma 25",
                "gaussian30": "Gaussian sigma 30", "blur": "blur (std 1 LR pixel)",
                "salt_pepper": "salt-and-pepper 5%", "blur_gaussian": "blur 1 + Gaussian 20"}
_THESIS_GAIN = {"gaussian20": 2.16, "gaussian25": 2.16, "gaussian30": 2.16, "blur": 2.2,
                "salt_pepper": 2.9}


def t_degradations(sw: dict) -> str:
    rows = []
    for r in sw["rows"]:
        a = r["average"]
        gain = a["cascade"]["psnr"] - a["thesis_conventional"]["psnr"]
        thesis = _THESIS_GAIN.get(r["row"])
        rows.append([_DEGRADATION[r["row"]], *(_ps(a[k]) for k, _ in METHODS),
                     f"**{gain:+.2f}**", f"{thesis:+.2f}" if thesis else ""])
    return md(["degradation", *(label for _, label in METHODS), "cascade - conventional (dB)",
               "the thesis's gain (dB)"], rows, "lrrrrrr")


def t_srcnn(sr: dict) -> str:
    run = sr["srcnn_x2"]["run"]
    rows = [[name, f"{v['bicubic']:.2f}", f"{v['srcnn']:.2f}", f"{v['srcnn'] - v['bicubic']:+.2f}"]
            for name, v in run["per_image"].items()]
    rows.append(["**mean**", f"{run['mean_psnr_bicubic']:.2f}", f"**{run['mean_psnr_srcnn']:.2f}**",
                 f"{run['mean_psnr_srcnn'] - run['mean_psnr_bicubic']:+.2f}"])
    return md(["image", "bicubic", "SRCNN", "gain (dB)"], rows, "lrrr")


def t_ssda_split(split: dict, shuffled: dict) -> str:
    runs = split["runs"]
    ref = runs["1x1"]["mean_psnr"]
    rows = [["noisy input", *(f"{split['psnr_noisy'][n]:.2f}" for n in IMAGES),
             f"{split['mean_psnr_noisy']:.2f}", ""]]
    for name, run in (*runs.items(), *((f"{k}, pairs shuffled across partitions", v)
                                        for k, v in shuffled["runs"].items())):
        rx = name.split(",")[0].replace("x", " x ")
        rows.append([f"{rx}{name[len(name.split(',')[0]):]}",
                     *(f"{run['psnr'][n]:.2f}" for n in IMAGES),
                     f"**{run['mean_psnr']:.2f}**",
                     "" if name == "1x1" else f"{run['mean_psnr'] - ref:+.2f}"])
    return md(["replicas x partitions", *IMAGES, "mean", "- 1 x 1 (dB)"], rows, "lrrrrrrr")


def tables() -> dict[str, str]:
    m, c, s = rows_by_id(load("mnist.json")), rows_by_id(load("char.json")), \
        rows_by_id(load("ships.json"))
    sr, sw = load("superres.json"), load("superres-degradations.json")
    return {"mnist-optimizers": t_mnist_optimizers(m), "mnist-engines": t_mnist_engines(m),
            "char": t_char(c), "char-split": t_char_split(c), "ships": t_ships(s),
            "counting": t_counting(rows_by_id(load("counting.json"))),
            "table-5.1": t_table51(sr), "superres": t_superres(sr),
            "degradations": t_degradations(sw), "srcnn": t_srcnn(sr),
            "ssda-split": t_ssda_split(load("ssda-partitions.json"),
                                       load("ssda-partitions-shuffled.json"))}


# -- plots -----------------------------------------------------------------------------------
def _figure(cols: int, width: float = 10.0, height: float = 4.0):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return fig, fig.subplots(1, cols, squeeze=False)[0]


def _save(fig, name: str) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / name, format="png", metadata={"Software": None})


def _epochs(ax, label="epoch"):
    from matplotlib.ticker import MaxNLocator
    ax.set_xlabel(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)


def p_mnist(m: dict) -> None:
    fig, (acc, loss) = _figure(2, height=5.0)
    for rid in OPTIMIZERS:
        run, label = m[rid]["run"], m[rid]["label"]
        reduced = run["train_samples"] < 200000
        h = run["history"]
        label = m[rid].get("optimizer_label", label)
        style = dict(marker="o", markersize=3, linestyle="--" if reduced else "-",
                     label=label + (" (reduced size)" if reduced else ""))
        acc.plot([r["epoch"] for r in h], [100 * r["val_accuracy"] for r in h], **style)
        loss.plot([r["epoch"] for r in h], [r["loss"] for r in h], **style)
    acc.set_ylabel("test accuracy (%)")
    acc.set_ylim(95, 100)
    acc.set_title("test accuracy (2,000 digits; below 95% not shown)")
    loss.set_ylabel("training loss (epoch mean)")
    loss.set_yscale("log")
    loss.set_title("training loss")
    for ax in (acc, loss):
        _epochs(ax)
    fig.legend(*acc.get_legend_handles_labels(), loc="outside lower center", ncols=2,
               fontsize="small")
    _save(fig, "mnist-optimizers.png")

    fig, axes = _figure(len(ENGINES), width=12, height=3.8)
    titles = ("CNN: AllReduce", "CNN: split in two", "FC: the thesis's algorithm",
              "wide FC: split in two")
    for ax, group, title in zip(axes, ENGINES, titles):
        low = 100.0
        for i, rid in enumerate(group):
            h = m[rid]["run"]["history"]
            ys = [100 * r["val_accuracy"] for r in h]
            low = min(low, *ys[1:])
            ax.plot([r["epoch"] for r in h], ys, marker="o", markersize=3,
                    linestyle="-" if i else "--", label=m[rid]["label"])
        ax.set_ylim(low - 0.3, None)          # epoch 1 of a slow start may fall below
        ax.set_title(title, fontsize="medium")
        ax.set_ylabel("test accuracy (%)")
        _epochs(ax)
        ax.legend(fontsize="xx-small", loc="lower right")
    _save(fig, "mnist-engines.png")

    fig, (err, grad) = _figure(2, height=3.6)
    for rid in ("cnn-2x2", "fc-2x2"):
        h = m[rid]["run"]["history"]
        ep = [r["epoch"] for r in h]
        err.plot(ep, [math.log10(r["loss"]) for r in h], marker="o", label=m[rid]["label"])
        grad.plot(ep, [r["grad_mean_abs"] for r in h], marker="o", label=m[rid]["label"])
    err.set_ylabel("log10 training loss")
    err.set_title("(a) log10 of the training error")
    grad.set_ylabel("mean |gradient| per coordinate")
    grad.set_yscale("log")
    grad.set_title("(b) mean |gradient| of the server's updates")
    for ax in (err, grad):
        _epochs(ax)
    err.legend(fontsize="x-small")
    _save(fig, "mnist-fig4.3.png")


def p_char(c: dict) -> None:
    fig, (val, split) = _figure(2)
    for rid in ("rnn", "lstm", "lstm-best", "lstm-gpu", "lstm-2cores"):
        curve = c[rid]["run"]["curve"]
        key = "val_loss_ema" if "val_loss_ema" in curve[0] else "val_loss"
        val.plot([p["updates"] for p in curve], [p[key] for p in curve], marker=".",
                 label=c[rid]["label"])
    val.set_ylim(1.4, 2.0)
    val.set_ylabel("validation loss (nats/char)")
    val.set_title("one process")
    for rid in ("one-900", "1x1", "2x2"):
        run = c[rid]["run"]
        pts = run.get("history") or run["curve"]
        k = run.get("replicas", 1)
        xs = [p.get("updates", p.get("epoch")) for p in pts]
        if "history" in run:              # per epoch of the Spark runs: server updates so far
            per = run["updates"] * k / len(pts)
            xs = [per * (i + 1) for i in range(len(pts))]
        split.plot(xs, [p["val_loss"] for p in pts], marker="o", label=c[rid]["label"])
    split.set_ylabel("validation loss (nats/char)")
    split.set_title("split in two (900 server updates)")
    for ax in (val, split):
        ax.set_xlabel("updates")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="xx-small")
    _save(fig, "char.png")


def p_ships(s: dict) -> None:
    fig, (iou, val) = _figure(2)
    ids = ("one-lr0.004", "boosting-2", "boosting-4", "downpour-2", "downpour-4")
    for i, rid in enumerate(ids):
        runs = s[rid]["runs"]
        ys = [r["iou"] for r in runs]
        iou.scatter([i] * len(ys), ys, s=18, zorder=3)
        iou.plot([i - 0.25, i + 0.25], [mean(ys)] * 2, color="black")
        epochs = range(1, len(runs[0]["val_loss"]) + 1)
        val.plot(list(epochs), [mean(r["val_loss"][e - 1] for r in runs) for e in epochs],
                 marker="o", label=s[rid]["label"])
    iou.set_xticks(range(len(ids)), ["one process", "Boosting\n2 workers", "Boosting\n4 workers",
                                     "Downpour\n2 workers", "Downpour\n4 workers"],
                   fontsize="small")
    iou.set_ylabel("held-out IoU (dots: seeds; bar: mean)")
    iou.grid(True, axis="y", alpha=0.3)
    val.set_yscale("log")
    val.set_ylabel("validation loss (mean over seeds)")
    _epochs(val)
    val.legend(fontsize="x-small")
    _save(fig, "ships.png")


def p_counting(c: dict) -> None:
    fig, axes = _figure(2, height=3.4)
    for ax, rid in zip(axes, ("mcnn", "mcnn-deconv")):
        h = c[rid]["run"]["history"]
        ep = [r["epoch"] for r in h]
        ax.plot(ep, [r["loss"] for r in h], marker="o", label="training")
        ax.plot(ep, [r["val_loss"] for r in h], marker="o", label="validation")
        ax.set_title(c[rid]["label"], fontsize="small")
        ax.set_ylabel("pixel-wise Euclidean loss")
        _epochs(ax)
        ax.legend(fontsize="x-small")
    _save(fig, "counting.png")


def p_superres(sr: dict, sw: dict) -> None:
    fig, (loss, bars) = _figure(2, width=11)
    hist = sr["cascade"]["histories"]
    for key, label in (("cnn", "SRCNN on the denoiser's output"),
                       ("cnn_clean", "SRCNN on clean LR (thesis's conventional)"),
                       ("cascade", "cascade, end to end (2 + 3 + 3 epochs)")):
        h = hist[key]
        loss.plot(range(1, len(h) + 1), [r["loss"] for r in h], marker="o", label=label)
    loss.set_yscale("log")
    loss.set_ylabel("training MSE per pixel")
    loss.set_title("training, sigma 20 (137,616 pairs)")
    _epochs(loss, "epoch of the stage")
    loss.legend(fontsize="x-small")
    width = 0.2
    for j, (key, label) in enumerate(METHODS):
        ys = [r["average"][key]["psnr"] for r in sw["rows"]]
        bars.bar([i + (j - 1.5) * width for i in range(len(ys))], ys, width, label=label)
    bars.set_xticks(range(len(sw["rows"])), [_DEGRADATION[r["row"]].replace(" (std 1 LR pixel)",
                                                                            "")
                                              for r in sw["rows"]],
                    rotation=20, fontsize="small")
    bars.set_ylim(18, 31)
    bars.set_ylabel("Set5 x2 average PSNR (dB)")
    bars.set_title("per degradation (17,202 pairs)")
    bars.grid(True, axis="y", alpha=0.3)
    bars.legend(fontsize="x-small", ncols=2)
    _save(fig, "superres.png")


def plots() -> None:
    import matplotlib
    matplotlib.use("Agg")
    p_mnist(rows_by_id(load("mnist.json")))
    p_char(rows_by_id(load("char.json")))
    p_ships(rows_by_id(load("ships.json")))
    p_counting(rows_by_id(load("counting.json")))
    p_superres(load("superres.json"), load("superres-degradations.json"))


# -- the page --------------------------------------------------------------------------------
_BLOCK = re.compile(r"(<!-- table: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /table -->)",
                    re.DOTALL)


def render(page: str, made: dict[str, str]) -> str:
    seen = set()

    def fill(m):
        name = m["name"]
        if name not in made:
            raise SystemExit(f"docs/quality.md names a table {name!r} that this script does "
                             f"not make; its tables: {', '.join(made)}")
        seen.add(name)
        return f"{m[1]}{made[name]}\n{m[4]}"
    out = _BLOCK.sub(fill, page)
    missing = sorted(set(made) - seen)
    if missing:
        raise SystemExit(f"docs/quality.md has no place for the tables {missing}: add "
                         f"<!-- table: NAME --> ... <!-- /table --> for each")
    return out


def _seed(run: dict) -> int:
    for o in run.get("overrides", []):
        if o.startswith("train.seed="):
            return int(o.split("=", 1)[1])
    return 0


def add(workload: str, rid: str, files: list[str]) -> None:
    """Put the runs' results (the jobs' JSON files) in row ``rid`` of ``workload``.json: a
    row of one run takes the file's figures, a row of seeds (ships) one entry per file."""
    import subprocess
    path = RESULTS / f"{workload}.json"
    if not path.exists():
        raise SystemExit(f"no summary {path.relative_to(ROOT)}; the summaries: "
                         f"{', '.join(sorted(p.stem for p in RESULTS.glob('*.json')))}")
    data = json.loads(path.read_text())
    row = next((r for r in data.get("rows", []) if r["id"] == rid), None)
    if row is None:
        raise SystemExit(f"{path.name} has no row {rid!r}; its rows: "
                         f"{', '.join(r['id'] for r in data.get('rows', []))}")
    runs = [json.loads(Path(f).read_text()) for f in files]
    if "runs" in row:
        row["runs"] = sorted(({"seed": _seed(r), "iou": r["iou"], "dice": r.get("dice"),
                               "val_loss": [h["val_loss"] for h in r["history"]]}
                              for r in runs), key=lambda r: r["seed"])
    elif len(runs) != 1:
        raise SystemExit(f"row {rid!r} holds one run; got {len(runs)} files")
    elif "file" in row:
        (ROOT / row["file"]).write_text(json.dumps(runs[0], indent=1) + "\n")
    else:
        row["run"] = {k: v for k, v in runs[0].items() if k not in ("info", "sample", "picture")}
    row["source"] = files if len(files) > 1 else files[0]
    row["measured_at"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                        capture_output=True, text=True, check=False).stdout.strip()
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="compare the page's tables with the results; draw nothing")
    ap.add_argument("--add", nargs="+", metavar=("WORKLOAD ROW", "FILE"),
                    help="replace a row of a summary with new runs' results files")
    args = ap.parse_args(argv)
    if args.add:
        if len(args.add) < 3:
            ap.error("--add takes WORKLOAD ROW FILE [FILE ...]")
        add(args.add[0], args.add[1], args.add[2:])
        return 0
    page = PAGE.read_text()
    new = render(page, tables())
    if args.check:
        if new != page:
            print("docs/quality.md is stale: run python benchmarks/quality_report.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    plots()
    return 0


if __name__ == "__main__":
    sys.exit(main())
