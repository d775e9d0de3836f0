"""Document-masked attention kernels for packed micro-batches: sdpa, flex or varlen.

`trainer.packing` packs samples into one row and masks attention with a dense [T, T] boolean
mask through `DocumentSDPA` (the only way that trains on CPU). On GPU that mask costs T^2 bytes
(256 MiB at 16k tokens, 16 GiB at 131k) and SDPA with an explicit mask cannot use the flash
kernel. `DocumentAttention` is a `DocumentSDPA` (so `packing.document_mask` still works with it)
that, inside `micro_batch_attention(model, mb)` for a pack of several samples, runs:

  flex    torch's FlexAttention with a BlockMask built from per-token document ids (only the
          blocks on the diagonal band are computed; compiled once per process by torchtitan)
  varlen  torch's varlen (flash) attention over cumulative sequence lengths, torchtitan's call

  sdpa    the dense mask as DocumentSDPA (CPU, and the reference the others are checked against)

flex/varlen are CUDA only (config validation rejects them on CPU). A pack of one sample needs
no document mask at all: it runs plain causal SDPA (flash/cuDNN), which is what keeps a single
131k-token sequence affordable. The state is held over forward AND backward (see
micro_batch_attention: activation checkpointing recomputes the forward inside backward).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn
from torchtitan.models.attention import FlexAttentionWrapper, VarlenAttentionWrapper, create_attention_mask

from trainer.batch import MicroBatch, to_device
from trainer.loss import micro_batch_logprobs, sequence_logprobs
from trainer.packing import DocumentSDPA, PackedMicroBatch, block_causal_mask

AttentionKind = Literal["sdpa", "flex", "varlen"]
SdpaBackend = Literal["auto", "cudnn", "flash", "efficient"]

# The SDPA kernel priority per trainer.sdpa_backend. "auto" is torchtitan's own list (what the
# trainer always ran). A forced backend still has the others behind it: a shape or dtype it does
# not support (or the CPU) falls through instead of failing the step.
SDPA_PRIORITY: dict[str, list[SDPBackend]] = {
    "auto": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
    "cudnn": [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ],
    "flash": [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ],
    "efficient": [
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ],
}


def expand_kv(k: torch.Tensor, v: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, KV, T, D] -> [B, H, T, D]: each kv head repeated for its group of q heads (SDPA's
    enable_gqa grouping: q head i reads kv head i // (H / KV))."""
    rep = n_heads // k.shape[-3]
    return k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)


class DocumentAttention(DocumentSDPA):
    """The inner attention of one block: causal SDPA, SDPA with a dense mask (DocumentSDPA's
    `mask`), or the flex/varlen kernel with the state micro_batch_attention sets.

    SDPA runs with `sdpa_backend`'s kernel priority; `expand_kv` repeats GQA's kv heads first
    (for a backend that would otherwise refuse enable_gqa; flex/varlen take GQA natively)."""

    def __init__(
        self, kind: AttentionKind = "sdpa", sdpa_backend: SdpaBackend = "auto", expand_kv: bool = False
    ) -> None:
        super().__init__()
        self.kind: AttentionKind = kind
        self.block_mask: object | None = None  # flex BlockMask
        self.varlen: tuple[torch.Tensor, int] | None = None  # (cu_seqlens int32, max_len)
        self.sdpa_backend: SdpaBackend = sdpa_backend
        self.sdpa_backends = list(SDPA_PRIORITY[sdpa_backend])  # read by the SDPA wrapper
        self.expand_kv = expand_kv

    def forward(  # type: ignore[override]
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
    ) -> torch.Tensor:
        if self.block_mask is not None:
            return FlexAttentionWrapper._compiled_flex_attn(  # type: ignore[no-any-return]
                q, k, v, block_mask=self.block_mask, scale=scale, enable_gqa=enable_gqa
            )
        if self.varlen is not None:
            cu, max_len = self.varlen
            b, h, t, d = q.shape  # b == 1: a packed row
            out = VarlenAttentionWrapper._compiled_varlen_attn(
                q.transpose(1, 2).flatten(0, 1),
                k.transpose(1, 2).flatten(0, 1),
                v.transpose(1, 2).flatten(0, 1),
                cu,
                cu,
                max_len,
                max_len,
                scale=scale,
                **_varlen_causal_kwargs(enable_gqa),
            )
            # [T, H, D] -> the [B, H, T, D] layout the calling Attention module expects.
            return out.view(b, t, h, d).transpose(1, 2)  # type: ignore[no-any-return]
        if self.expand_kv and enable_gqa and k.shape[-3] != q.shape[-3]:
            k, v = expand_kv(k, v, q.shape[-3])
            enable_gqa = False
        if self.mask is not None and self.sdpa_backend != "auto":
            # A forced backend orders the dense-mask call too ("auto" keeps torch's default
            # order there, which unlike torchtitan's causal list includes the efficient kernel).
            with sdpa_kernel(self.sdpa_backends, set_priority=True):
                return super().forward(q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal)
        return super().forward(q, k, v, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal)


# Causal masking and GQA as this torch's varlen_attn spells them (window_size=(-1, 0) is what
# torchtitan passes; older releases had is_causal; enable_gqa is newer), read once at import:
# DocumentAttention.forward may run under torch.compile(fullgraph=True), which cannot trace inspect.
_VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)
_VARLEN_CAUSAL: dict[str, Any] = (
    {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}
)
_VARLEN_GQA = "enable_gqa" in _VARLEN_PARAMS


def _varlen_causal_kwargs(enable_gqa: bool) -> dict[str, Any]:
    return {**_VARLEN_CAUSAL, "enable_gqa": True} if enable_gqa and _VARLEN_GQA else dict(_VARLEN_CAUSAL)


def _attentions(model: nn.Module) -> list[nn.Module]:
    # (a hybrid stack's Mamba-2 / MLP / MoE layers have none: trainer/nemotron.py)
    return [layer.attention for layer in model.layers.values() if hasattr(layer, "attention")]  # type: ignore[union-attr]


def enable_document_attention(
    model: nn.Module,
    kind: AttentionKind = "sdpa",
    sdpa_backend: SdpaBackend = "auto",
    expand_kv: bool = False,
) -> nn.Module:
    """Give every block a DocumentAttention of `kind` (call before AC/compile/sharding)."""
    for attn in _attentions(model):
        if attn.attn_type != "sdpa":
            raise ValueError(f"document attention wraps attn_type 'sdpa', not {attn.attn_type!r}")
        attn.inner_attention = DocumentAttention(kind, sdpa_backend, expand_kv)
    return model


def attention_kind(model: nn.Module) -> AttentionKind:
    inner = _attentions(model)[0].inner_attention
    return inner.kind if isinstance(inner, DocumentAttention) else "sdpa"


def flex_block_mask(seq_lens: list[int], device: torch.device) -> object:
    """A BlockMask: causal and within the same document."""
    # Lengths through pinned memory, output size from the host: no device-to-host read.
    doc = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=device, dtype=torch.int32),
        to_device(torch.tensor(seq_lens), device),
        output_size=sum(seq_lens),
    )

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q >= kv) & (doc[q] == doc[kv])

    t = int(doc.numel())
    return create_attention_mask(mask_mod, 1, None, t, t, device=device)


def varlen_metadata(seq_lens: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
    return to_device(cu, device), max(seq_lens)


def _state_set(inner: list[nn.Module]) -> bool:
    m = inner[0]
    return bool(m.mask is not None or m.block_mask is not None or m.varlen is not None)


@contextmanager
def micro_batch_attention(model: nn.Module, mb: MicroBatch | PackedMicroBatch) -> Iterator[None]:
    """Inside: attention masks documents as `mb` is packed (nothing to do for a padded batch or
    a one-sample pack, which are plainly causal). Hold it over the forward AND the backward:
    activation checkpointing re-runs the forward inside backward, and that recompute must see
    the same mask (it raises, or silently computes other gradients, otherwise)."""
    if not isinstance(mb, PackedMicroBatch) or len(mb.seq_lens) == 1:
        yield
        return
    inner = [a.inner_attention for a in _attentions(model)]
    if not all(isinstance(m, DocumentAttention) for m in inner):
        raise TypeError("call enable_document_attention(model, kind) first")
    kind, device, lens = inner[0].kind, mb.inputs.device, mb.seq_lens
    # One mask / metadata per micro-batch, shared by every layer.
    mask = block_causal_mask(lens, device) if kind == "sdpa" else None
    block_mask = flex_block_mask(lens, device) if kind == "flex" else None
    varlen = varlen_metadata(lens, device) if kind == "varlen" else None
    for m in inner:
        m.mask, m.block_mask, m.varlen = mask, block_mask, varlen
    try:
        yield
    finally:
        for m in inner:
            m.mask, m.block_mask, m.varlen = None, None, None


def packed_logprobs(
    model: nn.Module, mb: MicroBatch | PackedMicroBatch, chunk: int = 0, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) aligned with mb.loss_mask, with the model's attention kernel.

    The trainer calls it inside `micro_batch_attention(model, mb)` (held over the backward too);
    called outside one it enters one for the forward only, which is right without activation
    checkpointing."""
    if not isinstance(mb, PackedMicroBatch):
        return micro_batch_logprobs(model, mb, chunk, entropy_grad)
    inner = [a.inner_attention for a in _attentions(model)]
    held = len(mb.seq_lens) == 1 or (isinstance(inner[0], DocumentAttention) and _state_set(inner))
    with contextlib.nullcontext() if held else micro_batch_attention(model, mb):
        return sequence_logprobs(
            model, mb.inputs, mb.targets, positions=mb.positions, chunk=chunk, entropy_grad=entropy_grad
        )
