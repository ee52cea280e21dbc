"""A float64 reference of Muon with the recipe's parts, written from the papers'
formulas, for the tests (independent of gradkit's code):

- Muon (Keller Jordan; torch.optim.Muon): momentum, Nesterov, the Newton-Schulz
  iteration X <- a X + (b A + c A A) X with A = X Xt, on the wide orientation;
- Polar Express (arXiv 2505.16932): one (a, b, c) triple per iteration, and the
  input divided by 1.01 ||X|| + eps instead of max(||X||, eps);
- MuonEq (arXiv 2603.28254): each row of the input scaled to the mean row norm
  ||X|| / sqrt(rows) before the normalisation;
- Muon+ (arXiv 2602.21545): the result scaled to Frobenius norm sqrt(min(m, n));
- NorMuon (arXiv 2510.05491): an EMA (beta2) of the result's mean square per row
  (rows >= cols) or per column, the result divided by its square root and scaled
  back to the Frobenius norm it had;
- cautious weight decay (arXiv 2510.12402): the decay applied only where the update
  and the weight agree in sign, w -= lr' (O + wd w [O w >= 0]).

Everything is float64. With `bf16=True` the values are rounded to bfloat16 where the
recipe's definition holds them in bfloat16 (the Newton-Schulz input, its norm and
divisor, MuonEq's scale, each product's result), as torch's bf16 tensors round them:
the float64 arithmetic between those roundings is exact to the comparison's eye, so
gradkit's bf16 products are then held to the order in which they accumulate only.
"""
import math

import torch

F64 = torch.float64


def _bf16(x):
    return x.to(torch.bfloat16).to(F64)


def _same(x):
    return x


def orthogonalise(u, *, triples, ns_steps, eps, divisor="clamp", equilibrate_rows=False, bf16=True):
    """The Newton-Schulz result of one rows x cols matrix `u` (float64)."""
    r = _bf16 if bf16 else _same
    x = r(u.to(F64))
    rows = x.shape[0]
    if equilibrate_rows:
        target = x.norm() / math.sqrt(rows)
        row_norm = x.norm(dim=1, keepdim=True).clamp(min=1e-6)
        x = r(x * r(target / row_norm))
    n = r(x.norm())
    d = r(n.clamp(min=eps)) if divisor == "clamp" else r(r(1.01 * n) + eps)
    x = r(x / d)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for s in range(ns_steps):
        a, b, c = triples[min(s, len(triples) - 1)]
        gram = r(x @ x.T)
        poly = r(c * (gram @ gram) + b * gram)
        x = r(a * x + poly @ x)
    return x.T if tall else x


def scale_result(o, second, *, renormalize, beta2):
    """Muon+'s and NorMuon's scales of the result `o` (rows x cols); `second` (the NorMuon
    state, max(rows, cols) values, float64) is updated in place where given."""
    rows, cols = o.shape
    if renormalize:
        o = o * (math.sqrt(min(rows, cols)) / o.norm().clamp(min=1e-6))
    if second is None:
        return o
    per_row = rows >= cols
    axis, other = (1, cols) if per_row else (0, rows)
    v = (o * o).mean(dim=axis)                       # the mean square of each line
    norm = (v.sum() * other).sqrt()                  # ||o||
    second.add_((1 - beta2) * (v - second))          # EMA
    step = second.clamp(min=1e-10).rsqrt()
    scaled = (v * other * step * step).sum().sqrt()  # ||o / sqrt(second)||
    line = step * (norm / scaled.clamp(min=1e-10))
    return o * (line[:, None] if per_row else line[None, :])


def adjusted_lr(lr, rows, cols, adjust="original"):
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


class MuonRecipe:
    """The reference's state for one parameter (2-D or a 3-D stack), float64, and its step.
    Options as gradkit.torch.Muon's group keys; `triples` the coefficients' list."""

    def __init__(self, shape, *, lr, weight_decay, momentum=0.95, nesterov=True, triples=((3.4445, -4.775, 2.0315),),
                 eps=1e-7, ns_steps=5, adjust="original", divisor="clamp", equilibrate_rows=False,
                 renormalize=False, beta2=None, cautious_weight_decay=False, bf16=True):
        self.shape = tuple(shape)
        self.options = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                            triples=[tuple(t) for t in triples], eps=eps, ns_steps=ns_steps, adjust=adjust,
                            divisor=divisor, equilibrate_rows=equilibrate_rows, renormalize=renormalize, beta2=beta2,
                            cautious_weight_decay=cautious_weight_decay, bf16=bf16)
        batch = () if len(shape) == 2 else (shape[0],)
        rows, cols = shape[-2:]
        self.buf = torch.zeros(shape, dtype=F64)
        self.second = torch.zeros(batch + (max(rows, cols),), dtype=F64) if beta2 is not None else None
        self.result = None  # the last step's scaled Newton-Schulz result, shaped as the parameter

    def step(self, w, g, grad_dtype=torch.float32):
        """The new weights (float64) from weights `w` and gradient `g` (any dtype); updates
        the momentum and second moment. `grad_dtype`: Nesterov's result is in it (torch's
        grad.lerp(buf))."""
        o = self.options
        g = g.to(F64)
        w = w.to(F64)
        self.buf += (1 - o["momentum"]) * (g - self.buf)
        u = (g + o["momentum"] * (self.buf - g)).to(grad_dtype).to(F64) if o["nesterov"] else self.buf.clone()
        if len(self.shape) == 2:
            new, self.result = self._matrix(w, u, self.second)
            return new
        out = [self._matrix(w[e], u[e], None if self.second is None else self.second[e]) for e in range(self.shape[0])]
        self.result = torch.stack([r for _, r in out])
        return torch.stack([n for n, _ in out])

    def _matrix(self, w, u, second):
        """(the new weights, the scaled result) of one matrix."""
        o = self.options
        rows, cols = w.shape
        x = orthogonalise(u, triples=o["triples"], ns_steps=o["ns_steps"], eps=o["eps"], divisor=o["divisor"],
                          equilibrate_rows=o["equilibrate_rows"], bf16=o["bf16"])
        x = scale_result(x, second, renormalize=o["renormalize"], beta2=o["beta2"])
        lr = adjusted_lr(o["lr"], rows, cols, o["adjust"])
        if o["cautious_weight_decay"]:
            return w - lr * x - lr * o["weight_decay"] * w * ((x * w) >= 0), x
        return w * (1 - o["lr"] * o["weight_decay"]) - lr * x, x


class AdamWReference:
    """torch.optim.AdamW's step (decoupled decay, bias correction) in float64."""

    def __init__(self, shape, *, lr, betas, eps, weight_decay):
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.m = torch.zeros(shape, dtype=F64)
        self.v = torch.zeros(shape, dtype=F64)
        self.t = 0

    def step(self, w, g):
        b1, b2 = self.betas
        g, w = g.to(F64), w.to(F64)
        self.t += 1
        self.m += (1 - b1) * (g - self.m)
        self.v += (1 - b2) * (g * g - self.v)
        w = w * (1 - self.lr * self.weight_decay)
        denom = (self.v / (1 - b2 ** self.t)).sqrt() + self.eps
        return w - self.lr / (1 - b1 ** self.t) * self.m / denom
