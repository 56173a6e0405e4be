"""Stacked sparse denoising autoencoder (SSDA) of the thesis (ch. 5, App. B; Xie et al. 2012).

One layer, with tied weights (decoder = encoderᵀ) and sigmoid units:

    h = σ(W x̃ + b),   ŷ = σ(Wᵀ h + b')
    L = 1/N Σ ½‖y − ŷ‖² + β·KL(ρ‖ρ̂) + λ/2·‖W‖²_F                     (eq. 5.3)

where x̃ is the noisy input, y the clean target and ρ̂_j = 1/N Σ_i h_j(x̃_i) the mean activation
of hidden unit j. Greedy layer-wise pretraining trains layer k on the codes of layer k−1
(noisy codes → clean codes); fine-tuning then trains the whole stack with
L = 1/N Σ ½‖y − ŷ‖² + λ/2·Σ_k ‖W_k‖²_F  (eq. 5.4).

What the stack outputs after pretraining:
  - by default the code of the last layer is decoded back by the tied decoders in reverse order
    (Xie et al. 2012): 1280 → n_in → 1280 → n_in for the one-layer SSDA;
  - a last layer with ``LayerSpec(output=True)`` is the output itself, as in the thesis's stack
    (App. B, THESIS_SSDA_LAYERS): its 256 units are the 16×16 denoised patch (eq. 5.4 compares
    the final layer's f with y; the cascade's F1-F3 are 256→1280→1280→256), so the network is
    256-1280-1280-256 and has no decoders. Pretraining still trains it as an autoencoder of the
    codes below (App. B counts 2×1280×256 pretraining weights for it); fine-tuning makes its
    units the patch. (Decoding that stack's 256-unit code back through two more 1280-unit
    sigmoid layers instead learns only each patch's mean: docs/design/0040-ssda-one-layer.md.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
from torch import nn

__all__ = ["SSDA", "THESIS_SSDA_LAYERS", "DenoisingLayer", "LayerSpec", "app_b_layers",
           "kl_sparsity"]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer: width, sparsity weight β, target activation ρ, weight decay λ; init_gain
    scales the Glorot-uniform bound √(6/(n_in + hidden)) of its initial weights (1: the bound
    for tanh units; 4: the bound for sigmoid units, which the hidden layers of a stack need to
    pass their input's detail up at all); output: the layer's units are the network's output
    (the last layer only, as wide as the input; see the module docstring)."""

    hidden: int
    beta: float = 0.01
    rho: float = 0.05
    weight_decay: float = 1e-4
    init_gain: float = 1.0
    output: bool = False

    def __post_init__(self):
        if self.hidden < 1:
            raise ValueError(f"LayerSpec.hidden must be >= 1, got {self.hidden}")
        if not 0 < self.rho <= 1:
            raise ValueError(f"LayerSpec.rho must be in (0, 1], got {self.rho}")
        if self.beta < 0 or self.weight_decay < 0:
            raise ValueError(f"LayerSpec.beta and weight_decay must be >= 0, got "
                             f"{self.beta} and {self.weight_decay}")
        if not self.init_gain > 0:
            raise ValueError(f"LayerSpec.init_gain must be > 0, got {self.init_gain}")


def app_b_layers(widths: Sequence[int], n_in: int) -> tuple[LayerSpec, ...]:
    """App. B's settings for layers of the given widths: λ = 1e-4 everywhere, the layers below
    the last sparse (β = 0.01, ρ = 0.05), the last without sparsity (β = 0, ρ = 1). A last
    layer as wide as the input above at least one other (App. B's third layer, 256 units for
    16×16 patches) is the output layer, and the layers below it get the sigmoid init
    (init_gain 4; the output layer keeps 1). A single layer, or a last layer of another width,
    is a code for the tied decoders, every init_gain 1 (the one-layer SSDA of the quality runs).
    The thesis gives no initialisation; these are the ones measured best in docs/design/0040-ssda-one-layer.md."""
    widths = [int(w) for w in widths]
    if not widths:
        raise ValueError("app_b_layers needs at least one width, got none")
    out = len(widths) > 1 and widths[-1] == n_in
    gain = 4.0 if out else 1.0
    return tuple(LayerSpec(w, 0.01, 0.05, 1e-4, gain) for w in widths[:-1]) + \
        (LayerSpec(widths[-1], 0.0, 1.0, 1e-4, output=out),)


# App. B: 256-1280-1280-256 on 16×16 patches; sparse first two layers, the third (the output,
# the denoised patch) without sparsity (β=0, ρ=1).
THESIS_SSDA_LAYERS = app_b_layers((1280, 1280, 256), 256)


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
        bound = spec.init_gain * (6 / (n_in + spec.hidden)) ** 0.5   # Glorot uniform × gain
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
    """A stack of DenoisingLayers: x (B, n_in) -> reconstruction (B, n_in). ``layers``: None
    for the thesis's 1280-1280-n_in (THESIS_SSDA_LAYERS for n_in = 256)."""

    def __init__(self, n_in: int, layers: Sequence[LayerSpec] | None = None):
        super().__init__()
        if layers is None:
            layers = app_b_layers((1280, 1280, n_in), n_in)
        if n_in < 1 or not layers:
            raise ValueError(f"SSDA needs n_in >= 1 and at least one layer, got {n_in}, "
                             f"{list(layers)}")
        for k, s in enumerate(layers):
            if s.output and (k != len(layers) - 1 or s.hidden != n_in):
                raise ValueError(f"only the last layer can be the output layer, and it must be "
                                 f"as wide as the input ({n_in}); got output=True on layer "
                                 f"{k + 1} of {len(layers)}, width {s.hidden}")
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
        if self.layers[-1].spec.output:              # the last layer's units are the patch
            return h
        for layer in reversed(self.layers):
            h = layer.decode(h)
        return h

    def finetune_loss(self, noisy: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        """Eq. 5.4: reconstruction of the whole stack plus weight decay of every layer."""
        recon = 0.5 * ((self(noisy) - clean.reshape(len(clean), -1)) ** 2).sum(1).mean()
        decay = sum(0.5 * layer.spec.weight_decay * layer.weight_norm2() for layer in self.layers)
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
