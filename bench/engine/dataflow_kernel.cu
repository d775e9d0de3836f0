// The batch-1 decode chain of bench/engine/stream_probe.py (Qwen3-0.6B's q/k/v, o_proj, gate/up
// and down GEMVs, 28 layers, no norms or attention) as one persistent CUDA kernel, to measure
// what the Triton and Gluon kernels could not express: an exchange between phases through
// per-program flags (each consumer waits only for the programs that wrote its inputs, Hazy
// Research's design for their Llama-1B megakernel) against a grid barrier, in the same code.
//
// Layout: P = 128 programs (one per SM), each owning a fixed slice of every phase's output rows
// (q/k/v 32, o_proj 8, gate/up 48, down 8). A program is five warps:
//   - one producer warp, one thread of which streams the program's weights with the bulk copy
//     engine (cp.async.bulk, evict_first in L2) into a ring of shared-memory stages, phase after
//     phase and layer after layer, as far ahead as the ring allows. The weights are packed on the
//     host so that each (program, stage) tile is contiguous: [layer][program][phase][stage][R][CK];
//   - W = 4 or 8 consumer warps: each owns R / W rows, its lanes split a stage's CK columns. At a phase's
//     start every lane waits for the producers of the input columns it will read, loads them into
//     registers, then consumes the phase's stages from the ring and writes its rows.
// Exchanges: after its last stage a program's consumers meet at a named barrier and one thread
// publishes (a release fence, then either its own flag := epoch, or +1 on the phase's counter).
// A waiting lane polls with relaxed loads (several in flight at once), then one acquire fence;
// with ONE_POLLER only warp 0 of a program polls and the others wait at a named barrier (it
// measured no faster: clock marks put the slow exchanges on a division slow path in down's
// SiLU, not on the polling).
//
// The residual is float32 in two buffers: ha (the input of q/k/v, written by down) and hb (written
// by o_proj, the input of gate/up); program p owns rows [8p, 8p + 8) of both, so no program reads
// a row while another writes it (the dependency chain orders every reuse: see stream_probe.py).
//
// Built at run time by bench/engine/dataflow_probe.py (ops/fp8/cuda/nvcc.py, then ctypes).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sm90_sync.cuh"

namespace {

using namespace relay_sm90;

constexpr int D = 1024, NQ = 2048, INTER = 3072, NQKV = 4096;
constexpr int P = 128;
constexpr int SLOT_BYTES = 16384;
constexpr int NSLOT = 13;  // 208 KB of ring
constexpr int SMEM_BYTES = NSLOT * SLOT_BYTES + 2 * NSLOT * 8;
constexpr int QKV = 0, OPROJ = 1, GATEUP = 2, DOWN = 3;
constexpr unsigned FULL = 0xffffffffu;
constexpr long long WATCHDOG_NS = 2000000000LL;  // a wait this long is a bug: record it, go on
constexpr int TRACE_MARKS = 5;  // a phase's entry, release, inputs in registers, rows reduced, published

// Per phase: rows a program owns (R), the input length (K), columns a stage carries (CK), columns
// a lane reads per 16- or 8-byte access (VEC). A stage's tile is R x CK bf16, at most one slot.
template <int PH>
struct Cfg;
template <>
struct Cfg<QKV> {
  static constexpr int R = NQKV / P, K = D, CK = 256, VEC = 8;
};
template <>
struct Cfg<OPROJ> {
  static constexpr int R = D / P, K = NQ, CK = 1024, VEC = 8;
};
template <>
struct Cfg<GATEUP> {
  static constexpr int R = 2 * INTER / P, K = D, CK = 128, VEC = 4;
};
template <>
struct Cfg<DOWN> {
  static constexpr int R = D / P, K = INTER, CK = 1024, VEC = 8;
};
template <int PH, int W>  // W: consumer warps
struct Shape : Cfg<PH> {
  using C = Cfg<PH>;
  static constexpr int S = C::K / C::CK;                // stages
  static constexpr int G = C::CK / (32 * C::VEC);       // a lane's accesses per row and stage
  static constexpr int RW = C::R / W;                   // rows per consumer warp
  static constexpr int TILE_BYTES = C::R * C::CK * 2;   // one stage
  static_assert(C::K % C::CK == 0 && C::CK % (32 * C::VEC) == 0 && C::R % W == 0, "shape");
  static_assert(TILE_BYTES <= SLOT_BYTES && TILE_BYTES % 16 == 0, "a stage is one slot");
};
template <int PH>
constexpr int phase_bytes = Cfg<PH>::R * Cfg<PH>::K * 2;  // a program's slice of the phase
constexpr int LAYER_BYTES = phase_bytes<QKV> + phase_bytes<OPROJ> + phase_bytes<GATEUP> +
                            phase_bytes<DOWN>;  // one program's weights of one layer

struct Args {
  const char* w;         // packed weights, [layers][P][LAYER_BYTES]
  long long layer_step;  // bytes between layers' weights (0: every layer reads layer 0's, from L2)
  float* ha;             // residual, input of q/k/v [D]
  float* hb;             // residual after o_proj, input of gate/up [D]
  __nv_bfloat16* qkv;    // [NQKV]
  __nv_bfloat16* gu;     // [2 * INTER]: gate rows then up rows
  int* sync;             // flags: [4][P], one per (phase, program); barrier: [4] counters
  int* err;              // watchdog: [0] fired, [1] phase, [2] layer, [3] value seen
  int layers;
  int base;              // epoch of layer l in this launch: base + l + 1 (never reused)
  long long* trace;      // nullptr, or [layers][4][P][TRACE_MARKS] globaltimer ns (see phase)
};

__device__ __forceinline__ int ld_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed(int* p, int v) {
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_add_relaxed(int* p, int v) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ long long now_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// The clock read after `dep` exists (an input operand orders it after the value's loads/math).
__device__ __forceinline__ long long now_ns_after(float dep) {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "f"(dep));
  return t;
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
}

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16(x)); }

__device__ __forceinline__ void unpack8(const uint4& v, float (&out)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void unpack4(const uint2& v, float (&out)[8]) {
  out[0] = __uint_as_float(v.x << 16);
  out[1] = __uint_as_float(v.x & 0xffff0000u);
  out[2] = __uint_as_float(v.y << 16);
  out[3] = __uint_as_float(v.y & 0xffff0000u);
}

// The index in `sync` of the flag (flags mode) or counter (barrier mode) that says input column c of phase PH is
// written, and the value it must reach. `second` picks up's producer for down's input.
template <int PH, bool BARRIER>
__device__ __forceinline__ int dep_word(int c, bool second) {
  constexpr int DEP = PH == QKV ? DOWN : PH - 1;
  if constexpr (BARRIER) return DEP;
  int producer;
  if constexpr (PH == QKV || PH == GATEUP) producer = c / (D / P);          // residual rows
  else if constexpr (PH == OPROJ) producer = c / Cfg<QKV>::R;             // q rows
  else producer = (c + (second ? INTER : 0)) / Cfg<GATEUP>::R;           // gate and up rows
  return DEP * P + producer;
}

// The watchdog of a poll loop: true once `spin` polls have taken more than WATCHDOG_NS (the clock
// is read from the 1024th poll on: it is not free), after recording the first such wait in err.
__device__ __forceinline__ bool timed_out(const Args& a, int spin, long long& t0, int phase, int layer, int low) {
  if ((spin & 1023) != 1023) return false;
  if (t0 == 0) t0 = now_ns();
  if (now_ns() - t0 <= WATCHDOG_NS) return false;
  if (atomicExch(a.err, 1) == 0) {
    a.err[1] = phase;
    a.err[2] = layer;
    a.err[3] = low;
  }
  return true;
}

// Wait until every input column this lane reads in phase PH of `layer` is written, then make the
// writes visible (an acquire fence after the relaxed polls).
template <int PH, bool BARRIER>
__device__ __forceinline__ void wait_inputs(const Args& a, int layer, int lane) {
  using Sh = Shape<PH, 4>;  // (the columns a lane reads do not depend on the warp count)
  if (PH == QKV && layer == 0) return;  // ha was written before the launch
  const int epoch = a.base + layer + (PH == QKV ? 0 : 1);
  const int want = BARRIER ? P * epoch : epoch;
  long long t0 = 0;  // the watchdog's start (timed_out)
  for (int spin = 0;; ++spin) {
    int low = 0x7fffffff;  // the least of the words this lane waits on (indices recomputed: registers)
#pragma unroll
    for (int s = 0; s < (BARRIER ? 1 : Sh::S); ++s)
#pragma unroll
      for (int g = 0; g < (BARRIER ? 1 : Sh::G); ++g) {
        const int c = s * Sh::CK + g * 32 * Sh::VEC + lane * Sh::VEC;
        low = min(low, ld_relaxed(a.sync + dep_word<PH, BARRIER>(c, false)));
        if constexpr (!BARRIER && PH == DOWN) low = min(low, ld_relaxed(a.sync + dep_word<PH, BARRIER>(c, true)));
      }
    if (low >= want || timed_out(a, spin, t0, PH, layer, low)) break;
  }
  fence_gpu();
}

// The same wait by one warp for the whole program (ONE_POLLER): its lanes poll every producer
// the phase reads from (all of them but o_proj's 64 q producers), or lane 0 the phase's counter;
// then the other consumer warps are released by a named barrier. P / 32 flags a lane.
template <int PH, bool BARRIER, int W>
__device__ __forceinline__ void wait_inputs_one_warp(const Args& a, int layer, int warp, int lane) {
  if (PH == QKV && layer == 0) return;
  if (warp == 0) {
    constexpr int DEP = PH == QKV ? DOWN : PH - 1;
    constexpr int PRODUCERS = BARRIER ? 1 : (PH == OPROJ ? NQ / Cfg<QKV>::R : P);
    const int epoch = a.base + layer + (PH == QKV ? 0 : 1);
    const int want = BARRIER ? P * epoch : epoch;
    long long t0 = 0;
    for (int spin = 0;; ++spin) {
      int low = 0x7fffffff;
#pragma unroll
      for (int j = lane; j < (PRODUCERS + 31) / 32 * 32; j += 32)
        if (j < PRODUCERS) low = min(low, ld_relaxed(a.sync + (BARRIER ? DEP : DEP * P + j)));
      if (__all_sync(FULL, low >= want) || __any_sync(FULL, timed_out(a, spin, t0, PH, layer, low))) break;
    }
    fence_gpu();
  }
  named_sync(2, W * 32);
}

// Input column c's VEC values as the GEMV consumes them (float32, rounded as the torch chain does).
template <int PH>
__device__ __forceinline__ void load_input(const Args& a, int c, float (&x)[8]) {
  if constexpr (PH == QKV || PH == GATEUP) {
    const float* h = PH == QKV ? a.ha : a.hb;
    const float4 v0 = __ldcg(reinterpret_cast<const float4*>(h + c));
    x[0] = bf16_round(v0.x), x[1] = bf16_round(v0.y), x[2] = bf16_round(v0.z), x[3] = bf16_round(v0.w);
    if constexpr (Cfg<PH>::VEC == 8) {
      const float4 v1 = __ldcg(reinterpret_cast<const float4*>(h + c + 4));
      x[4] = bf16_round(v1.x), x[5] = bf16_round(v1.y), x[6] = bf16_round(v1.z), x[7] = bf16_round(v1.w);
    }
  } else if constexpr (PH == OPROJ) {
    unpack8(__ldcg(reinterpret_cast<const uint4*>(a.qkv + c)), x);
  } else {
    float g[8], u[8];
    unpack8(__ldcg(reinterpret_cast<const uint4*>(a.gu + c)), g);
    unpack8(__ldcg(reinterpret_cast<const uint4*>(a.gu + INTER + c)), u);
#pragma unroll
    // Approximate division, as Triton's: the probe's random weights grow through the layers, and
    // with -g past ~88 __expf is inf, which sends IEEE division down its slow path (a clock
    // trace: 15 us of this phase's 17). (x / inf = 0 here too.)
    for (int i = 0; i < 8; ++i) x[i] = bf16_round(__fdividef(g[i], 1.0f + __expf(-g[i])) * u[i]);
  }
}

// One phase of one layer on a consumer warp: wait for and load the inputs, consume the S stages
// from the ring (stage counter `it`, shared with the producer's order), write the warp's rows,
// and publish the program's part once all W warps have written theirs.
template <int PH, int W, bool BARRIER, bool WEIGHTS, bool ONE_POLLER>
__device__ __forceinline__ void phase(const Args& a, int layer, uint32_t& it, char* ring, uint64_t* full,
                                      uint64_t* empty, int warp, int lane) {
  using Sh = Shape<PH, W>;
  constexpr int CK = Sh::CK, VEC = Sh::VEC, G = Sh::G, S = Sh::S, RW = Sh::RW;
  // Clock marks (Args::trace): where a phase's time goes, written by the thread that publishes.
  long long* mark = a.trace != nullptr && warp == 0 && lane == 0
                        ? a.trace + ((static_cast<long long>(layer) * 4 + PH) * P + blockIdx.x) * TRACE_MARKS
                        : nullptr;
  if (mark) mark[0] = now_ns();
  if constexpr (ONE_POLLER)
    wait_inputs_one_warp<PH, BARRIER, W>(a, layer, warp, lane);
  else
    wait_inputs<PH, BARRIER>(a, layer, lane);
  if (mark) mark[1] = now_ns();
  float x[S][G][8];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int g = 0; g < G; ++g) load_input<PH>(a, s * CK + g * 32 * VEC + lane * VEC, x[s][g]);
  if (mark) mark[2] = now_ns_after(x[S - 1][G - 1][0]);
  float acc[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) acc[r] = 0.0f;
#pragma unroll
  for (int s = 0; s < S; ++s, ++it) {
    const uint32_t slot = it % NSLOT;
    if constexpr (WEIGHTS) mbar_wait(&full[slot], (it / NSLOT) & 1);
    const char* tile = ring + slot * SLOT_BYTES;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const int row = warp * RW + r;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int col = g * 32 * VEC + lane * VEC;
        float w[8];
        if constexpr (VEC == 8)
          unpack8(*reinterpret_cast<const uint4*>(tile + (row * CK + col) * 2), w);
        else
          unpack4(*reinterpret_cast<const uint2*>(tile + (row * CK + col) * 2), w);
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[r] = fmaf(w[j], x[s][g][j], acc[r]);
      }
    }
    __syncwarp();
    if (WEIGHTS && lane == 0) mbar_arrive(&empty[slot]);
  }
  float mine = 0.0f;
#pragma unroll
  for (int r = 0; r < RW; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(FULL, acc[r], off);
    if (lane == r) mine = acc[r];
  }
  if (mark) mark[3] = now_ns_after(mine);
  const int p = blockIdx.x;
  if (lane < RW) {
    const int row = p * Sh::R + warp * RW + lane;
    if constexpr (PH == QKV) a.qkv[row] = __float2bfloat16(mine);
    else if constexpr (PH == GATEUP) a.gu[row] = __float2bfloat16(mine);
    else if constexpr (PH == OPROJ) a.hb[row] = __ldcg(a.ha + row) + bf16_round(mine);
    else a.ha[row] = __ldcg(a.hb + row) + bf16_round(mine);
  }
  named_sync(1, W * 32);
  if (warp == 0 && lane == 0) {
    fence_gpu();  // all W warps' rows (ordered before this by the named barrier) first
    if constexpr (BARRIER) red_add_relaxed(a.sync + PH, 1);
    else st_relaxed(a.sync + PH * P + p, a.base + layer + 1);
    if (mark) mark[4] = now_ns();
  }
}

template <int PH>
__device__ __forceinline__ void produce_phase(const char*& src, uint32_t& it, char* ring, uint64_t* full,
                                              uint64_t* empty, uint64_t policy) {
  using Sh = Shape<PH, 4>;
  for (int s = 0; s < Sh::S; ++s, ++it) {
    const uint32_t slot = it % NSLOT;
    mbar_wait(&empty[slot], ((it / NSLOT) & 1) ^ 1);
    mbar_expect_tx(&full[slot], Sh::TILE_BYTES);
    bulk_load(ring + slot * SLOT_BYTES, src, Sh::TILE_BYTES, &full[slot], policy);
    src += Sh::TILE_BYTES;
  }
}

template <int W, bool BARRIER, bool WEIGHTS, bool ONE_POLLER>
__global__ void __launch_bounds__((W + 1) * 32, 1) dataflow_kernel(const Args a) {
  constexpr int THREADS = (W + 1) * 32;
  extern __shared__ __align__(128) char smem[];
  char* ring = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + NSLOT * SLOT_BYTES);
  uint64_t* empty = full + NSLOT;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (!WEIGHTS) {  // the ring is read but never filled: zeros keep the arithmetic finite
    for (int i = threadIdx.x; i < NSLOT * SLOT_BYTES / 16; i += THREADS)
      reinterpret_cast<uint4*>(ring)[i] = make_uint4(0, 0, 0, 0);
  }
  if (threadIdx.x == 0) {
    for (int i = 0; i < NSLOT; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], W);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == W) {
    if (WEIGHTS && lane == 0) {
      uint64_t policy;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
      uint32_t it = 0;
      for (int layer = 0; layer < a.layers; ++layer) {
        const char* src = a.w + layer * a.layer_step + static_cast<long long>(blockIdx.x) * LAYER_BYTES;
        produce_phase<QKV>(src, it, ring, full, empty, policy);
        produce_phase<OPROJ>(src, it, ring, full, empty, policy);
        produce_phase<GATEUP>(src, it, ring, full, empty, policy);
        produce_phase<DOWN>(src, it, ring, full, empty, policy);
      }
    }
    return;
  }
  uint32_t it = 0;
  for (int layer = 0; layer < a.layers; ++layer) {
    phase<QKV, W, BARRIER, WEIGHTS, ONE_POLLER>(a, layer, it, ring, full, empty, warp, lane);
    phase<OPROJ, W, BARRIER, WEIGHTS, ONE_POLLER>(a, layer, it, ring, full, empty, warp, lane);
    phase<GATEUP, W, BARRIER, WEIGHTS, ONE_POLLER>(a, layer, it, ring, full, empty, warp, lane);
    phase<DOWN, W, BARRIER, WEIGHTS, ONE_POLLER>(a, layer, it, ring, full, empty, warp, lane);
  }
}

template <int W, bool BARRIER, bool WEIGHTS, bool ONE_POLLER>
int launch(const Args& a, cudaStream_t stream) {
  constexpr int THREADS = (W + 1) * 32;
  const auto kernel = dataflow_kernel<W, BARRIER, WEIGHTS, ONE_POLLER>;
  // Once per kernel, not per launch (the probes time back-to-back launches): the shared-memory
  // limit, and the check that all P programs fit at once, since each waits on others.
  static const int ready = [kernel] {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    if (err != cudaSuccess) return static_cast<int>(err);
    int per_sm = 0, dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, THREADS, SMEM_BYTES);
    if (err != cudaSuccess) return static_cast<int>(err);
    return per_sm * sms < P ? -2 : 0;
  }();
  if (ready != 0) return ready;
  kernel<<<P, THREADS, SMEM_BYTES, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <int W, bool ONE_POLLER>
int launch_mode(const Args& a, int mode, int weights, cudaStream_t s) {
  if (mode == 0) return weights ? launch<W, false, true, ONE_POLLER>(a, s) : launch<W, false, false, ONE_POLLER>(a, s);
  if (mode == 1) return weights ? launch<W, true, true, ONE_POLLER>(a, s) : launch<W, true, false, ONE_POLLER>(a, s);
  return -1;
}

}  // namespace

extern "C" int relay_dataflow_layer_bytes() { return LAYER_BYTES; }
extern "C" int relay_dataflow_programs() { return P; }
extern "C" int relay_dataflow_trace_marks() { return TRACE_MARKS; }

// mode 0: per-program flags (sync holds 4 * P ints), 1: one counter a phase (sync holds 4 ints).
// sync starts zeroed and is never reset: each launch passes base = the epochs launched before it.
// warps: consumer warps a program, 4 or 8; one_poller: one warp a program waits (4 warps only);
// trace: nullptr, or layers * 4 * P * relay_dataflow_trace_marks() int64 for the phases' clocks.
extern "C" int relay_dataflow_launch(const void* w, long long layer_step, float* ha, float* hb, void* qkv, void* gu,
                                     int* sync, int* err, int layers, int base, int mode, int weights, int warps,
                                     int one_poller, long long* trace, void* stream) {
  const Args a{static_cast<const char*>(w), layer_step, ha, hb, static_cast<__nv_bfloat16*>(qkv),
               static_cast<__nv_bfloat16*>(gu), sync, err, layers, base, trace};
  const auto s = static_cast<cudaStream_t>(stream);
  if (warps == 4) return one_poller ? launch_mode<4, true>(a, mode, weights, s) : launch_mode<4, false>(a, mode, weights, s);
  if (warps == 8 && !one_poller) return launch_mode<8, false>(a, mode, weights, s);
  return -3;
}
