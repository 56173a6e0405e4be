"""Which denoiser for the super-resolution pipeline's first stage? Per-patch quality of SSDA
variants on the same T91 pairs, single process, a fixed budget of Adam steps.

Pairs: LR 16x16 patches of T91 (Y channel, halved by bicubic, stride 16, no augmentation:
17,202 pairs) with Gaussian noise sigma 20, made in-process by the pipeline's own make_pairs;
the last 2,000 pairs (from the last images) are held out. Unless a variant says otherwise it
trains end to end from its initial weights on 1/2 ||y - y_hat||^2 with Adam 1e-3, batch 64,
--steps steps, 1 thread; the figure is the held-out per-patch PSNR (no tile averaging).
References: the noisy patches, a 3x3 mean filter, and each clean patch's own mean (a flat patch
at the right brightness: what a denoiser that passes no detail can reach at best).

Variants with "pre" pretrain greedily first (SSDA.pretrain: layer k a denoising autoencoder of
the codes below, eq. 5.3 with its LayerSpec's beta, rho, lambda), --steps / 6 steps per layer,
then fine-tune (eq. 5.4) for the rest of the --steps budget (all of it for "+ft" variants, whose
budget is then larger: "steps" in the JSON is each variant's total). For every variant the JSON
also has the fraction of the clean patches' detail the output keeps (detail_ratio: mean
within-patch std of the output over that of the clean patch; 0 = flat patches) and, per hidden
layer on the held-out pairs, the mean activation, the fraction of saturated activations
(< 0.01 or > 0.99) and the fraction of dead units (std over the held-out pairs < 0.01).

    .venv/bin/python benchmarks/ssda_variants.py [--steps 3000] [--variants ssda1,ssda3,mlp]
        [--seeds 0] [--out benchmarks/results/ssda_variants.json] [--merge]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _pairs(sigma: float):
    import numpy as np

    from spark_dl.superres.images import load_y
    from spark_dl.superres.prepare import Degradation, make_pairs
    rng = np.random.default_rng(0)
    noisy, clean = [], []
    for path in sorted((ROOT / "data/sr/T91").glob("*.png")):
        _, lr_clean, lr = make_pairs(load_y(path), 32, 2, 16, Degradation("gaussian", sigma),
                                     rng, augment=False)
        noisy.append(lr.reshape(len(lr), -1))
        clean.append(lr_clean.reshape(len(lr_clean), -1))
    return np.concatenate(noisy).astype(np.float32), np.concatenate(clean).astype(np.float32)


def _variants():
    """key -> (name, factory, training): training keys lr, pretrain (fraction of --steps per
    layer), finetune_lr, loss ("recon" or "eq5.4"), extra (fine-tune for all of --steps)."""
    from torch import nn

    from spark_dl.models.ssda import SSDA, THESIS_SSDA_LAYERS, DenoisingLayer, LayerSpec

    def tied(gain=1.0, beta=0.01, last=(0.0, 1.0)):
        """The thesis's widths with the 256-unit code decoded by tied decoders (the package's
        reading until 2026-11-25): 256-1280-1280-256-1280-1280-256, all sigmoid."""
        return lambda: SSDA(256, (LayerSpec(1280, beta, 0.05, 1e-4, gain),
                                  LayerSpec(1280, beta, 0.05, 1e-4, gain),
                                  LayerSpec(256, *last, 1e-4, gain)))

    def thesis(gain=4.0, out_gain=1.0, beta=0.01):
        """App. B as the package reads it now: 256-1280-1280-256, the third layer the output."""
        return lambda: SSDA(256, (LayerSpec(1280, beta, 0.05, 1e-4, gain),
                                  LayerSpec(1280, beta, 0.05, 1e-4, gain),
                                  LayerSpec(256, 0.0, 1.0, 1e-4, out_gain, output=True)))

    class LinearOutput(DenoisingLayer):
        def encode(self, x):                 # the cascade's F3 = F2 w3 + b3: no sigmoid
            return x @ self.weight.t() + self.bias

    def thesis_linear():
        model = SSDA(256, THESIS_SSDA_LAYERS)
        last = LinearOutput(1280, model.layers[-1].spec)
        last.load_state_dict(model.layers[-1].state_dict())
        model.layers[-1] = last
        return model

    pre = dict(pretrain=1 / 6, loss="eq5.4")
    return {
        "ssda1": ("SSDA 1280 (one tied sigmoid layer)",
                  lambda: SSDA(256, (LayerSpec(1280, 0.0, 1.0),)), {}),
        "ssda1-pre": ("ssda1, App. B pretraining then fine-tuning",
                      lambda: SSDA(256, (LayerSpec(1280, 0.0, 1.0),)), pre),
        "ssda2": ("SSDA 1280-1280", lambda: SSDA(256, (LayerSpec(1280), LayerSpec(1280, 0.0, 1.0))),
                  {}),
        "ssda3": (("SSDA 1280-1280-256, the 256 code decoded by tied decoders (the package's "
                   "reading until 2026-11-25)"), tied(), {}),
        "mlp": ("ReLU MLP 256-1280-1280-256, untied (reference)",
                lambda: nn.Sequential(nn.Linear(256, 1280), nn.ReLU(), nn.Linear(1280, 1280),
                                      nn.ReLU(), nn.Linear(1280, 256)), {}),
        # the tied-decoder stack: learning rate, initial weights, pretraining, sparsity
        "ssda3-lr1e-4": ("ssda3, Adam 1e-4", tied(), dict(lr=1e-4)),
        "ssda3-lr3e-4": ("ssda3, Adam 3e-4", tied(), dict(lr=3e-4)),
        "ssda3-lr3e-3": ("ssda3, Adam 3e-3", tied(), dict(lr=3e-3)),
        "ssda3-init4": ("ssda3, Glorot's sigmoid init (bound x4)", tied(4.0), {}),
        "ssda3-init0.25": ("ssda3, init bound x0.25", tied(0.25), {}),
        "ssda3-pre": ("ssda3, App. B pretraining then fine-tuning", tied(), pre),
        "ssda3-pre-ft1e-4": ("ssda3-pre, fine-tuning at Adam 1e-4 (as recipes/superres.py)",
                             tied(), dict(pre, finetune_lr=1e-4)),
        "ssda3-pre-nosparse": ("ssda3-pre without sparsity (beta 0)", tied(beta=0.0), pre),
        "ssda3-pre-sparse256": ("ssda3-pre, the 256 layer sparse too (beta 0.01, rho 0.05)",
                                tied(last=(0.01, 0.05)), pre),
        "ssda3-pre-init4": ("ssda3-pre with the sigmoid init", tied(4.0), pre),
        # App. B's third layer as the output layer (THESIS_SSDA_LAYERS since 2026-11-25)
        "thesis3": (("SSDA 256-1280-1280-256, the 256 layer the output, the sigmoid init below "
                     "it (THESIS_SSDA_LAYERS)"), lambda: SSDA(256, THESIS_SSDA_LAYERS), {}),
        "thesis3-init1": ("thesis3 with the tanh init (bound x1) below the output", thesis(1.0),
                          {}),
        "thesis3-init4out": ("thesis3 with the sigmoid init (x4) in the output layer too",
                             thesis(4.0, 4.0), {}),
        "thesis3-pre-nosparse": ("thesis3-pre without sparsity (beta 0)", thesis(beta=0.0),
                                 dict(pretrain=1 / 6, loss="eq5.4")),
        "thesis3-linear": ("thesis3 with a linear output layer (the cascade's F3)", thesis_linear,
                           {}),
        "thesis3-pre": ("thesis3, App. B pretraining then fine-tuning", thesis(), pre),
        "thesis3-pre+ft": ("thesis3, App. B pretraining then --steps of fine-tuning", thesis(),
                           dict(pre, extra=True)),
    }


def _activity(model, vx):
    """Per hidden layer on the held-out inputs: mean activation, saturated fraction (< 0.01 or
    > 0.99), dead units (std < 0.01). None for models that are not SSDAs."""
    import torch

    from spark_dl.models.ssda import SSDA
    if not isinstance(model, SSDA):
        return None
    acts, h = [], vx
    with torch.no_grad():
        for k, layer in enumerate(model.layers):
            h = layer.encode(h)
            if not (k == len(model.layers) - 1 and layer.spec.output):
                acts.append((f"encoder {k + 1}", h))
        if not model.layers[-1].spec.output:
            for k in range(len(model.layers) - 1, 0, -1):
                h = model.layers[k].decode(h)
                acts.append((f"decoder {k + 1}", h))
    return [{"layer": name, "units": a.shape[1], "mean": round(a.mean().item(), 3),
             "saturated": round(((a < 0.01) | (a > 0.99)).float().mean().item(), 3),
             "dead": round((a.std(0) < 0.01).float().mean().item(), 3)} for name, a in acts]


def _run(make, training, x, y, vx, vy, steps, seed, psnr):
    """Train one variant; returns its JSON entry (without the name)."""
    import torch
    torch.manual_seed(seed)
    model = make()
    g = torch.Generator().manual_seed(seed)

    def batch():
        idx = torch.randint(len(x), (64,), generator=g)
        return x[idx], y[idx]
    lr = training.get("lr", 1e-3)
    entry, t0, finetune, pretrained = {}, time.perf_counter(), steps, 0
    if training.get("pretrain"):
        per_layer = int(steps * training["pretrain"])
        model.pretrain(lambda epoch: (batch() for _ in range(per_layer)),
                       lambda params: torch.optim.Adam(params, lr=lr), epochs=1)
        with torch.no_grad():
            entry["after_pretrain_db"] = round(psnr(model(vx), vy), 2)
        entry["pretrain_steps_per_layer"] = per_layer
        pretrained = per_layer * len(model.layers)
        if not training.get("extra"):
            finetune = steps - pretrained
    opt = torch.optim.Adam(model.parameters(), lr=training.get("finetune_lr", lr))
    for _ in range(finetune):
        a, b = batch()
        if training.get("loss") == "eq5.4":
            loss = model.finetune_loss(a, b)
        else:
            loss = 0.5 * ((model(a) - b) ** 2).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        out = model(vx)
    entry.update(held_out_db=round(psnr(out, vy), 2), seconds=round(time.perf_counter() - t0, 1),
                 steps=pretrained + finetune, finetune_steps=finetune,
                 lr=lr, finetune_lr=training.get("finetune_lr", lr),
                 loss=training.get("loss", "recon"),
                 detail_ratio=round((out.std(1).mean() / vy.std(1).mean()).item(), 3),
                 hidden=_activity(model, vx))
    return entry


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--sigma", type=float, default=20.0)
    ap.add_argument("--variants", default="ssda1,ssda2,ssda3,mlp")
    ap.add_argument("--seeds", default="0", help="comma-separated; held_out_db is their mean")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ssda_variants.json"))
    ap.add_argument("--merge", action="store_true",
                    help="keep the other variants of --out when it has the same steps, sigma "
                         "and seeds (to run variants one at a time)")
    args = ap.parse_args(argv)
    import numpy as np
    import torch
    torch.set_num_threads(1)
    known = _variants()
    keys, seeds = args.variants.split(","), [int(s) for s in args.seeds.split(",")]
    unknown = [k for k in keys if k not in known]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(known)}")
    x, y = (torch.from_numpy(a) for a in _pairs(args.sigma))
    vx, vy, x, y = x[-2000:], y[-2000:], x[:-2000], y[:-2000]

    def psnr(a, b):
        return float(-10 * np.log10(((a - b) ** 2).mean().item()))
    img = vx.reshape(-1, 1, 16, 16)
    mean3 = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(img, (1, 1, 1, 1),
                                                                   mode="replicate"), 3, 1)
    results = {"date": datetime.date.today().isoformat(), "pairs": len(x) + 2000,
               "held_out": 2000, "steps": args.steps, "batch": 64, "sigma": args.sigma,
               "seeds": seeds, "noisy_db": round(psnr(vx, vy), 2),
               "mean_3x3_db": round(psnr(mean3.reshape(len(vx), -1), vy), 2),
               "patch_mean_db": round(psnr(vy.mean(1, keepdim=True).expand_as(vy), vy), 2),
               "variants": {}}
    old = json.loads(Path(args.out).read_text()) if args.merge and Path(args.out).is_file() \
        else {}
    if all(old.get(k) == results[k] for k in ("steps", "sigma", "seeds", "pairs")):
        results["variants"] = old.get("variants", {})
    print(f"noisy {results['noisy_db']} dB, 3x3 mean {results['mean_3x3_db']} dB, "
          f"each clean patch's mean {results['patch_mean_db']} dB", flush=True)
    for key in keys:
        name, make, training = known[key]
        runs = [_run(make, training, x, y, vx, vy, args.steps, s, psnr) for s in seeds]
        entry = {"name": name, "date": results["date"], **runs[0]}
        if len(seeds) > 1:
            entry["held_out_db_per_seed"] = [r["held_out_db"] for r in runs]
            entry["held_out_db"] = round(float(np.mean(entry["held_out_db_per_seed"])), 2)
            entry["seconds"] = round(sum(r["seconds"] for r in runs), 1)
        results["variants"][key] = entry
        print(f"{key}: {entry['held_out_db']:.2f} dB ({entry['steps']} steps, "
              f"detail {entry['detail_ratio']}) {name}", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))    # after every variant


if __name__ == "__main__":
    main()
