"""Fused sampling for the GPU path: one pass over each row's logits, no float32 copy, no sort.

For a batch whose rows all sample from the full distribution (temperature > 0 with no top-k /
top-p / min-p) or are greedy, the sampler's torch path makes ~10 full-vocabulary passes (a float32
copy, scaling, sanitising, log_softmax, a float64 exp + cumsum for inverse-CDF sampling, gathers):
at a batch of 256 and a 152k vocabulary that is ~0.3 GB of memory traffic per step. This kernel
reads each row once, in the logits' own dtype, and in the same loop keeps

  - the online log-sum-exp of x = sanitize(logits / T) (T = 1 for greedy rows), for the exact
    log-prob of the chosen token: x[token] - logsumexp(x), i.e. log_softmax as the torch path;
  - the greedy argmax (first maximum, as torch.argmax);
  - the exponential race: argmax_j x_j - log(E_j) with E_j = -log(U_j) i.i.d. Exp(1), which
    picks j with probability softmax(x)_j (the Gumbel-max trick, written without the double log).

U_j comes from Philox (tl.randint) keyed by a per-row seed and the column j, the seed being drawn
from the sequence's own host RNG (one draw per token, as the torch path draws its uniform), so
sampling stays per-request seeded, independent of the batch, and reproducible on the same GPU
build. It is a different random stream from the torch path's inverse CDF: the same seed gives
different (equally distributed) tokens on this path than on CPU. U_j = (r_j >> 8 + 0.5) / 2^24
lies strictly inside (0, 1), so no E_j is 0 or infinite.

sanitize (layers/sampler.py): NaN -> -inf, +inf -> the largest float32; a row with nothing finite is
uniform, which the kernel handles by running a second race on all-zero logits in the same loop and
using it (and log-prob -log V) when the row's maximum stays -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import pdl

FLT_MAX = tl.constexpr(3.4028234663852886e38)  # a jit kernel reads only constexpr globals
BLOCK_V = 2048  # vocabulary columns per loop iteration


@triton.jit
def _sample_chunk(
    logits_ptr,
    stride_row,
    temps_ptr,
    seeds_ptr,
    part_f_ptr,
    part_i_ptr,
    vocab,
    chunk_cols,
    n_chunks,
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """One (row, chunk of columns) program: the chunk's online log-sum-exp, greedy max and both
    races, written to the row's partials (6 floats and 3 ints per chunk)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # the logits are the previous kernel's output (ops/pdl.py)
    temp = tl.load(temps_ptr + row)
    greedy = temp == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    seed = tl.load(seeds_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK)
    lo = chunk * chunk_cols
    hi = tl.minimum(lo + chunk_cols, vocab)
    if USE_GDC:
        # The merge kernel may launch now and wait for this grid: its launch hides behind the
        # chunks' vocabulary walk.
        tl.extra.cuda.gdc_launch_dependents()

    m = -float("inf")  # running max of x
    s = 0.0  # running sum of exp(x - m)
    best_x = -float("inf")  # greedy: value and (first) index of the max
    best_i = 0
    race_k = -float("inf")  # exponential race on x
    race_i = 0
    race_x = -float("inf")
    dead_k = -float("inf")  # the same race on a uniform row (used if nothing is finite)
    dead_i = 0
    for start in range(lo, hi, BLOCK):
        j = start + cols
        inside = j < hi
        raw = tl.load(base + j, mask=inside, other=0.0).to(tl.float32)
        x = raw * inv_t
        x = tl.where(x != x, -float("inf"), x)  # NaN
        x = tl.where(x == float("inf"), FLT_MAX, x)
        x = tl.where(inside, x, -float("inf"))

        c_max = tl.max(x, axis=0)
        m_new = tl.maximum(m, c_max)
        # While everything so far is -inf, the sum stays 0 (and inf - inf never happens).
        finite = m_new > -float("inf")
        shift = tl.where(finite, m_new, 0.0)
        s = tl.where(finite, s * tl.exp(m - shift), 0.0) + tl.sum(
            tl.where(inside, tl.exp(x - shift), 0.0), axis=0
        )
        m = m_new

        c_arg = tl.argmax(x, axis=0)
        better = c_max > best_x  # strictly: an earlier block keeps a tie (first maximum)
        best_i = tl.where(better, start + c_arg, best_i)
        best_x = tl.where(better, c_max, best_x)

        r = tl.randint(seed, j).to(tl.uint32)
        u = ((r >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        neg_log_e = -tl.log(-tl.log(u))  # -log(E), E ~ Exp(1)
        key = tl.where(x > -float("inf"), x + neg_log_e, -float("inf"))
        k_max = tl.max(key, axis=0)
        k_arg = tl.argmax(key, axis=0)
        won = k_max > race_k
        race_i = tl.where(won, start + k_arg, race_i)
        race_x = tl.where(won, tl.max(tl.where(cols == k_arg, x, -float("inf")), axis=0), race_x)
        race_k = tl.where(won, k_max, race_k)

        dkey = tl.where(inside, neg_log_e, -float("inf"))
        d_max = tl.max(dkey, axis=0)
        d_arg = tl.argmax(dkey, axis=0)
        dead_i = tl.where(d_max > dead_k, start + d_arg, dead_i)
        dead_k = tl.maximum(dead_k, d_max)

    pf = part_f_ptr + (row.to(tl.int64) * n_chunks + chunk) * 6
    tl.store(pf + 0, m)
    tl.store(pf + 1, s)
    tl.store(pf + 2, best_x)
    tl.store(pf + 3, race_k)
    tl.store(pf + 4, race_x)
    tl.store(pf + 5, dead_k)
    pi = part_i_ptr + (row.to(tl.int64) * n_chunks + chunk) * 3
    tl.store(pi + 0, best_i)
    tl.store(pi + 1, race_i)
    tl.store(pi + 2, dead_i)


@triton.jit
def _sample_combine(
    temps_ptr,
    part_f_ptr,
    part_i_ptr,
    tokens_ptr,
    logprobs_ptr,
    vocab,
    n_chunks,
    BLOCK_C: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """One row: merge its chunks' partials. Chunks are in column order, so the first chunk holding
    the maximum holds the row's first maximum (greedy ties as torch.argmax)."""
    row = tl.program_id(0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # the partials are the chunk kernel's output
    greedy = tl.load(temps_ptr + row) == 0.0
    c = tl.arange(0, BLOCK_C)
    valid = c < n_chunks
    pf = part_f_ptr + (row.to(tl.int64) * n_chunks + c) * 6
    pi = part_i_ptr + (row.to(tl.int64) * n_chunks + c) * 3
    neg = -float("inf")
    m_c = tl.load(pf + 0, mask=valid, other=neg)
    s_c = tl.load(pf + 1, mask=valid, other=0.0)
    best_x_c = tl.load(pf + 2, mask=valid, other=neg)
    race_k_c = tl.load(pf + 3, mask=valid, other=neg)
    race_x_c = tl.load(pf + 4, mask=valid, other=neg)
    dead_k_c = tl.load(pf + 5, mask=valid, other=neg)

    m = tl.max(m_c, axis=0)
    alive = m > neg
    shift = tl.where(alive, m, 0.0)
    s = tl.sum(tl.where(m_c > neg, s_c * tl.exp(m_c - shift), 0.0), axis=0)
    lse = m + tl.log(s)

    b = tl.argmax(best_x_c, axis=0)
    best_x = tl.max(best_x_c, axis=0)
    r = tl.argmax(race_k_c, axis=0)
    race_x = tl.max(tl.where(c == r, race_x_c, neg), axis=0)
    d = tl.argmax(dead_k_c, axis=0)
    best_i = tl.sum(tl.where(c == b, tl.load(pi + 0, mask=valid, other=0), 0), axis=0)
    race_i = tl.sum(tl.where(c == r, tl.load(pi + 1, mask=valid, other=0), 0), axis=0)
    dead_i = tl.sum(tl.where(c == d, tl.load(pi + 2, mask=valid, other=0), 0), axis=0)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()

    token = tl.where(greedy, best_i, race_i)
    lp = tl.where(greedy, best_x, race_x) - lse
    uniform_lp = -tl.log(vocab.to(tl.float32))
    token = tl.where(alive, token, tl.where(greedy, 0, dead_i))
    lp = tl.where(alive, lp, uniform_lp)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, lp)


def _target_programs(device: torch.device) -> int:
    """Programs that keep the GPU busy: two per SM (a batch-1 row split over ~264 H200 programs
    instead of one program walking 152k columns alone: 265 us -> a few us)."""
    if device.type != "cuda":
        return 16  # the interpreter (tests): several chunks per row, few programs
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return 2 * _SMS[idx]


_SMS: dict[int, int] = {}


def fused_sample(
    logits: torch.Tensor,
    temps: torch.Tensor,
    seeds: torch.Tensor,
    block: int = BLOCK_V,
    programs: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, last dim contiguous), temps float32 [B] (0: greedy),
    seeds int64 [B] (non-negative, < 2^63). Returns tokens int64 [B] and their log-probs float32 [B].
    block: columns per loop iteration (a power of two; small in tests, for several iterations).
    Each row is split into chunks of whole blocks so that about `programs` programs run (default:
    two per SM); a second kernel merges a row's chunks. The random stream is keyed by the column,
    so the chunking never changes which token a seed picks. Launched with PDL where ops/pdl.py
    says so (the engine's sampler enters its scope). out: (tokens, logprobs) to write into instead
    of new tensors (a captured graph's static outputs)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    if out is None:
        tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
        logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    else:
        tokens, logprobs = out
        if tokens.shape != (batch,) or logprobs.shape != (batch,) or not tokens.is_contiguous():
            raise ValueError(f"out: two contiguous [{batch}] tensors expected")
    if batch:
        n_blocks = -(-vocab // block)
        want = programs if programs is not None else _target_programs(logits.device)
        n_chunks = min(n_blocks, max(1, -(-want // batch)))
        chunk_cols = -(-n_blocks // n_chunks) * block
        n_chunks = -(-vocab // chunk_cols)
        part_f = torch.empty(batch, n_chunks, 6, dtype=torch.float32, device=logits.device)
        part_i = torch.empty(batch, n_chunks, 3, dtype=torch.int32, device=logits.device)
        gdc = pdl.launch(logits)
        _sample_chunk[(batch, n_chunks)](
            logits,
            logits.stride(0),
            temps,
            seeds,
            part_f,
            part_i,
            vocab,
            chunk_cols,
            n_chunks,
            BLOCK=block,
            USE_GDC=gdc,
            num_warps=8,
            launch_pdl=gdc,
        )
        _sample_combine[(batch,)](
            temps,
            part_f,
            part_i,
            tokens,
            logprobs,
            vocab,
            n_chunks,
            BLOCK_C=max(16, triton.next_power_of_2(n_chunks)),
            USE_GDC=gdc,
            num_warps=1,
            launch_pdl=gdc,
        )
    return tokens, logprobs


__all__ = ["fused_sample"]
