"""Small models with awkward parameter sizes, and the single-process reference trainer (the oracle)."""
from __future__ import annotations

import contextlib
from typing import Dict, List, Tuple

import torch


class AwkwardNet(torch.nn.Module):
    """Parameters of 1, 7, 93, 1023 elements and a non-contiguous (transposed) weight."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((1,), 1.3))
        self.lin = torch.nn.Linear(11, 93)                               # weight: 1023 elements
        self.wt = torch.nn.Parameter(torch.randn(7, 93).mul_(0.2).t())   # (93, 7), non-contiguous
        self.b7 = torch.nn.Parameter(torch.randn(7) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return (h @ self.wt + self.b7) * self.scale


def make_model(seed: int = 0) -> AwkwardNet:
    torch.manual_seed(seed)
    return AwkwardNet()


class DeepMLP(torch.nn.Module):
    """Registration order == forward order, so gradients arrive in bucket order (reverse registration)."""

    def __init__(self, layers: int = 6) -> None:
        super().__init__()
        dims = [11] + [17] * (layers - 1) + [7]
        self.layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh())
                                            for a, b in zip(dims[:-1], dims[1:])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def make_mlp(seed: int = 0) -> DeepMLP:
    torch.manual_seed(seed)
    return DeepMLP()


def batch(step: int, rank: int, micro: int, micro_batch_size: int = 4) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    x = torch.randn(micro_batch_size, 11, generator=g)
    y = torch.randn(micro_batch_size, 7, generator=g)
    return x, y


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def reference_training(dp: int, micro_batches: int, steps: int, lr: float, weight_decay: float, clip: float,
                       optimizer: str = "adam", factory=make_model) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    """Single process, global batch = concatenation of every rank's micro-batches."""
    model = factory()
    groups = param_groups(model, weight_decay)
    if optimizer == "adam":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    else:
        opt = torch.optim.SGD(groups, lr=lr, momentum=0.9)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        xs, ys = zip(*[batch(step, r, i) for r in range(dp) for i in range(micro_batches)])
        x, y = torch.cat(xs), torch.cat(ys)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def odo_train_step(model, opt, step: int, rank: int, micro_batches: int, use_no_sync: bool = True):
    """One step; ``use_no_sync=False`` synchronises every micro-batch (megatron's schedules without a no_sync_func,
    i.e. Megatron-LM without --overlap-grad-reduce)."""
    for i in range(micro_batches):
        x, y = batch(step, rank, i)
        ctx = model.no_sync() if use_no_sync and i < micro_batches - 1 else contextlib.nullcontext()
        with ctx:
            loss = torch.nn.functional.mse_loss(model(x), y) / micro_batches
            opt.scale_loss(loss).backward()
    model.finish_grad_sync()
    out = opt.step()
    opt.zero_grad()
    return out


class TiedNet(torch.nn.Module):
    """A tied embedding read again by the output projection (outside its owner), one block called twice, and a
    second block optionally recomputed (reentrant checkpoint, like megatron's full recomputation; a block called
    twice cannot be: its second recomputed backward would accumulate its gradients again)."""

    VOCAB, DIM = 13, 12

    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        self.recompute = recompute
        self.emb = torch.nn.Embedding(self.VOCAB, self.DIM)
        self.block = torch.nn.Sequential(torch.nn.Linear(self.DIM, 2 * self.DIM), torch.nn.Tanh(),
                                         torch.nn.Linear(2 * self.DIM, self.DIM))
        self.block2 = torch.nn.Sequential(torch.nn.Linear(self.DIM, 2 * self.DIM), torch.nn.GELU(),
                                          torch.nn.Linear(2 * self.DIM, self.DIM))
        self.norm = torch.nn.LayerNorm(self.DIM)

    def _block2(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.block2(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for _ in range(2):   # the same block twice
            h = h + self.block(h)
        if self.recompute:
            h = torch.utils.checkpoint.checkpoint(self._block2, h, use_reentrant=True)
        else:
            h = self._block2(h)
        return torch.nn.functional.linear(self.norm(h), self.emb.weight)   # tied output layer


def make_tied(seed: int = 0, recompute: bool = False) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet(recompute)


def token_batch(step: int, rank: int, micro: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + 1000 * step + 100 * rank + micro)
    return (torch.randint(0, TiedNet.VOCAB, (3, 5), generator=g),
            torch.randint(0, TiedNet.VOCAB, (3, 5), generator=g))


def tied_loss(model, tokens, targets) -> torch.Tensor:
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reference_tied(dp: int, micro_batches: int, steps: int, lr: float, weight_decay: float, clip: float,
                   optimizer: str = "adam") -> Dict[str, torch.Tensor]:
    """Single process on the concatenated global batch (no recomputation: the same math)."""
    model = make_tied()
    groups = param_groups(model, weight_decay)
    opt = (torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8) if optimizer == "adam"
           else torch.optim.SGD(groups, lr=lr, momentum=0.9))
    for step in range(steps):
        opt.zero_grad()
        toks, tgts = zip(*[token_batch(step, r, i) for r in range(dp) for i in range(micro_batches)])
        tied_loss(model, torch.cat(toks), torch.cat(tgts)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def odo_tied_step(model, opt, step: int, rank: int, micro_batches: int):
    for i in range(micro_batches):
        tokens, targets = token_batch(step, rank, i)
        ctx = model.no_sync() if i < micro_batches - 1 else contextlib.nullcontext()
        with ctx:
            opt.scale_loss(tied_loss(model, tokens, targets) / micro_batches).backward()
    model.finish_grad_sync()
    out = opt.step()
    opt.zero_grad()
    return out
