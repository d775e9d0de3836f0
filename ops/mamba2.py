"""Mamba-2's selective state space (SSD) in torch: the chunked scan, the one-token recurrent step,
the naive recurrence they are checked against, and the causal depthwise convolution before them.

Per head h (P channels, state N), with the head's scalar decay A_h < 0 and a per-token step dt:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T          S: [P, N], x_t: [P], B_t, C_t: [N]
    y_t = S_t C_t + D_h x_t

B and C are shared by the heads of one of G groups (H / G heads each). `ssd_chunked` computes the
same outputs chunk by chunk (state space duality, the Mamba-2 paper's SSD algorithm, as HF's
`mamba2_chunk_scan`): inside a chunk of Q tokens a masked [Q, Q] "attention" C_l . B_s with the
decays between l and s, between chunks the states carried by an exclusive scan over chunk ends.
Autograd through it is the backward (the tests check gradients against `ssd_naive` in float32 and
float64). Everything runs in float32 whatever the inputs' dtype. `ssd_step` advances a state by
one token (decode); `causal_conv1d` / `conv1d_step` are the depthwise convolution in both forms;
`gated_rms_norm` is the mixer's output norm.

No dependencies beyond torch: the inference engine computes prefill with `ssd_chunked` and decode
with `ssd_step` from the same definitions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _heads(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each group's B/C for its H / G heads (head h reads group
    h // (H / G), HF's repeat_interleave)."""
    return t.repeat_interleave(n_heads // t.shape[-2], dim=-2)


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """x [..., Q] -> [..., Q, Q]: out[..., l, s] = sum_{s < j <= l} x_j for l >= s, -inf above the
    diagonal. Summed directly (masked cumsum), not as a difference of cumsums, so no cancellation."""
    q = x.shape[-1]
    xx = x[..., None].expand(*x.shape, q)  # [..., j, s]
    below = torch.tril(torch.ones(q, q, dtype=torch.bool, device=x.device), diagonal=-1)
    xx = xx.masked_fill(~below, 0.0)
    out = torch.cumsum(xx, dim=-2)
    keep = torch.tril(torch.ones(q, q, dtype=torch.bool, device=x.device))
    return out.masked_fill(~keep, float("-inf"))


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [b, T, H, P], dt [b, T, H] (after softplus and clamping), A [H], B/C [b, T, G, N],
    D [H] or None, initial_state [b, H, P, N] or None -> (y [b, T, H, P], final state
    [b, H, P, N]), float32."""
    b, t, h, p = x.shape
    x, dt, A = x.float(), dt.float(), A.float()
    Bh, Ch = _heads(B.float(), h), _heads(C.float(), h)
    q = chunk_size
    pad = -t % q
    if pad:
        x, dt = F.pad(x, (0, 0, 0, 0, 0, pad)), F.pad(dt, (0, 0, 0, pad))
        Bh, Ch = F.pad(Bh, (0, 0, 0, 0, 0, pad)), F.pad(Ch, (0, 0, 0, 0, 0, pad))
    c = (t + pad) // q
    xdt = (x * dt[..., None]).view(b, c, q, h, p)  # discretised input dt_t x_t
    Bc, Cc = Bh.view(b, c, q, h, -1), Ch.view(b, c, q, h, -1)
    a = (dt * A).view(b, c, q, h).permute(0, 3, 1, 2)  # [b, h, c, q]: dt_t A_h (padding: 0)
    a_cum = torch.cumsum(a, dim=-1)

    # 1. within each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(sum_{s<j<=l} a_j) xdt_s
    decay = torch.exp(_segsum(a))  # [b, h, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc) * decay
    y = torch.einsum("bhcls,bcshp->bclhp", scores, xdt)

    # 2. each chunk's own end state: sum_s exp(sum_{s<j<=Q} a_j) xdt_s B_s^T
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b, h, c, s]
    chunk_states = torch.einsum("bhcs,bcshn,bcshp->bchpn", to_end, Bc, xdt)

    # 3. states entering each chunk: an exclusive scan over chunk ends, decayed by whole chunks
    start = x.new_zeros(b, h, p, Bc.shape[-1]) if initial_state is None else initial_state.float()
    states = torch.cat([start[:, None], chunk_states], dim=1)  # [b, c + 1, h, p, n]
    chunk_decay = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))  # [b, h, c + 1, c + 1]
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    entering, final = states[:, :-1], states[:, -1]

    # 4. the entering state's contribution: C_l S_in exp(sum_{j<=l} a_j)
    from_start = torch.exp(a_cum).permute(0, 2, 3, 1)  # [b, c, l, h]
    y = y + torch.einsum("bclhn,bchpn->bclhp", Cc, entering) * from_start[..., None]

    y = y.reshape(b, c * q, h, p)[:, :t]
    if D is not None:
        y = y + D.float()[:, None] * x[:, :t]
    return y, final


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: state [b, H, P, N], x [b, H, P], dt [b, H], A [H], B/C [b, G, N], D [H] ->
    (y [b, H, P], the new state), float32."""
    h = x.shape[1]
    x, dt = x.float(), dt.float()
    Bh, Ch = _heads(B.float(), h), _heads(C.float(), h)
    decay = torch.exp(dt * A.float())[..., None, None]  # [b, h, 1, 1]
    new = state.float() * decay + (dt[..., None] * x)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        y = y + D.float()[:, None] * x
    return y, new


def ssd_naive(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token, in the inputs' dtype (float64 for a reference): the
    definition the chunked scan and the step are checked against."""
    b, t, h, p = x.shape
    n = B.shape[-1]
    state = x.new_zeros(b, h, p, n) if initial_state is None else initial_state.to(x.dtype)
    Bh, Ch = _heads(B, h), _heads(C, h)
    ys = []
    for i in range(t):
        decay = torch.exp(dt[:, i] * A)[..., None, None]
        state = state * decay + (dt[:, i, :, None] * x[:, i])[..., None] * Bh[:, i, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", state, Ch[:, i])
        if D is not None:
            y = y + D[:, None] * x[:, i]
        ys.append(y)
    return torch.stack(ys, dim=1), state


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor | None = None
) -> torch.Tensor:
    """Depthwise causal convolution: x [b, T, C], weight [C, K], bias [C], state [b, C, K - 1]
    (the previous K - 1 inputs; None = zeros) -> [b, T, C] (before the activation)."""
    k = weight.shape[-1]
    xt = x.transpose(1, 2)
    prev = xt.new_zeros(xt.shape[0], xt.shape[1], k - 1) if state is None else state.to(xt.dtype)
    out = F.conv1d(torch.cat([prev, xt], dim=-1), weight[:, None, :], bias, groups=xt.shape[1])
    return out.transpose(1, 2)


def conv_state_after(x: torch.Tensor, k: int, state: torch.Tensor | None = None) -> torch.Tensor:
    """The convolution's state after x [b, T, C]: its last K - 1 inputs [b, C, K - 1] (earlier
    ones from `state` when T < K - 1)."""
    xt = x.transpose(1, 2)
    prev = xt.new_zeros(xt.shape[0], xt.shape[1], k - 1) if state is None else state.to(xt.dtype)
    return torch.cat([prev, xt], dim=-1)[..., -(k - 1) :]


def conv1d_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: x [b, C], state [b, C, K - 1] -> (output [b, C] before the activation, new state).
    Summed in float32 at least and rounded once to x's dtype, as a bf16 conv1d accumulates."""
    window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [b, C, K]
    acc = torch.promote_types(x.dtype, torch.float32)
    out = (window.to(acc) * weight.to(acc)).sum(dim=-1)
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(x.dtype), window[..., 1:]


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor:
    """HF NemotronHRMSNormGated: RMSNorm of y * silu(z) over groups of `group` channels in
    float32, multiplied by the weight after the cast back to y's dtype (HF's
    `weight * hs.to(input_dtype)`)."""
    dtype = y.dtype
    h = y.float() * F.silu(z.float())
    g = h.view(*h.shape[:-1], -1, group)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view_as(h).to(dtype)


def time_step(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float | None) -> torch.Tensor:
    """The mixer's raw dt [..., H] -> softplus(dt + dt_bias) clamped to [dt_min, dt_max] (HF's
    order; dt_max None: no upper bound)."""
    return F.softplus(dt + dt_bias.to(dt.dtype)).clamp(min=dt_min, max=dt_max)


def split_xbc(
    xbc: torch.Tensor, n_heads: int, head_dim: int, groups: int, state: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolved xBC [..., H * P + 2 * G * N] -> x [..., H, P], B and C [..., G, N]."""
    xs, b, c = xbc.split([n_heads * head_dim, groups * state, groups * state], dim=-1)
    lead = xbc.shape[:-1]
    return (
        xs.reshape(*lead, n_heads, head_dim),
        b.reshape(*lead, groups, state),
        c.reshape(*lead, groups, state),
    )
