"""Training the super-resolution stages with the distributed engines (``spark_dl.fit``), on the
patch pairs of prepare.py (columns ``lr``, ``lr_clean``, ``hr``):

    stage 1  SSDA denoiser, noisy LR -> clean LR: greedy layer-wise pretraining (layer k on the
             codes of the layers below, eq. 5.3), then fine-tuning of the stack (eq. 5.4)
    stage 2  SRCNN on the bicubic upscale of the denoised LR -> HR (the SSDA frozen)
    stage 3  the cascade SSDA -> bicubic -> SRCNN fine-tuned end to end, noisy LR -> HR

Every stage is one or more ``fit`` calls, so it runs with ``strategy="allreduce"`` or
``"downpour"`` on the executors' partitions. The weight decay of eqs. 5.3-5.4 is the optimizer's
(it also decays the biases, which the equations leave alone).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from ..models.srcnn import SRCNN
from ..models.ssda import SSDA, THESIS_SSDA_LAYERS, kl_sparsity
from .cascade import Cascade, Upscaler

__all__ = ["finetune_cascade", "train_cnn", "train_cnn_on_clean", "train_ssda"]


def _encoder(ssda: SSDA, depth: int):
    """SSDA.encode through the first ``depth`` layers, frozen (a copy, kept out of any module's
    parameters so that nothing trains it)."""
    frozen = copy.deepcopy(ssda).requires_grad_(False)
    return lambda x: frozen.to(x.dtype).encode(x, depth)


class _LayerStep(nn.Module):
    """Pretraining of one layer: noisy LR -> [reconstruction of the clean code | hidden code]."""

    def __init__(self, ssda: SSDA, k: int):
        super().__init__()
        self.encode_below = _encoder(ssda, k)
        self.layer = copy.deepcopy(ssda.layers[k])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            code = self.encode_below(x.reshape(len(x), -1))
        h = self.layer.encode(code)
        return torch.cat([self.layer.decode(h), h], 1)


def _layer_loss(ssda: SSDA, k: int):
    """Eq. 5.3 without the weight decay (the optimizer's), against the clean code."""
    layer = ssda.layers[k]
    encode, n_in, spec = _encoder(ssda, k), layer.bias_out.numel(), layer.spec

    def loss(out: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = encode(clean.reshape(len(clean), -1))
        recon, h = out[:, :n_in], out[:, n_in:]
        total = 0.5 * ((recon - target) ** 2).sum(1).mean()
        if spec.beta > 0:
            total = total + spec.beta * kl_sparsity(h.mean(0), spec.rho)
        return total
    return loss


def _half_squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out.reshape(len(out), -1) - target.reshape(len(target), -1)) ** 2) \
        .sum(1).mean()


def train_ssda(df, lr_size: int = 16, layers=THESIS_SSDA_LAYERS, pretrain_epochs: int = 1,
               finetune_epochs: int = 1, lr: float = 1e-3, batch_size: int = 64,
               strategy: str = "allreduce", optimizer: str = "adam", log=print,
               **fit_kw) -> tuple[SSDA, list]:
    """Stage 1 on columns lr (features) and lr_clean (targets); returns the SSDA and the
    histories of every fit (one per pretrained layer, then the fine-tuning). ``run_dir`` (in
    fit_kw) holds one run directory per fit: ssda-layer1, ..., ssda-finetune."""
    from ..fit import fit
    n = lr_size * lr_size
    ssda = SSDA(n, layers)
    kw = dict(strategy=strategy, features="lr", label="lr_clean", shape=(n,), label_shape=(n,),
              batch_size=batch_size, lr=lr, optimizer=optimizer, log=log, **fit_kw)
    histories = []
    run_root = kw.pop("run_dir", None)         # one run directory per fit, under run_dir

    def run_dir(name):
        return None if run_root is None else Path(run_root) / name
    for k, layer in enumerate(ssda.layers):
        step = _LayerStep(ssda, k)
        res = fit(df, lambda step=step: copy.deepcopy(step), loss=_layer_loss(ssda, k),
                  epochs=pretrain_epochs, weight_decay=layer.spec.weight_decay,
                  run_dir=run_dir(f"ssda-layer{k + 1}"), **kw)
        layer.load_state_dict(res.model.layer.state_dict())
        histories.append(res.history)
    if finetune_epochs:
        decay = layers[0].weight_decay
        res = fit(df, lambda: copy.deepcopy(ssda), loss=_half_squared_error,
                  epochs=finetune_epochs, weight_decay=decay, run_dir=run_dir("ssda-finetune"),
                  **kw)
        ssda.load_state_dict(res.model.state_dict())
        histories.append(res.history)
    return ssda, histories


def _fit_to_hr(df, model: nn.Module, features: str, lr_size: int, scale: int, **fit_kw):
    """Train ``model`` (an LR patch of column ``features`` -> the HR patch of column hr) with
    the mean squared error: the fit of stages 2 and 3."""
    from ..fit import fit
    hr = lr_size * scale
    return fit(df, lambda: copy.deepcopy(model), loss="mse", features=features, label="hr",
               shape=(lr_size * lr_size,), label_shape=(1, hr, hr), **fit_kw)


def train_cnn(df, ssda: SSDA, lr_size: int = 16, scale: int = 2, epochs: int = 1,
              lr: float = 1e-3, batch_size: int = 64, strategy: str = "allreduce",
              optimizer: str = "adam", log=print, residual: bool = False,
              noisy_skip: bool = False, **fit_kw) -> tuple[Cascade, list]:
    """Stage 2: SRCNN on bicubic(SSDA(noisy LR)) -> HR, the SSDA frozen; columns lr, hr.
    Returns the "conventional" pipeline (the stages trained apart) as a Cascade.
    ``residual``: the SRCNN learns the detail added to its input (see models.srcnn);
    ``noisy_skip``: it also sees bicubic(noisy LR) (see superres.cascade)."""
    cnn = SRCNN(residual=residual, inputs=2 if noisy_skip else 1)
    model = Cascade(lr_size, scale, copy.deepcopy(ssda), cnn)
    for p in model.ssda.parameters():
        p.requires_grad_(False)
    res = _fit_to_hr(df, model, "lr", lr_size, scale, epochs=epochs, lr=lr,
                     batch_size=batch_size, strategy=strategy, optimizer=optimizer, log=log,
                     **fit_kw)
    return res.model, res.history


def train_cnn_on_clean(df, lr_size: int = 16, scale: int = 2, epochs: int = 1,
                       lr: float = 1e-3, batch_size: int = 64, strategy: str = "allreduce",
                       optimizer: str = "adam", log=print, residual: bool = False,
                       **fit_kw) -> tuple[SRCNN, list]:
    """An SRCNN for super-resolution alone: bicubic(clean LR) -> HR, columns lr_clean, hr (the
    published SRCNN's training). After the SSDA, trained alone too, it is the thesis's
    "conventional" method (SSDA [XXC12] + CNN [DLHT14], Table 5.1)."""
    model = Upscaler(lr_size, scale, SRCNN(residual=residual))
    res = _fit_to_hr(df, model, "lr_clean", lr_size, scale, epochs=epochs, lr=lr,
                     batch_size=batch_size, strategy=strategy, optimizer=optimizer, log=log,
                     **fit_kw)
    return res.model.cnn, res.history


def finetune_cascade(df, ssda: SSDA, cnn: SRCNN, lr_size: int = 16, scale: int = 2,
                     epochs: int = 1, lr: float = 1e-4, batch_size: int = 64,
                     strategy: str = "allreduce", optimizer: str = "adam", log=print,
                     **fit_kw) -> tuple[Cascade, list]:
    """Stage 3: the whole cascade, noisy LR -> HR, every parameter trained (also those of an
    SSDA taken from a stage-2 pipeline, where it was frozen)."""
    model = Cascade(lr_size, scale, copy.deepcopy(ssda), copy.deepcopy(cnn)).requires_grad_(True)
    res = _fit_to_hr(df, model, "lr", lr_size, scale, epochs=epochs, lr=lr,
                     batch_size=batch_size, strategy=strategy, optimizer=optimizer, log=log,
                     **fit_kw)
    return res.model, res.history
