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
A Mamba-2 `in_proj` ([z | x | B | C | dt] rows, a rank holding its part of each) may give a rank
a tile that is part of a whole-projection tile (the dt rows of its heads): its scale is that whole
tile's, so from a high-precision weight the rank quantises the whole tiles its rows lie in and
keeps its rows (`mamba_in_proj_pairs`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ops.fp8.dispatch import fp8_matmul
from ops.fp8.recipe import FP8_DTYPE
from services.common.weights_dir import SCALE_SUFFIX, WeightsReader
from services.common.weights_slice import SliceSpec
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


def mamba_in_proj_pairs(
    model: nn.Module, state: dict[str, torch.Tensor], path: str | Path, spec: SliceSpec, block: int = 128
) -> None:
    """Replace each high-precision Mamba-2 `in_proj` weight of the rank's `state` by the FP8 pair
    (bits, scales) the single-rank engine holds for its rows, in place: the whole-projection
    tiles its rows lie in (SliceSpec.mamba_tiles) read from `path` and quantised by the rank's
    Fp8Linear, its rows' bits and those tiles' scales kept."""
    names = [k for k in state if k.endswith(".mixer.in_proj.weight") and state[k].dtype != FP8_DTYPE]
    if spec.tp_size == 1 or not names:
        return
    reader = WeightsReader.open(path)
    for name in names:
        mod = model.get_submodule(name[: -len(".weight")])
        assert isinstance(mod, Fp8Linear)
        n = reader.entries[name].shape[0]
        tiles = spec.mamba_tiles(name, n, block)
        whole = sorted(set(tiles))
        parts = [reader.tensor(name, (t * block, min(n, (t + 1) * block)), 0) for t in whole]
        quantised = [mod.quantize(p.to(mod.weight_fp8.device)) for p in parts]
        # Each of the rank's rows' place among the quantised tiles' rows.
        start = torch.zeros(whole[-1] + 1, dtype=torch.long)
        start[torch.tensor(whole)] = torch.tensor([0] + [len(p) for p in parts[:-1]]).cumsum(0)
        runs = spec.mamba_rows(name)
        assert runs is not None
        orig = torch.cat([torch.arange(a, b) for a, b in runs])
        place = start[orig // block] + orig % block
        state[name] = torch.cat([q for q, _ in quantised])[place.to(mod.weight_fp8.device)]
        index = {t: i for i, t in enumerate(whole)}
        state[name + SCALE_SUFFIX] = torch.cat([quantised[index[t]][1] for t in tiles])
