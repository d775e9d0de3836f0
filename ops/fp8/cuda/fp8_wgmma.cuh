// Block-scaled FP8 GEMM for Hopper (sm_90a), DeepSeek-V3 recipe:
//   C (M, N) bf16 = sum over 128-wide K blocks kb of (A_kb @ B_kb^T) * sa[m, kb] * sb[n / 128, kb]
// with A (M, K) and B (N, K) E4M3, K contiguous (both "K-major", the only fp8 wgmma layout).
//
// Why a CUDA kernel next to the Triton ones: the recipe promotes the tensor cores' partial sum
// to float32 after every 128-wide K block. In Triton that promotion waits for the block's MMAs
// and the tensor cores sit idle meanwhile (every Triton formulation measured 0.65-0.85 PFLOP/s
// on the H200). Here, as in DeepGEMM, the work is split by role:
//   - one producer warp feeds a ring of shared-memory stages with the bulk tensor copy engine
//     (TMA: A tile, B tile and the A tile's scales, one mbarrier per stage);
//   - two math warpgroups each own 64 rows of the 128-row tile. A warpgroup issues the block's
//     four m64nNk32 wgmmas into a fresh accumulator, waits, and scales-and-adds it into its
//     float32 accumulator. While one warpgroup does that on the CUDA cores, the other one's
//     wgmmas keep the tensor cores busy.
// The grid is persistent (one CTA per SM, tiles in grouped order for L2 reuse), so the producer
// prefetches the next tile while the math warpgroups store the last one. The same kernel runs MoE
// experts' grouped GEMMs (GROUPED mode: each expert's rows against its own weight, one launch).
//
// This header holds the kernel template and its launcher; a library exports a table of
// instantiations (`Variant`) through RELAY_FP8_GEMM_ENTRY_POINTS. fp8_wgmma.cu is the product's
// (built at run time by fp8_wgmma.py: nvcc, then ctypes).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sm90_sync.cuh"

namespace {

using namespace relay_sm90;

constexpr int BK = 128;  // one scale block: the promotion period
constexpr int GROUP_M = 8;
constexpr int BM = 128;        // two math warpgroups x 64 rows
constexpr int THREADS = 384;   // one producer warpgroup + two math warpgroups
// The producer's and the math warpgroups' K loops are unrolled K_UNROLL times (RELAY_K_UNROLL
// overrides it at build time). Unrolled 4x the kernel ran 1.00-1.05x itself not unrolled (median
// 1.02x, one H100), as fast as libraries compiled per weight shape with N and K constant and the
// loop unrolled 8x (DeepGEMM's way), so no per-shape library is built. Unrolling a whole short
// loop (a fixed K of 512-1152) ran ptxas out of registers for the wgmma pipeline and serialised it
// (C7511), 0.87-0.92x: fp8_wgmma.serialised reads the build log.
#ifdef RELAY_K_UNROLL
constexpr int K_UNROLL = RELAY_K_UNROLL;
#else
constexpr int K_UNROLL = 4;
#endif
// setmaxnreg split of the 64K registers: 128 * (40 + 2 * 232) <= 65536.
constexpr int PRODUCER_REGS = 40;
constexpr int MATH_REGS = 232;

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// Shared-memory matrix descriptor: K-major tile, 128-byte swizzle (what TMA's SWIZZLE_128B writes),
// 8-row core groups 1024 bytes apart. The leading offset is unused for swizzled K-major tiles.
// Kept as its low word (start address >> 4, and the unused leading offset 1): the high word is
// the same constant for every tile, and stepping along K adds to the address field only (it
// cannot carry out of it: shared addresses stay below 2^18). Descriptors built from warp-uniform
// values this way stay in uniform registers, so issuing a wgmma costs no R2UR moves and no 64-bit
// vector arithmetic (a SASS comparison: with vector descriptors ~120 non-FMA instructions per K
// block and warp, DeepGEMM's ~60).
constexpr uint32_t DESC_HI = (1024 >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t smem_desc_lo(const void* p) { return ((smem_u32(p) & 0x3FFFF) >> 4) | (1u << 16); }
__device__ __forceinline__ uint64_t smem_desc(uint32_t lo) { return (uint64_t(DESC_HI) << 32) | lo; }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

// Keeps the compiler from moving register reads or writes of an accumulator across a wgmma
// issue or wait (the registers change asynchronously).
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// D (64 x 128, f32) = (accumulate ? D : 0) + A (64 x 32, e4m3) @ B (128 x 32, e4m3)^T
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(accumulate));
}

// A float from shared memory by its shared-window address (a plain pointer dereference compiled
// to a generic load here).
__device__ __forceinline__ float lds(const float* p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(smem_u32(p)));
  return v;
}

// Tile `tile` of a grouped (GROUP_M rows of tiles at a time) walk: better L2 reuse of B.
__device__ __forceinline__ void tile_of(int tile, int tiles_m, int tiles_n, int& tm, int& tn) {
  const int group_size = GROUP_M * tiles_n;
  const int first_m = (tile / group_size) * GROUP_M;
  const int rows = min(tiles_m - first_m, GROUP_M);
  const int in_group = tile % group_size;
  tm = first_m + in_group % rows;
  tn = in_group / rows;
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Arrive on the mbarrier at the same shared-memory offset in CTA `rank` of the cluster. Default
// (CTA-scope) semantics, as CUTLASS's ClusterBarrier does: the arrival only says that this warp's
// wgmmas have finished reading the stage. `.release.cluster` here compiled to a GPU-wide memory
// barrier and an L1 invalidation per arrival and made the cluster variants 1.5-2x slower
// (Nsight Compute, H200).
//
// The single-thread operations here and below take their condition as a predicate inside the asm
// instead of an `if` around it: a branch on the lane is a divergent path to ptxas, and a divergent
// path while wgmmas are in flight makes it serialise them (warning C7518), which would undo
// OVERLAP (the next tile's wgmmas run through this tile's epilogue and its TMA-store issue).
__device__ __forceinline__ void mbar_arrive_cluster_if(bool pred, uint64_t* bar, uint32_t rank) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b32 remote;\nsetp.ne.b32 p, %0, 0;\n"
      "mapa.shared::cluster.u32 remote, %1, %2;\n@p mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(
          static_cast<int>(pred)),
      "r"(smem_u32(bar)), "r"(rank)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive_if(bool pred, uint64_t* bar) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%1];\n}" ::"r"(
                   static_cast<int>(pred)),
               "r"(smem_u32(bar))
               : "memory");
}

// The same box lands at the same offset in every CTA of `mask`, signalling each one's mbarrier.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                                      uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}

// Four 8x8 bf16 matrices to shared memory: lanes 8i..8i+7 give the row addresses of matrix i,
// register i holds a lane's two elements of matrix i in the mma accumulator layout.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Shared -> global bulk tensor copy (rows and columns outside the tensor are not written).
// Issued and committed as one bulk group by the threads where `pred` holds.
__device__ __forceinline__ void tma_store_2d_if(bool pred, const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n"
      "@p cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%1, {%3, %4}], [%2];\n"
      "@p cp.async.bulk.commit_group;\n}" ::"r"(static_cast<int>(pred)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1)
      : "memory");
}
// Until at most N of this thread's bulk groups still read shared memory (where `pred` holds).
template <int N>
__device__ __forceinline__ void bulk_wait_read_if(bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p cp.async.bulk.wait_group.read %1;\n}" ::"r"(
                   static_cast<int>(pred)),
               "n"(N)
               : "memory");
}
// Until all of this thread's bulk groups have completed (global writes done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Generic-proxy shared-memory writes made visible to the async proxy (the TMA store).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// GROUPED: the most experts (groups) one launch takes; their tile and row tables live in shared
// memory.
constexpr int MAX_GROUPS = 1024;

template <int BN, int STAGES, bool GROUPS = false>
struct Smem {
  static constexpr int A = BM * BK;  // bytes per stage
  static constexpr int B = BN * BK;
  // GROUPED: 4 rows more. A group's tiles start at any row, but a TMA box must start 16 bytes
  // into the scales' rows (else an illegal instruction): the box starts at the row rounded down
  // to a multiple of 4, and the tile's scales sit (m0 % 4) floats into it. Each stage's box
  // starts 128-byte aligned, as a TMA destination must.
  static constexpr int SA_BOX = (BM + (GROUPS ? 4 : 0)) * 4;
  static constexpr int SA = (SA_BOX + 127) / 128 * 128;
  // The weight scales: 8 blocks of this K block around the tile's (one 32-byte box, padded to
  // the 128-byte alignment a TMA destination needs). The box starts at a multiple of 4 blocks:
  // a box whose first element is not 16-byte aligned in global memory faults (illegal instruction
  // on the H200), so the tile's blocks sit at offset (n0 / 128) % 4 in it.
  static constexpr int SB = 128;
  // GROUPED: per group, the m-tiles before it and its first row (MAX_GROUPS + 1 ints each).
  static constexpr int G = GROUPS ? 2 * (MAX_GROUPS + 1) * 4 : 0;
  static constexpr int BYTES = 1024 + STAGES * (A + B + SA + SB) + 2 * STAGES * 8 + G;
};

// Flag on MODE: the epilogue goes through shared memory and TMA stores (see the kernel comment).
constexpr int TMA_STORE = 4;
// Flag on TMA_STORE at BN 256: the next tile's first K block runs on the tensor cores during this
// tile's epilogue (see the kernel comment).
constexpr int OVERLAP = 16;
// Flag on TMA_STORE, CLUSTER 1: MoE experts' grouped GEMM. A's rows are sorted by group (offs:
// cumulative row ends), B holds one (N, K) weight per group, stacked (E * N rows), and the weight
// scales are K-block-major with each group's ceil(N / 128) blocks padded to a multiple of 4 (the
// 32-byte box then starts in the group's own blocks, as in the dense kernel). A group's rows are
// cut into 128-row tiles of their own: the walk runs over every group's m-tiles x the column
// tiles, so no tile mixes two groups' rows. A group's last tile, when it ends before the next
// group's rows start, is stored by the direct epilogue with the rows clipped at the group's end
// (a TMA store would write the next group's rows too).
constexpr int GROUPED = 64;
template <int BN, int STAGES, int MODE>
using SmemOf = Smem<BN, STAGES, (MODE & GROUPED) != 0>;

// Measured and left out (each in one process against this kernel's default configuration, which
// was the fastest in those interleaved timings, one H100 or H200):
// - a second partial sum per warpgroup at BN 128 (block kb+1's wgmmas issued before block kb is
//   promoted), and 256 x 128 tiles with each warpgroup two m64 blocks sharing B and clusters
//   sharing A (DeepGEMM's SM90 choice for these shapes);
// - the weight scales loaded from global memory a block ahead instead of arriving with the stage
//   as one TMA box (cuBLAS's way: an LDS per block): the box was 2-14% faster, as the L2 latency
//   under the TMA stream can outlast a block;
// - the epilogue through a buffer of its own with a stage fewer (DeepGEMM's layout): 0.97-1.00x
//   the lent ring slot; 16 KB of shared memory of their own for the boxes a lent slot cannot
//   hold: 0.995-1.011x;
// - the descriptors stepped from per-warpgroup bases (9.8 instead of 11.5 non-FFMA instructions
//   per wgmma): 0.96-1.01x, the K loop's issue slots are not what limits it;
// - stream-K over the walk's last T % P + P steps (float32 partial sums exchanged through a
//   global workspace): at M >= 4096 the exchange cost each walker ~10 us, more than the short
//   last round it recovered (0.84-1.00x); below one wave it stayed at 0.47-0.79x cuBLAS
//   block-wise, which the dispatch table picks there;
// - 2 x 2 clusters (each CTA multicasting half of A to its cluster row and half of B to its
//   column): 0.74-0.97x, a stage waits for the slowest of three CTAs' math warps.

// BN: 128 or 256 output columns per tile (each 128 a weight-scale block; with 256 a math
// warpgroup runs the two halves one after the other through one 64-register partial sum, so the
// float32 accumulators fit: 128 + 64 registers). A math warpgroup issues a block's wgmmas, waits,
// and promotes; the other warpgroup's wgmmas keep the tensor cores busy meanwhile.
// CLUSTER 2: two CTAs with the same columns and neighbouring rows share the B tile, each loading
// half of it and multicasting it to both (a third less L2 -> SM traffic at BN 256).
// MODE | TMA_STORE: the epilogue without per-thread global stores. After a tile's last K block the
// producer lends the math warpgroups the next ring slot instead of filling it (an arrival on its
// full barrier with no copy). Each math warpgroup converts its 64 x BN rows to bf16, writes them
// with stmatrix into that slot's A and B space as 64 x 64 boxes in the 128-byte swizzle, and
// hands each box to one TMA store; ragged edges are clipped by the tensor map. The stores run
// while the next tile's wgmmas do: the slot goes back to the producer only after the stores have
// read it, checked once the next tile's first wgmma group is issued. The direct epilogue left the
// tensor cores idle while 8 warps issued 64 scattered 4-byte stores each (per 128x256 tile), and
// cost more at K = 2048 (16 blocks per tile) than at K = 7168 (H200: even a kernel without the
// scales lost 20% there). Needs ldc % 8 == 0 and a 16-byte aligned C (TMA); otherwise the launch
// falls back to the direct epilogue.
// MODE | OVERLAP: both warpgroups reach the epilogue together, so without it the tensor cores idle
// through it (at K = 2048 a tile is only 16 K blocks). Here a warpgroup issues the first column
// half of the next tile's first K block before storing this tile, so the two warpgroups' 2 x 4
// wgmmas run under the epilogue. The next tile starts both accumulators from that block with a
// multiply instead of zeroing them and adding.
template <int BN, int STAGES, int MODE, int CLUSTER>
__global__ void __launch_bounds__(THREADS, 1)
    fp8_gemm_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                    const __grid_constant__ CUtensorMap tm_sa, const __grid_constant__ CUtensorMap tm_c,
                    const __grid_constant__ CUtensorMap tm_sb, const float* __restrict__ sb,
                    __nv_bfloat16* __restrict__ c, int M, int N, int K, int ldc,
                    const int* __restrict__ offs, int groups) {
  constexpr bool EPI_TMA = (MODE & TMA_STORE) != 0;
  constexpr bool OVL = (MODE & OVERLAP) != 0;
  static_assert(!OVL || EPI_TMA, "OVERLAP: with TMA_STORE");
  constexpr int RW = BM / 2;     // rows per math warpgroup
  constexpr int NH = BN / 128;   // 128-column halves (one weight-scale block each)
  constexpr int SUBS = NH;       // partial sums per K block: one per column half
  static_assert(!OVL || SUBS == 2, "OVERLAP: two partial sums per K block");
  constexpr bool GROUPED_ = (MODE & GROUPED) != 0;
  static_assert(!GROUPED_ || (EPI_TMA && CLUSTER == 1), "GROUPED: TMA_STORE, no cluster");
  using L = SmemOf<BN, STAGES, MODE>;
  // 128-byte swizzled tiles must start on 1024-byte boundaries (the swizzle pattern's period).
  // Declared aligned rather than aligned at run time: generic-pointer arithmetic on the shared
  // window's address is per-thread vector work, and everything derived from it (the wgmma
  // descriptors) would leave the uniform registers.
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* s_a = smem;
  uint8_t* s_b = s_a + STAGES * L::A;
  float* s_sa = reinterpret_cast<float*>(s_b + STAGES * L::B);
  constexpr int SAF = L::SA / 4;      // activation-scale floats per stage
  float* s_sb = s_sa + STAGES * SAF;  // L::SB / 4 floats per stage
  uint64_t* full = reinterpret_cast<uint64_t*>(s_sb + STAGES * (L::SB / 4));
  uint64_t* empty = full + STAGES;
  // GROUPED: s_mt[g] = m-tiles of the groups before g, s_row[g] = group g's first row (g <= groups).
  int* s_mt = reinterpret_cast<int*>(empty + STAGES);
  int* s_row = s_mt + MAX_GROUPS + 1;

  // Broadcast from lane 0: the compiler then knows the warpgroup index is warp-uniform, and keeps
  // everything derived from it (the wgmma descriptors) in uniform registers.
  const int wg = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);
  const int tid = threadIdx.x % 128;
  const int nkb = K / BK;
  const int nb = (N + 127) / 128;  // weight-scale rows
  if constexpr (GROUPED_) {
    // The group tables, by warp 0: a warp-wide scan, 32 groups a step.
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      int carry = 0;
      for (int base = 0; base < groups; base += 32) {
        const int g = base + lane;
        const int start = g < groups && g > 0 ? offs[g - 1] : 0;
        const int end = g < groups ? offs[g] : 0;
        int v = g < groups ? (end - start + BM - 1) / BM : 0;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const int y = __shfl_up_sync(0xffffffff, v, d);
          if (lane >= d) v += y;
        }
        if (g < groups) {
          s_mt[g + 1] = carry + v;
          s_row[g + 1] = end;
        }
        carry += __shfl_sync(0xffffffff, v, 31);
      }
      if (lane == 0) s_mt[0] = s_row[0] = 0;
    }
    __syncthreads();  // before the walk's length is read
  }
  const int nbp = (nb + 3) & ~3;  // GROUPED: a group's weight-scale blocks, padded
  const int tiles_m = GROUPED_ ? s_mt[groups] : (M + BM - 1) / BM;
  const int tiles_n = (N + BN - 1) / BN;
  // With a cluster, one step of the walk is CLUSTER vertically adjacent tiles, one per CTA (sharing B).
  const int walk_m = (tiles_m + CLUSTER - 1) / CLUSTER;
  const int walk_n = tiles_n;
  const int num_tiles = walk_m * walk_n;
  const int rank = CLUSTER > 1 ? static_cast<int>(cluster_rank()) : 0;
  // The output tile of walk step `tile` for this CTA; GROUPED: also its group g and the row
  // where the group ends (else g = 0, m_end = M).
  auto origin = [&](int tile, int& m0, int& n0, int& g, int& m_end) {
    int tm, tn;
    tile_of(tile, walk_m, walk_n, tm, tn);
    g = 0;
    m_end = M;
    if constexpr (GROUPED_) {
      // The last group whose m-tiles start at or before tm (an empty group starts where the next
      // one does, so the last of equal starts is the one that has rows).
      int lo = 0, hi = groups;
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (s_mt[mid] <= tm)
          lo = mid;
        else
          hi = mid;
      }
      g = lo;
      m0 = s_row[g] + (tm - s_mt[g]) * BM;
      m_end = s_row[g + 1];
    } else {
      m0 = (tm * CLUSTER + rank) * BM;
    }
    n0 = tn * BN;
  };
  const int first = static_cast<int>(blockIdx.x) / CLUSTER;
  const int stride = static_cast<int>(gridDim.x) / CLUSTER;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8 * CLUSTER);  // every math warp of every CTA reading the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (CLUSTER > 1)
    cluster_sync();  // the peer's barriers exist before anything signals them
  else
    __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
    // One warp runs the producer loop convergently (the cluster barrier at the end is .aligned:
    // a warp must reach it whole); its lane 0 issues the copies.
    if (tid < 32) {
      const bool leader = tid == 0;
      if (leader) {
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tm_a)) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tm_b)) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tm_sa)) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tm_sb)) : "memory");
      }
      int it = 0;
      for (int tile = first; tile < num_tiles; tile += stride) {
        int m0, n0, g, m_end;
        origin(tile, m0, n0, g, m_end);
        const int b_row = g * N + n0;                  // GROUPED: group g's weight rows
        const int sb_col = (g * nbp + n0 / 128) & ~3;  // and its weight-scale blocks
#pragma unroll K_UNROLL
        for (int kb = 0; kb < nkb; ++kb, ++it) {
          const int s = it % STAGES;
          mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
          if (leader) {
            mbar_expect_tx(&full[s], L::A + L::B + L::SA_BOX + 32);
            tma_load_2d(s_sa + s * SAF, &tm_sa, &full[s], GROUPED_ ? m0 & ~3 : m0, kb);
            tma_load_2d(s_sb + s * (L::SB / 4), &tm_sb, &full[s], sb_col, kb);
            constexpr uint16_t ALL = (1 << CLUSTER) - 1;
            tma_load_2d(s_a + s * L::A, &tm_a, &full[s], kb * BK, m0);
            if constexpr (CLUSTER > 1) {
              constexpr int PART = BN / CLUSTER;
              tma_load_2d_multicast(s_b + s * L::B + rank * PART * BK, &tm_b, &full[s], kb * BK, n0 + rank * PART, ALL);
            } else {
              tma_load_2d(s_b + s * L::B, &tm_b, &full[s], kb * BK, b_row);
            }
          }
          __syncwarp();
        }
        if constexpr (EPI_TMA) {
          // The epilogue's slot: no copy, just mark it full for the math warpgroups.
          const int s = it % STAGES;
          mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
          if (leader) mbar_arrive(&full[s]);
          __syncwarp();
          ++it;
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(MATH_REGS) : "memory");
    const int half = wg - 1;  // rows half*RW .. half*RW+RW-1 of the tile
    const int warp = __shfl_sync(0xffffffff, tid / 32, 0);  // warp-uniform, as wg above
    const int lane = tid % 32;
    // This thread's rows of the tile: r_local and r_local + 8.
    const int r_local = half * RW + warp * 16 + lane / 4;
    // Row r_local's activation scale of stage s.
    int sa_shift = 0;  // GROUPED: the tile's first row's place in its scale box (m0 % 4)
    auto sa_at = [&](int s, int offset) { return lds(s_sa + s * SAF + sa_shift + r_local + offset); };
    // One arrival per CTA of the cluster, lane r signalling CTA r: one instruction for the warp.
    auto release = [&](int s) {
      __syncwarp();
      if constexpr (CLUSTER == 1)
        mbar_arrive_if(lane == 0, &empty[s]);
      else
        mbar_arrive_cluster_if(lane < CLUSTER, &empty[s], static_cast<uint32_t>(lane % CLUSTER));
    };
    float acc[SUBS][64];
    float part[64];
    int it = 0;

    // Block kb's wgmmas for partial sum u (column half u) on stage s into p (accumulate: add to p).
    auto issue = [&](float(&p)[64], int s, int u, int accumulate) {
      const uint32_t da = smem_desc_lo(s_a + s * L::A + half * RW * BK);
      const uint32_t db = smem_desc_lo(s_b + s * L::B + u * 128 * BK);
      fence_regs(p);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 32; ++kk) {
        // +32 bytes along K inside the swizzled 128-byte row: the descriptor address is in
        // 16-byte units, and the swizzle is applied to absolute addresses, so this is exact.
        wgmma_m64n128k32(p, smem_desc(da + 2 * kk), smem_desc(db + 2 * kk), kk > 0 || accumulate);
      }
      wgmma_commit();
    };
    // EPI_TMA: the ring slot whose TMA stores (issued by this warpgroup's thread 0) may still be
    // reading it; warp 0 of the warpgroup releases it once they have (the other warps released
    // it when they had written their rows).
    int pending = -1;
    auto flush_pending = [&]() {
      if constexpr (EPI_TMA) {
        if (warp == 0 && pending >= 0) {
          bulk_wait_read_if<0>(tid == 0);
          release(pending);
        }
        pending = -1;
      }
    };

    // acc[h] += p * row scale * column-block scale.
    auto promote = [&](float(&a)[64], const float(&p)[64], float s0, float s1) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        a[4 * j + 0] = fmaf(p[4 * j + 0], s0, a[4 * j + 0]);
        a[4 * j + 1] = fmaf(p[4 * j + 1], s0, a[4 * j + 1]);
        a[4 * j + 2] = fmaf(p[4 * j + 2], s1, a[4 * j + 2]);
        a[4 * j + 3] = fmaf(p[4 * j + 3], s1, a[4 * j + 3]);
      }
    };

    // The direct epilogue: each thread stores its fragment's column pairs, rows below m_bound.
    auto store_direct = [&](int m0, int n0, int m_bound) {
#pragma unroll
      for (int h = 0; h < SUBS; ++h) {
        const int row0 = m0 + r_local;
        const int row1 = row0 + 8;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int col = n0 + h * 128 + 8 * j + 2 * (lane % 4);
          if (col < N) {
            if (row0 < m_bound)
              *reinterpret_cast<__nv_bfloat162*>(c + static_cast<size_t>(row0) * ldc + col) =
                  __floats2bfloat162_rn(acc[h][4 * j + 0], acc[h][4 * j + 1]);
            if (row1 < m_bound)
              *reinterpret_cast<__nv_bfloat162*>(c + static_cast<size_t>(row1) * ldc + col) =
                  __floats2bfloat162_rn(acc[h][4 * j + 2], acc[h][4 * j + 3]);
          }
        }
      }
    };

    // OVL: every tile's first K block has its first half in flight at the loop head, in part:
    // issued here for the first tile, during the previous epilogue for the others. One shape on
    // every path, which ptxas can prove (the wgmmas stay asynchronous). Only part: a wgmma into
    // an accumulator that the K loop also promotes into makes ptxas serialise every wgmma (C7515).
    if constexpr (OVL) {
      if (first < num_tiles) {
        mbar_wait(&full[0], 0);
        issue(part, 0, 0, 0);
      }
    }
    for (int tile = first; tile < num_tiles; tile += stride) {
      int m0, n0, g, m_end;
      origin(tile, m0, n0, g, m_end);
      if constexpr (GROUPED_) sa_shift = m0 & 3;
      if constexpr (!OVL) {
#pragma unroll
        for (int u = 0; u < SUBS; ++u)
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[u][i] = 0.f;
      }

      const int sb_off = (n0 / 128) % 4;  // the tile's first weight-scale block in the box
      int kb0 = 0;
      if constexpr (OVL) {
        const int s = it % STAGES;
        // Partial sum u's scales: the rows' activation scales times weight block u. The row
        // offset 64 * (u / NH) is 0; written so, the kernel compiles to the SASS that was
        // measured (a literal 0 schedules these multiplies one slot later).
        float s0[SUBS], s1[SUBS];
#pragma unroll
        for (int u = 0; u < SUBS; ++u) {
          const float w = lds(s_sb + s * (L::SB / 4) + sb_off + u);
          s0[u] = sa_at(s, 64 * (u / NH)) * w;
          s1[u] = sa_at(s, 64 * (u / NH) + 8) * w;
        }
        // The first K block starts both accumulators: a multiply, no add.
        auto start = [&](float(&a)[64], float s0, float s1) {
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            a[4 * j + 0] = part[4 * j + 0] * s0;
            a[4 * j + 1] = part[4 * j + 1] * s0;
            a[4 * j + 2] = part[4 * j + 2] * s1;
            a[4 * j + 3] = part[4 * j + 3] * s1;
          }
        };
        wgmma_wait<0>();
        fence_regs(part);
        flush_pending();
        start(acc[0], s0[0], s1[0]);
        issue(part, s, 1, 0);
        wgmma_wait<0>();
        fence_regs(part);
        release(s);
        start(acc[1], s0[1], s1[1]);
        ++it;
        kb0 = 1;
      }
#pragma unroll K_UNROLL
      for (int kb = kb0; kb < nkb; ++kb, ++it) {
        const int s = it % STAGES;
        mbar_wait(&full[s], (it / STAGES) & 1);
        const float sa0 = sa_at(s, 0);
        const float sa1 = sa_at(s, 8);
        float sb_now[NH];
#pragma unroll
        for (int h = 0; h < NH; ++h) sb_now[h] = lds(s_sb + s * (L::SB / 4) + sb_off + h);
#pragma unroll
        for (int u = 0; u < SUBS; ++u) {
          issue(part, s, u, 0);
          if (u == 0 && kb == 0) flush_pending();
          wgmma_wait<0>();
          fence_regs(part);
          if (u == SUBS - 1) release(s);
          promote(acc[u], part, sa0 * sb_now[u], sa1 * sb_now[u]);
        }
      }

      // Fragment layout of m64nNk32 (per warp 16 rows): value 4j+{0,1} is row lane/4, columns
      // 8j + 2*(lane%4) + {0,1}; value 4j+{2,3} the same columns of row lane/4 + 8.
      if constexpr (EPI_TMA) {
        const int s = it % STAGES;  // the slot the producer lent for this epilogue
        mbar_wait(&full[s], (it / STAGES) & 1);
        ++it;
        // OVL: the first half of the next tile's first K block (ring slot `it`).
        const bool preissue = OVL && tile + stride < num_tiles;
        const int s_next = it % STAGES;
        if constexpr (OVL) {
          if (preissue) {
            mbar_wait(&full[s_next], (it / STAGES) & 1);
            issue(part, s_next, 0, 0);
          }
        }
        if constexpr (GROUPED_) {
          if (m0 + BM > m_end && m_end < M) {
            // A group's last tile with the next group's rows after it: clipped direct stores,
            // and the lent slot goes straight back (no TMA store reads it).
            store_direct(m0, n0, m_end);
            release(s);
            continue;
          }
        }
        // 8 KB boxes (64 rows x 64 bf16 columns, 128-byte swizzled rows): the slot's A space,
        // then its B space, split between the two warpgroups.
        constexpr int BOX = 64 * 128;
        constexpr int A_BOXES = L::A / BOX;
        constexpr int BOXES = BN / 64;  // per warpgroup: its 64 rows' boxes across the tile
        // Per warpgroup: 2 (BN 128) or 3 (BN 256) in a lent slot.
        constexpr int SLOTS = (L::A + L::B) / BOX / 2;
        constexpr int FIRST = BOXES < SLOTS ? BOXES : SLOTS;
        auto slot = [&](int k) -> uint8_t* {
          const int g = half * SLOTS + k;
          return g < A_BOXES ? s_a + s * L::A + g * BOX : s_b + s * L::B + (g - A_BOXES) * BOX;
        };
        // stmatrix x4: lanes 8q..8q+7 address rows (q & 1) * 8 + lane % 8 of the warp's 16, 16-byte
        // column chunk 2 * p + (q >> 1) of the box; the swizzle XORs the chunk with row % 8.
        const int q = lane / 8;
        const int rr = lane % 8;
        const uint32_t row_off = static_cast<uint32_t>((warp * 16 + (q & 1) * 8 + rr) * 128);
        // Box b: columns 64 b .. 64 b + 63, so partial sum (column half) b / 2.
        auto write_box = [&](int b, uint8_t* dst) {
          const int h = b / 2;
          const uint32_t base = smem_u32(dst) + row_off;
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            const int j = (b % 2) * 8 + 2 * p;  // fragment column block within the half
            const int chunk = 2 * p + (q >> 1);
            stmatrix_x4(base + static_cast<uint32_t>((chunk ^ rr) << 4), pack_bf16(acc[h][4 * j], acc[h][4 * j + 1]),
                        pack_bf16(acc[h][4 * j + 2], acc[h][4 * j + 3]), pack_bf16(acc[h][4 * j + 4], acc[h][4 * j + 5]),
                        pack_bf16(acc[h][4 * j + 6], acc[h][4 * j + 7]));
          }
        };
        auto store_box = [&](int b, const uint8_t* src) {
          tma_store_2d_if(tid == 0, &tm_c, src, n0 + 64 * b, m0 + half * RW);
        };
#pragma unroll
        for (int j = 0; j < FIRST; ++j) write_box(j, slot(j));
        fence_async_smem();
        named_sync(1 + half, 128);
#pragma unroll
        for (int j = 0; j < FIRST; ++j) store_box(j, slot(j));
#pragma unroll
        for (int j = FIRST; j < BOXES; ++j) {
          bulk_wait_read_if<SLOTS - 1>(tid == 0);  // store j - SLOTS has read its slot
          named_sync(1 + half, 128);
          write_box(j, slot(j % SLOTS));
          fence_async_smem();
          named_sync(1 + half, 128);
          store_box(j, slot(j % SLOTS));
        }
        if (warp == 0)
          pending = s;  // released after the next tile's first wgmma issue
        else
          release(s);
        continue;
      }
      store_direct(m0, n0, M);
    }
    if constexpr (EPI_TMA) {
      flush_pending();
      if (tid == 0) bulk_wait_all();
    }
  }
  // No CTA of a cluster leaves while its peer may still signal its barriers or write its tiles.
  if constexpr (CLUSTER > 1) cluster_sync();
}

// The driver's tensor-map encoder, looked up through the runtime so that the library needs no
// link-time libcuda (build machines without a driver can compile it).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    cudaDriverEntryPointQueryResult found;
    void* p = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }
  return fn;
}

CUresult encode_2d(CUtensorMap* map, CUtensorMapDataType dtype, const void* ptr, uint64_t inner, uint64_t outer,
                   uint64_t pitch_bytes, uint32_t box_inner, uint32_t box_outer, CUtensorMapSwizzle swizzle) {
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {pitch_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem[2] = {1, 1};
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  return encode(map, dtype, 2, const_cast<void*>(ptr), dims, strides, box, elem,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// Per-device caches of launch facts (grid_for, launch) hold this many devices.
constexpr int kMaxDevices = 64;

// A launch configuration with the cluster size as an attribute (not copyable: cfg points at attr).
struct ClusterLaunch {
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = {};
  ClusterLaunch(int cluster, int grid, int smem_bytes, cudaStream_t stream) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = smem_bytes;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// CTAs to launch: one per SM (max_ctas) or per tile; with clusters, no more than can be resident
// at once (the persistent walk assumes every CTA runs from the start). GROUPED: the walk's length
// is known on the GPU only; each group adds at most one partial m-tile.
template <int BN, int STAGES, int MODE, int CLUSTER>
int grid_for(int M, int N, int max_ctas, int groups) {
  const int tiles_m = (M + BM - 1) / BM + ((MODE & GROUPED) != 0 ? groups : 0);
  const int tiles_n = (N + BN - 1) / BN;
  const int walk = (tiles_m + CLUSTER - 1) / CLUSTER * tiles_n;
  int clusters = max_ctas / CLUSTER;
  if (CLUSTER > 1) {
    // The device's resident-cluster limit for this kernel, asked once per device: the query costs
    // host time on every GEMM otherwise (an eager FP8 training step is host-bound). Racing first
    // callers store the same value.
    static int active_by_device[kMaxDevices] = {};
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return -1;
    int active = device < kMaxDevices ? active_by_device[device] : 0;
    if (active == 0) {
      const ClusterLaunch probe(CLUSTER, clusters * CLUSTER, SmemOf<BN, STAGES, MODE>::BYTES, nullptr);
      if (cudaOccupancyMaxActiveClusters(&active, fp8_gemm_kernel<BN, STAGES, MODE, CLUSTER>, &probe.cfg) !=
          cudaSuccess)
        return -1;
      if (device < kMaxDevices) active_by_device[device] = active > 0 ? active : -1;
    }
    if (active > 0) clusters = min(clusters, active);
  }
  return max(1, min(clusters, walk)) * CLUSTER;
}

template <int BN, int STAGES, int MODE, int CLUSTER>
int launch(const void* a, const void* sa, int sa_pitch, const void* b, const float* sb, int sb_pitch, void* c,
           const int* offs, int groups, int M, int N, int K, int ldc, int max_ctas, cudaStream_t stream) {
  constexpr bool GROUPED_ = (MODE & GROUPED) != 0;
  if (GROUPED_ != (offs != nullptr) || (GROUPED_ && (groups < 1 || groups > MAX_GROUPS))) return -11;
  const int b_rows = GROUPED_ ? groups * N : N;                            // the stacked weights
  const int sb_cols = GROUPED_ ? groups * (((N + 127) / 128 + 3) & ~3) : (N + 127) / 128;
  CUtensorMap tm_a, tm_b, tm_sa;
  if (encode_2d(&tm_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, a, K, M, K, BK, BM,
                CU_TENSOR_MAP_SWIZZLE_128B) != CUDA_SUCCESS)
    return -1;
  // B's box is a CTA's share of the tile: the cluster multicasts it.
  if (encode_2d(&tm_b, CU_TENSOR_MAP_DATA_TYPE_UINT8, b, K, b_rows, K, BK, BN / CLUSTER,
                CU_TENSOR_MAP_SWIZZLE_128B) != CUDA_SUCCESS)
    return -2;
  if (encode_2d(&tm_sa, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, sa, M, K / BK, static_cast<uint64_t>(sa_pitch) * 4,
                SmemOf<BN, STAGES, MODE>::SA_BOX / 4, 1,
                CU_TENSOR_MAP_SWIZZLE_NONE) != CUDA_SUCCESS)
    return -3;
  CUtensorMap tm_c = {};
  if constexpr ((MODE & TMA_STORE) != 0) {
    // TMA needs 16-byte row pitches and base: else the same variant with the direct epilogue
    // (GROUPED has none: the caller allocates its output).
    if (ldc % 8 != 0 || reinterpret_cast<uintptr_t>(c) % 16 != 0) {
      if constexpr (GROUPED_)
        return -12;
      else
        return launch<BN, STAGES, MODE & ~(TMA_STORE | OVERLAP), CLUSTER>(a, sa, sa_pitch, b, sb, sb_pitch, c, offs, groups,
                                                                          M, N, K, ldc, max_ctas, stream);
    }
    if (encode_2d(&tm_c, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, c, N, M, static_cast<uint64_t>(ldc) * 2, 64, 64,
                  CU_TENSOR_MAP_SWIZZLE_128B) != CUDA_SUCCESS)
      return -5;
  }
  // sb K-block-major (row kb holds the ceil(N/128) column blocks' scales, pitch sb_pitch floats,
  // a multiple of 4): one 8-float box per (tile, K block); blocks past N read as 0. GROUPED: each
  // group's blocks in turn, padded to a multiple of 4.
  CUtensorMap tm_sb = {};
  if (encode_2d(&tm_sb, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, sb, sb_cols, K / BK, static_cast<uint64_t>(sb_pitch) * 4,
                8, 1, CU_TENSOR_MAP_SWIZZLE_NONE) != CUDA_SUCCESS)
    return -6;
  const auto kernel = fp8_gemm_kernel<BN, STAGES, MODE, CLUSTER>;
  const int bytes = SmemOf<BN, STAGES, MODE>::BYTES;
  // The shared-memory opt-in, once per device (as the cluster limit in grid_for).
  static bool smem_set[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (device >= kMaxDevices || !smem_set[device]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (device < kMaxDevices) smem_set[device] = true;
  }
  const int grid = grid_for<BN, STAGES, MODE, CLUSTER>(M, N, max_ctas, groups);
  if (grid < 0) return -4;
  const ClusterLaunch config(CLUSTER, grid, bytes, stream);
  err = cudaLaunchKernelEx(&config.cfg, kernel, tm_a, tm_b, tm_sa, tm_c, tm_sb, sb, static_cast<__nv_bfloat16*>(c), M,
                           N, K, ldc, offs, groups);
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(cudaGetLastError());
}

// One instantiation as a library exports it: its launcher, grid size, shared memory and template
// arguments (`relay_fp8_gemm_describe` hands those to Python).
struct Variant {
  int (*launch)(const void*, const void*, int, const void*, const float*, int, void*, const int*, int, int, int, int,
                int, int, cudaStream_t);
  int (*grid)(int, int, int, int);
  int smem_bytes;
  bool grouped;
  int bn, stages, mode, cluster;
};

template <int BN, int STAGES, int MODE, int CLUSTER>
constexpr Variant variant() {
  return {launch<BN, STAGES, MODE, CLUSTER>,
          grid_for<BN, STAGES, MODE, CLUSTER>,
          SmemOf<BN, STAGES, MODE>::BYTES,
          (MODE & GROUPED) != 0,
          BN,
          STAGES,
          MODE,
          CLUSTER};
}

}  // namespace

// The C entry points of a library whose variant table is TABLE (a constexpr Variant array).
// a: (M, K) e4m3, row pitch K. sa: the (M, K/128) scales stored K-block-major, row pitch sa_pitch
// floats (>= M, a multiple of 4). b: (N, K) e4m3, row pitch K. sb: (ceil(N/128), K/128) float32
// K-block-major like sa, row pitch sb_pitch floats (a multiple of 4). c: (M, N) bf16, row pitch
// ldc. K % 128 == 0, N even, 16-byte aligned pointers. max_ctas: the most CTAs to launch (the SM
// count). Each returns 0 or an error code.
// relay_fp8_grouped_gemm, the MoE grouped GEMM: a's M rows sorted by group, offs (groups,) int32
// on the GPU: cumulative row ends (offs[groups - 1] == M, empty groups allowed); b: (groups * N,
// K) e4m3, group g's weight in rows g * N ..; sb: K-block-major, row kb holding each group's
// ceil(N/128) blocks padded to a multiple of 4, pitch sb_pitch floats; c: (M, N) bf16 with
// ldc % 8 == 0 and a 16-byte aligned base. No host synchronisation (CUDA-graph safe).
#define RELAY_FP8_GEMM_ENTRY_POINTS(TABLE)                                                                         \
  constexpr int NUM_VARIANTS = sizeof(TABLE) / sizeof(TABLE[0]);                                                   \
  extern "C" int relay_fp8_gemm(const void* a, const void* sa, int sa_pitch, const void* b, const float* sb,      \
                                int sb_pitch, void* c, int M, int N, int K, int ldc, int max_ctas, int variant,   \
                                void* stream) {                                                                   \
    if (variant < 0 || variant >= NUM_VARIANTS || TABLE[variant].grouped) return -10;                             \
    return TABLE[variant].launch(a, sa, sa_pitch, b, sb, sb_pitch, c, nullptr, 0, M, N, K, ldc, max_ctas,          \
                                 static_cast<cudaStream_t>(stream));                                              \
  }                                                                                                               \
  extern "C" int relay_fp8_grouped_gemm(const void* a, const void* sa, int sa_pitch, const void* b,               \
                                        const float* sb, int sb_pitch, void* c, const int* offs, int groups,      \
                                        int M, int N, int K, int ldc, int max_ctas, int variant, void* stream) {  \
    if (variant < 0 || variant >= NUM_VARIANTS || !TABLE[variant].grouped) return -10;                            \
    if (offs == nullptr) return -11;                                                                              \
    return TABLE[variant].launch(a, sa, sa_pitch, b, sb, sb_pitch, c, offs, groups, M, N, K, ldc, max_ctas,        \
                                 static_cast<cudaStream_t>(stream));                                              \
  }                                                                                                               \
  extern "C" int relay_fp8_gemm_grid(int variant, int M, int N, int max_ctas) {                                   \
    return variant < 0 || variant >= NUM_VARIANTS ? -10 : TABLE[variant].grid(M, N, max_ctas, 0);                \
  }                                                                                                               \
  extern "C" int relay_fp8_gemm_smem_bytes(int variant) {                                                         \
    return variant < 0 || variant >= NUM_VARIANTS ? -1 : TABLE[variant].smem_bytes;                              \
  }                                                                                                               \
  extern "C" int relay_fp8_gemm_count() { return NUM_VARIANTS; }                                                  \
  /* (BN, stages, MODE, cluster) of a variant into out[0..3]; -10 for an unknown one. */                          \
  extern "C" int relay_fp8_gemm_describe(int variant, int* out) {                                                 \
    if (variant < 0 || variant >= NUM_VARIANTS) return -10;                                                       \
    out[0] = TABLE[variant].bn;                                                                                   \
    out[1] = TABLE[variant].stages;                                                                               \
    out[2] = TABLE[variant].mode;                                                                                 \
    out[3] = TABLE[variant].cluster;                                                                              \
    return 0;                                                                                                     \
  }
