"""A rank's model in FP8 (services/engine/layers/fp8.py's layers on the rank's shapes).

The rank's model is built as in bf16 (services/engine/parallel/model.py) and converted on the meta
device: every attention/MLP linear and the shared experts' tensor-parallel linears become
Fp8Linears of the rank's shape (a row-parallel one sums its partial products over the tp group
after the fp8 GEMM), and the routed experts (the rank's own under expert parallel, every expert's
slice of the width under tensor parallel) become Fp8Experts. lm_head, routers, norms, embeddings and
MLA's kv_b_proj stay in the engine dtype, as on one rank.

A rank's tiles are the single-rank engine's tiles: every tensor-parallel cut of an FP8 weight falls
on a 128 boundary (checked when the rank reads its slices: services/common/weights_slice.py), so a
rank holds exactly the 128x128 blocks (bits and scales) that one rank would hold for its rows or
columns, whether it copies an FP8 checkpoint's pairs or quantises a high-precision weight at load.
"""

from __future__ import annotations

import torch
from torch import nn

from ops.fp8.dispatch import fp8_matmul
from services.engine.layers.fp8 import Fp8Linear, convert_model
from services.engine.parallel.linear import ColumnParallelLinear, RowParallelLinear


class Fp8RowParallelLinear(Fp8Linear):
    """RowParallelLinear with an fp8 weight slice [out, in_local]: the rank's partial product
    through the fp8 GEMM, summed over the group, the bias added once after the sum."""

    def __init__(self, src: RowParallelLinear) -> None:
        w = src.weight
        super().__init__(w.shape[1], w.shape[0], src.bias is not None, w.dtype, device=w.device)
        self.group = src.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_matmul(
            x, self.weight_fp8, self.weight_scale, self.out_dtype, self.pow2_scales, self.backend
        )
        y = self.group.all_reduce(out.contiguous())
        return y if self.bias is None else y + self.bias


def convert_parallel_model(model: nn.Module) -> None:
    """The rank's model (on the meta device, already in its dtype) in the FP8 layout, in place;
    the weights are loaded after materialising (layers/fp8.load_hf_state)."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, RowParallelLinear):
            new: nn.Module = Fp8RowParallelLinear(mod)
        elif isinstance(mod, ColumnParallelLinear):
            w = mod.weight
            new = Fp8Linear(w.shape[1], w.shape[0], mod.bias is not None, w.dtype, device=w.device)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    convert_model(model, empty=True)  # the remaining nn.Linears and the ExpertWeights
