"""Tensor-parallel linears (Megatron's split): a column-parallel linear keeps a slice of the output
features (no communication: its output stays split), a row-parallel linear a slice of the input
features (its partial products are summed over the group). Pairing them, column then row, costs
one all-reduce per block: attention's q/k/v then o_proj, the MLP's gate/up then down_proj.

Weights load from the full (HF-layout) tensor: each rank copies only its slice (`load_full`), so
a weight update touches as many bytes per rank as the rank holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.parallel.group import RankGroup


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` of `n` items split evenly over `parts` (parts divides n)."""
    if n % parts:
        raise ValueError(f"{n} does not split evenly over {parts} ranks")
    size = n // parts
    return index * size, (index + 1) * size


def kv_head_range(n_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """The KV heads rank `rank` of a tp group keeps: its share when there are at least tp KV
    heads, else the one head its run of tp / n_kv_heads ranks shares (replicated)."""
    if n_kv_heads >= tp:
        return split_range(n_kv_heads, tp, rank)
    if tp % n_kv_heads:
        raise ValueError(f"tp ({tp}) must divide n_kv_heads ({n_kv_heads}) or be a multiple of it")
    head = rank // (tp // n_kv_heads)
    return head, head + 1


class ColumnParallelLinear(nn.Module):
    """y[:, out_slice] = x W[out_slice].T (+ b[out_slice]); the output stays split."""

    def __init__(self, in_features: int, out_local: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_local, in_features))
        self.bias = nn.Parameter(torch.zeros(out_local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy the rows `rows` (indices into the full output features) of the full weight/bias."""
        self.weight.copy_(weight[rows].to(self.weight))
        if self.bias is not None:
            assert bias is not None
            self.bias.copy_(bias[rows].to(self.bias))


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[:, in_slice] W[:, in_slice].T (+ b once, after the sum)."""

    def __init__(self, in_local: int, out_features: int, group: RankGroup, bias: bool = False) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.zeros(out_features, in_local))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, cols: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy the columns `cols` (indices into the full input features) of the full weight."""
        self.weight.copy_(weight[:, cols].to(self.weight))
        if self.bias is not None:
            assert bias is not None
            self.bias.copy_(bias.to(self.bias))


def head_indices(blocks: list[tuple[int, int]], head_dim: int) -> torch.Tensor:
    """Feature indices of the heads in `blocks` ((start, end) head ranges), head_dim each."""
    return torch.cat([torch.arange(s * head_dim, e * head_dim, device="cpu") for s, e in blocks])


def shard_indices(n: int, parts: int, index: int) -> torch.Tensor:
    s, e = split_range(n, parts, index)
    return torch.arange(s, e, device="cpu")  # host indices, also under a meta-device build
