"""Stacked sparse denoising autoencoder (SSDA) of the thesis (ch. 5, App. B; Xie et al. 2012).

One layer, with tied weights (decoder = encoderᵀ) and sigmoid units:

    h = σ(W x̃ + b),   ŷ = σ(Wᵀ h + b')
    L = 1/N Σ ½‖y − ŷ‖² + β·KL(ρ‖ρ̂) + λ/2·‖W‖²_F                     (eq. 5.3)

where x̃ is the noisy input, y the clean target and ρ̂_j = 1/N Σ_i h_j(x̃_i) the mean activation
of hidden unit j. Greedy layer-wise pretraining trains layer k on the codes of layer k−1
(noisy codes → clean codes); fine-tuning then trains the whole stack, encoders followed by the
tied decoders in reverse order, with L = 1/N Σ ½‖y − ŷ‖² + λ/2·Σ_k ‖W_k‖²_F  (eq. 5.4).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch
from torch import nn

__all__ = ["LayerSpec", "DenoisingLayer", "SSDA", "kl_sparsity", "THESIS_SSDA_LAYERS"]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One hidden layer: width, sparsity weight β, target activation ρ, weight decay λ."""

    hidden: int
    beta: float = 0.01
    rho: float = 0.05
    weight_decay: float = 1e-4

    def __post_init__(self):
        if self.hidden < 1:
            raise ValueError(f"LayerSpec.hidden must be >= 1, got {self.hidden}")
        if not 0 < self.rho <= 1:
            raise ValueError(f"LayerSpec.rho must be in (0, 1], got {self.rho}")
        if self.beta < 0 or self.weight_decay < 0:
            raise ValueError(f"LayerSpec.beta and weight_decay must be >= 0, got "
                             f"{self.beta} and {self.weight_decay}")


# App. B: 1280-1280-256; sparse first two layers, the third without sparsity (β=0, ρ=1).
THESIS_SSDA_LAYERS = (LayerSpec(1280, 0.01, 0.05, 1e-4), LayerSpec(1280, 0.01, 0.05, 1e-4),
                      LayerSpec(256, 0.0, 1.0, 1e-4))


def kl_sparsity(rho_hat: torch.Tensor, rho: float, eps: float = 1e-8) -> torch.Tensor:
    """Σ_j KL(ρ ‖ ρ̂_j) between Bernoulli(ρ) and Bernoulli(ρ̂_j); rho_hat: (hidden,)."""
    rho_hat = rho_hat.clamp(eps, 1 - eps)
    kl = rho * torch.log(rho / rho_hat)
    if rho < 1:
        kl = kl + (1 - rho) * torch.log((1 - rho) / (1 - rho_hat))
    return kl.sum()


class DenoisingLayer(nn.Module):
    """One tied-weight sparse denoising autoencoder: x (B, n_in) -> h (B, hidden)."""

    def __init__(self, n_in: int, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        bound = (6 / (n_in + spec.hidden)) ** 0.5                 # Glorot uniform for sigmoid
        self.weight = nn.Parameter(torch.empty(spec.hidden, n_in).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(spec.hidden))
        self.bias_out = nn.Parameter(torch.zeros(n_in))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x @ self.weight.t() + self.bias)     # (B, in) -> (B, hidden)

    def decode(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(h @ self.weight + self.bias_out)     # (B, hidden) -> (B, in)

    def weight_norm2(self) -> torch.Tensor:
        """‖W‖²_F (a partitioned layer sums its slices')."""
        return (self.weight ** 2).sum()

    def loss(self, noisy: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        """Eq. 5.3 on one mini-batch."""
        h = self.encode(noisy)
        recon = 0.5 * ((self.decode(h) - clean) ** 2).sum(1).mean()
        s = self.spec
        sparsity = s.beta * kl_sparsity(h.mean(0), s.rho) if s.beta > 0 else recon.new_zeros(())
        return recon + sparsity + 0.5 * s.weight_decay * self.weight_norm2()


class SSDA(nn.Module):
    """A stack of DenoisingLayers: x (B, n_in) -> reconstruction (B, n_in)."""

    def __init__(self, n_in: int, layers: Sequence[LayerSpec] = THESIS_SSDA_LAYERS):
        super().__init__()
        if n_in < 1 or not layers:
            raise ValueError(f"SSDA needs n_in >= 1 and at least one layer, got {n_in}, "
                             f"{list(layers)}")
        widths = [n_in] + [s.hidden for s in layers]
        self.n_in = n_in
        self.layers = nn.ModuleList(DenoisingLayer(a, s) for a, s in zip(widths, layers))

    def encode(self, x: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        for layer in self.layers[:depth]:
            x = layer.encode(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(len(x), -1)
        if x.shape[1] != self.n_in:
            raise ValueError(f"SSDA expects {self.n_in} inputs per sample, got {x.shape[1]}")
        h = self.encode(x)
        for layer in reversed(self.layers):
            h = layer.decode(h)
        return h

    def finetune_loss(self, noisy: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        """Eq. 5.4: reconstruction of the whole stack plus weight decay of every layer."""
        recon = 0.5 * ((self(noisy) - clean.reshape(len(clean), -1)) ** 2).sum(1).mean()
        decay = sum(0.5 * l.spec.weight_decay * l.weight_norm2() for l in self.layers)
        return recon + decay

    def pretrain(self, batches_fn, optimizer_fn, epochs: int = 1) -> list[list[float]]:
        """Greedy layer-wise pretraining.

        batches_fn(epoch) -> iterable of (noisy, clean) input batches; optimizer_fn(params) ->
        a torch optimizer. Layer k trains on (encode_{<k}(noisy), encode_{<k}(clean)) with the
        layers below frozen. Returns the mean loss per epoch of every layer.
        """
        history = []
        for k, layer in enumerate(self.layers):
            opt = optimizer_fn(layer.parameters())
            losses = []
            for epoch in range(epochs):
                total, n = 0.0, 0
                for noisy, clean in batches_fn(epoch):
                    with torch.no_grad():
                        noisy_k = self.encode(noisy.reshape(len(noisy), -1), k)
                        clean_k = self.encode(clean.reshape(len(clean), -1), k)
                    opt.zero_grad(set_to_none=True)
                    loss = layer.loss(noisy_k, clean_k)
                    loss.backward()
                    opt.step()
                    total, n = total + loss.item() * len(noisy), n + len(noisy)
                losses.append(total / max(n, 1))
            history.append(losses)
        return history

    def finetune(self, batches: Iterable, optimizer: torch.optim.Optimizer) -> float:
        """One epoch of fine-tuning of the whole stack; returns the mean loss."""
        total, n = 0.0, 0
        for noisy, clean in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = self.finetune_loss(noisy.reshape(len(noisy), -1), clean)
            loss.backward()
            optimizer.step()
            total, n = total + loss.item() * len(noisy), n + len(noisy)
        return total / max(n, 1)
