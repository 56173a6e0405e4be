"""Nonlinear conjugate gradient (Polak–Ribière+, restarts, backtracking Armijo line search).

The thesis found CG the best optimizer for its FC net. Like ``torch.optim.LBFGS`` it needs a
closure that re-evaluates the loss (and its gradients); one ``step(closure)`` runs up to
``max_iter`` CG iterations on that objective: many on a full batch, a few on a mini-batch.

    d_0 = −g_0;  x_{k+1} = x_k + t_k d_k  (t_k: Armijo backtracking)
    β_k = max(0, g_{k+1}·(g_{k+1} − g_k) / g_k·g_k)        (PR+: β = 0 restarts)
    d_{k+1} = −g_{k+1} + β_k d_k, reset to −g_{k+1} every ``restart`` iterations or when it is
    not a descent direction.
"""

from __future__ import annotations

import torch

__all__ = ["NonlinearCG"]


class NonlinearCG(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1.0, max_iter: int = 10, restart: int | None = None,
                 c1: float = 1e-4, shrink: float = 0.5, max_ls: int = 25,
                 tolerance_grad: float = 1e-9):
        if lr <= 0 or max_iter < 1 or not 0 < c1 < 1 or not 0 < shrink < 1:
            raise ValueError(f"NonlinearCG needs lr > 0, max_iter >= 1, 0 < c1 < 1 and "
                             f"0 < shrink < 1; got lr={lr}, max_iter={max_iter}, c1={c1}, "
                             f"shrink={shrink}")
        super().__init__(params, dict(lr=lr, max_iter=max_iter, restart=restart, c1=c1,
                                      shrink=shrink, max_ls=max_ls, tolerance_grad=tolerance_grad))
        if len(self.param_groups) != 1:
            raise ValueError("NonlinearCG supports a single parameter group")
        self._params = self.param_groups[0]["params"]

    def _flat_grad(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self._params])

    def _add(self, t: float, d: torch.Tensor) -> None:
        offset = 0
        for p in self._params:
            n = p.numel()
            p.add_(d[offset:offset + n].view_as(p), alpha=t)
            offset += n

    @torch.no_grad()
    def step(self, closure):
        """closure() must zero the gradients, compute the loss, call backward and return it."""
        group = self.param_groups[0]
        evaluate = torch.enable_grad()(closure)
        loss = float(evaluate())
        g = self._flat_grad()
        n_params = g.numel()
        restart = group["restart"] or n_params
        d = -g
        state = self.state.setdefault("cg", {"evals": 0, "restarts": 0})
        # First call: a cautious step, as LBFGS takes; later calls start from the last
        # accepted step length (mini-batch use: a few iterations per batch).
        t = state.get("t") or group["lr"] / max(1.0, float(g.abs().sum()))
        for k in range(group["max_iter"]):
            gtd = float(g @ d)
            if gtd > -group["tolerance_grad"]:
                if float(g.abs().max()) <= group["tolerance_grad"]:
                    break                                      # converged
                d, gtd = -g, -float(g @ g)                     # not a descent direction
                state["restarts"] += 1
            # Backtracking line search on f(x + t d) <= f(x) + c1 t gtd.
            accepted = False
            for _ in range(group["max_ls"]):
                self._add(t, d)
                new_loss = float(evaluate())
                state["evals"] += 1
                if new_loss <= loss + group["c1"] * t * gtd:
                    accepted = True
                    break
                self._add(-t, d)
                t *= group["shrink"]
            if not accepted:
                state["t"] = None                              # start cautious next time
                break                                          # no decrease found: stop here
            state["t"] = t
            g_new = self._flat_grad()
            beta = max(0.0, float(g_new @ (g_new - g)) / max(float(g @ g), 1e-30))
            if (k + 1) % restart == 0:
                beta = 0.0
                state["restarts"] += 1
            d_new = -g_new + beta * d
            new_gtd = float(g_new @ d_new)
            t = t * gtd / new_gtd if new_gtd < 0 else group["lr"]   # Nocedal–Wright initial step
            t = min(t / group["shrink"], 10.0 * group["lr"])        # let the step grow again
            loss, g, d = new_loss, g_new, d_new
        return torch.tensor(loss)
