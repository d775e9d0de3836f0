"""The train step's metric sums, kept on the device and read on the host once per step.

What trainer/train.py reports per step (loss sums, the trainer/inference mismatch, MoE routing
agreement, token count, gradient norm) would, read on the host as each micro-batch finished, cost
four `.item()` calls in the loss between the forward and the backward, seven more and three
boolean-mask gathers (data-dependent shapes) in the mismatch metrics, a host copy per MoE layer,
and the gradient norm before the optimizer step. Each read waits for every kernel queued before
it, so the GPU would run dry while the host launched the next kernels. `StepStats` accumulates
the same sums as device tensors and `read` reduces them across ranks on the device and copies
them to the host in ONE transfer after the optimizer step.

The values are those a Python-float path computes: float32 sums widened exactly to float64, added in
float64 in micro-batch order starting from 0.0 (as Python floats would be), the max as Python's
max(0.0, ...) (torch.fmax also skips NaN), and the same three cross-rank reductions (sum of the
loss sums and token count, sum of the mismatch sums, max of |p_train - p_infer|). The one
difference is inside token_mismatch_tensors: masked-out positions are summed as zeros instead of
gathered out, which changes float64 summation order only (~1e-16 relative).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from trainer.batch import MicroBatch, to_device
from trainer.loss import LossStats
from trainer.mismatch import SUM_FIELDS, MismatchStats, token_mismatch_tensors
from trainer.packing import PackedMicroBatch
from trainer.replay import RoutingRecord

AllReduce = Callable[..., torch.Tensor]  # Dist.all_reduce_: (tensor, op) -> the tensor, reduced in place


class StepStats:
    """Per-step accumulator: `add` once per trained micro-batch, `read` once after the optimizer."""

    def __init__(self, device: torch.device, moe_layers: int) -> None:
        self.device = device
        self.moe_layers = moe_layers
        self.loss = LossStats()
        self.n_tokens = 0  # a host integer: micro-batch sizes are known on the host
        self.mm_sum: torch.Tensor | None = None  # float64 [6], SUM_FIELDS order
        self.mm_max: torch.Tensor | None = None  # float64 [1]
        self.routes: torch.Tensor | None = None  # float64 [3, moe_layers]: agree, total, replayed

    def add(
        self,
        loss: LossStats,
        logp: torch.Tensor,
        mb: MicroBatch | PackedMicroBatch,
        on_policy: torch.Tensor | None,
        rec: RoutingRecord | None = None,
    ) -> None:
        """One micro-batch: its LossStats, its mismatch sums (logp against mb's inference
        log-probs over mb.loss_mask), its routing counts. Queues device work only."""
        self.loss.add(loss)
        sums, mx = token_mismatch_tensors(logp, mb.logp_infer, mb.loss_mask, on_policy)
        # 0.0 + x and max(0.0, x) for the first, as MismatchStats() + add did.
        self.mm_sum = (torch.zeros_like(sums) if self.mm_sum is None else self.mm_sum) + sums
        self.mm_max = torch.fmax(torch.zeros_like(mx) if self.mm_max is None else self.mm_max, mx)
        if rec is not None and rec.total.numel() > 0:
            counts = torch.stack([rec.agree, rec.total, rec.replayed]).to(torch.float64)
            counts = to_device(counts, self.device)  # CPU zeros when nothing was recorded
            self.routes = counts if self.routes is None else self.routes + counts
        self.n_tokens += mb.n_tokens

    def read(
        self, grad_norm: torch.Tensor, all_reduce_: AllReduce, copies: int = 1
    ) -> tuple[LossStats, float, MismatchStats, float]:
        """Reduce across ranks (on the device, `all_reduce_` = Dist.all_reduce_) and copy
        everything to the host at once: (loss stats, tokens, mismatch stats, gradient norm).
        copies: how many ranks computed each sum's terms (trainer.tp: a tp group's ranks train
        the same samples), divided out of the sums."""
        dev, n = self.device, self.moe_layers
        f64 = torch.float64
        zeros = lambda k: torch.zeros(k, dtype=f64, device=dev)  # noqa: E731
        tot = torch.cat(
            [self.loss.as_tensor(dev), torch.full((1,), float(self.n_tokens), dtype=f64, device=dev)]
        )
        routes = self.routes.reshape(-1) if self.routes is not None else zeros(3 * n)
        mm_sum = torch.cat([self.mm_sum if self.mm_sum is not None else zeros(len(SUM_FIELDS)), routes])
        mm_max = self.mm_max if self.mm_max is not None else zeros(1)
        all_reduce_(tot)
        all_reduce_(mm_sum)
        if copies > 1:
            tot /= copies
            mm_sum /= copies
        all_reduce_(mm_max, dist.ReduceOp.MAX)
        host = torch.cat(
            [tot, mm_sum, mm_max, grad_norm.detach().reshape(1).to(device=dev, dtype=f64)]
        ).tolist()
        k = len(tot) + len(mm_sum)
        mismatch = MismatchStats.from_tensors(
            torch.tensor(host[len(tot) : k], dtype=f64), torch.tensor(host[k : k + 1], dtype=f64), n
        )
        return LossStats(*host[:4]), host[4], mismatch, host[-1]
