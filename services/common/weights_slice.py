"""Which part of each weight one inference rank holds, and reading only that part.

A `SliceSpec` names the rank's place: tensor parallel (`tp_rank` of `tp_size`, Megatron's split:
column-parallel projections and the vocabulary split along their output rows, row-parallel ones
along their input columns, the rest replicated) and expert parallel (`ep_rank` of `ep_size`: a
contiguous range of routed experts, each whole). `read_slices` looks every tensor up in the
directory's index and maps only the rows/columns the rank needs (services/common/weights_dir.py).
FP8 block scales (`X.weight_scale_inv`, one per `block` x `block` tile: the checkpoint's
weight_block_size) follow their weight's slice, so a split must fall on a tile boundary; so must
the split of a high-precision weight that an FP8 engine quantises at load (`tiled`), for the rank
to quantise the same tiles as a single-rank engine.

A Mamba-2 layer (nemotron_h, `SliceSpec.mamba`) splits by its heads and their B/C groups: a rank
holds its heads' rows of z, x and dt and its groups' rows of B and C in `in_proj` ([z | x | B | C |
dt] rows, read as one copy of those five runs), the same runs of x, B and C in `conv1d`, its
heads' `dt_bias`, `A_log`, `D` and gated-norm scale, and `out_proj`'s columns of its heads. Block
scales of `in_proj` follow when each of the rank's 128-row tiles lies in one of the whole
projection's (`SliceSpec.mamba_tiles`): the rank takes that tile's scales.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.weights_dir import SCALE_SUFFIX, WeightsReader

# Module names (the last component before .weight / .bias) split along the output (dim 0) ...
COLUMN = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "gate_proj",
        "up_proj",
        "q_b_proj",
        "kv_b_proj",
        "embed_tokens",
        "embeddings",  # nemotron_h's backbone.embeddings
        "lm_head",
    }
)
# ... and along the input (dim 1, the weight only: a bias is added after the all-reduce).
ROW = frozenset({"o_proj", "down_proj", "out_proj"})
PER_EXPERT = re.compile(r"\.(?:mlp|mixer)\.experts\.(\d+)\.")
MAMBA_HEADS = frozenset({"dt_bias", "A_log", "D"})  # a Mamba-2 mixer's per-head parameters
FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class SliceSpec:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    # The model's KV heads (k_proj / v_proj rows are kv_heads x head_dim). Fewer than tp_size:
    # each KV head lives whole on tp_size / kv_heads consecutive ranks (replicated) instead of
    # being cut. 0: k/v split like any column-parallel projection.
    kv_heads: int = 0
    # A Mamba-2 layer's (inner = heads x head_dim, groups x state, heads); () without one.
    mamba: tuple[int, int, int] | tuple[()] = ()

    def __post_init__(self) -> None:
        for rank, size, what in ((self.tp_rank, self.tp_size, "tp"), (self.ep_rank, self.ep_size, "ep")):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{what}_rank {rank} of {what}_size {size}")

    @property
    def full(self) -> bool:
        return self.tp_size == 1 and self.ep_size == 1

    def experts(self, n_experts: int) -> range:
        """This rank's routed experts: a contiguous range (the last ranks get one fewer when
        n_experts does not divide)."""
        base, extra = divmod(n_experts, self.ep_size)
        start = self.ep_rank * base + min(self.ep_rank, extra)
        return range(start, start + base + (self.ep_rank < extra))

    def kv_rows(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of a k_proj / v_proj's n rows."""
        if not self.kv_heads or self.kv_heads >= self.tp_size:
            return self.part(n)
        if self.tp_size % self.kv_heads:
            raise ValueError(f"tp_size {self.tp_size} is not a multiple of {self.kv_heads} KV heads")
        head, per = self.tp_rank // (self.tp_size // self.kv_heads), n // self.kv_heads
        return head * per, (head + 1) * per

    def part(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of a dimension of size n split over tp_size ranks."""
        if n % self.tp_size:
            raise ValueError(f"a dimension of {n} does not split over tp_size {self.tp_size}")
        step = n // self.tp_size
        return self.tp_rank * step, (self.tp_rank + 1) * step

    def mamba_rows(self, name: str) -> list[tuple[int, int]] | None:
        """This rank's runs of rows of a Mamba-2 `in_proj` or `conv1d` tensor (module docstring);
        None for any other tensor."""
        if not self.mamba or self.tp_size == 1:
            return None
        inner, gn, heads = self.mamba
        runs = [(0, inner), (inner, inner + gn), (inner + gn, inner + 2 * gn)]  # x, B, C
        if name.endswith(".mixer.in_proj.weight"):
            conv = inner + 2 * gn
            runs = (
                [(0, inner)]
                + [(inner + a, inner + b) for a, b in runs]
                + [(inner + conv, inner + conv + heads)]
            )
        elif not name.endswith((".mixer.conv1d.weight", ".mixer.conv1d.bias")):
            return None
        out = []
        for a, b in runs:
            start, stop = self.part(b - a)
            out.append((a + start, a + stop))
        return out

    def mamba_tiles(self, name: str, n: int, block: int) -> list[int]:
        """The `block`-row tile of the whole Mamba-2 `in_proj` (`n` rows) each `block`-row tile of
        this rank's rows lies in: a rank holds the single-rank engine's FP8 tiles (bits, and the
        scale of the tile its rows come from) only if none of its tiles takes rows from two. A
        ValueError naming the tensor otherwise."""
        runs = self.mamba_rows(name)
        assert runs is not None
        orig = torch.cat([torch.arange(a, b) for a, b in runs]) // block
        out = []
        for i in range(0, len(orig), block):
            tile = orig[i : i + block]
            if int(tile[0]) != int(tile[-1]):
                sizes = ", ".join(str(b - a) for a, b in runs)
                raise ValueError(
                    f"{name}: tp_size {self.tp_size} gives each rank runs of {sizes} rows of its {n} "
                    f"([z | x | B | C | dt]), not on the {block}x{block} FP8 tiles (each run but dt "
                    f"a multiple of {block} rows starting on a tile, and the dt rows in one tile)"
                )
            out.append(int(tile[0]))
        return out


Slice = tuple[int, int, int] | None  # (dim, start, stop), or None for the whole tensor


def _module(name: str) -> tuple[str, str]:
    """('q_proj', 'weight') of 'model.layers.0.self_attn.q_proj.weight'."""
    parts = name.split(".")
    return (parts[-2] if len(parts) > 1 else ""), parts[-1]


def tensor_slice(name: str, shape: tuple[int, ...], spec: SliceSpec, n_experts: int) -> Slice | bool:
    """The part of `name` (of `shape`) this rank holds: a Slice, or False when it holds none of it
    (another rank's expert). Scales are given their weight's slice in tiles by `read_slices`."""
    hit = PER_EXPERT.search(name)
    if hit is not None and spec.ep_size > 1:
        return int(hit[1]) in spec.experts(n_experts)  # EP: an expert lives whole on one rank
    fused = FUSED_EXPERTS.search(name)
    if fused is not None and spec.ep_size > 1:
        r = spec.experts(n_experts)
        return (0, r.start, r.stop)
    if spec.tp_size == 1:
        return None
    module, kind = _module(name)
    if fused is not None:  # [E, N, K]: gate_up split along N (read_slices: in halves), down along K
        return (1, *spec.part(shape[1] // 2)) if fused[1] == "gate_up_proj" else (2, *spec.part(shape[2]))
    if spec.mamba and (kind in MAMBA_HEADS and module == "mixer" or name.endswith(".mixer.norm.weight")):
        return (0, *spec.part(shape[0]))  # per head (the norm: per head's features, whole groups)
    if module in ("k_proj", "v_proj"):
        return (0, *spec.kv_rows(shape[0]))
    if module in COLUMN:
        return (0, *spec.part(shape[0]))
    if module in ROW and kind == "weight" and len(shape) == 2:
        return (1, *spec.part(shape[1]))
    return None


def check_tiles(name: str, dim: int, start: int, stop: int, n: int, spec: SliceSpec, block: int) -> None:
    """A cut of a block-scaled weight (`n` long along `dim`) must fall on its tiles."""
    if start % block or (stop % block and stop != n):
        raise ValueError(
            f"{name}: tp_size {spec.tp_size} cuts dim {dim} (size {n}) at rows/columns {start}:{stop}, "
            f"not on the {block}x{block} FP8 tiles (each rank's part must be a multiple of {block})"
        )


def read_slices(
    reader: WeightsReader,
    spec: SliceSpec,
    n_experts: int = 0,
    block: int = 128,
    tiled: Callable[[str, tuple[int, ...]], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor this rank needs, as memory-mapped views of its slice (nothing else is read).
    `tiled(name, shape)`: whether a (high-precision) weight is held in `block` x `block` FP8 tiles
    by the engine reading it, which then requires its cut on them too."""
    out: dict[str, torch.Tensor] = {}
    for name, e in reader.entries.items():
        owner = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        w = reader.entries.get(owner, e)
        sl = tensor_slice(owner, w.shape, spec, n_experts)
        if sl is False:
            continue
        runs = spec.mamba_rows(owner)
        if runs is not None:
            if owner != name or (tiled is not None and tiled(name, tuple(w.shape))):
                tiles = spec.mamba_tiles(owner, w.shape[0], block)
                if owner != name:  # a block scale: the row of the tile each of the rank's tiles is in
                    out[name] = reader.tensor(name)[torch.tensor(tiles)]
                    continue
            out[name] = torch.cat([reader.tensor(name, r, 0) for r in runs])
            continue
        if sl is None or sl is True:
            out[name] = reader.tensor(name)
            continue
        dim, start, stop = sl
        if dim == 1 and owner.endswith(".mlp.experts.gate_up_proj"):
            # Gate rows then up rows: the rank's part of each half (one copy of just those rows).
            half = w.shape[1] // 2
            if owner != name:
                raise ValueError(f"{owner}: block-scaled fused gate_up_proj does not split over tp ranks")
            parts = [reader.tensor(name, (start + h, stop + h), 1) for h in (0, half)]
            out[name] = torch.cat(parts, dim=1)
            continue
        if owner != name or (tiled is not None and tiled(name, tuple(w.shape))):
            check_tiles(owner, dim, start, stop, w.shape[dim], spec, block)
        if owner != name:  # a block scale: the weight's slice in tiles
            start, stop = start // block, -(-stop // block)
        out[name] = reader.tensor(name, (start, stop), dim)
    return out
