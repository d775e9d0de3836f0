// The product's FP8 GEMM library (fp8_wgmma.py builds and loads it): the kernel of fp8_wgmma.cuh
// in the configurations the engine and the trainer run.
#include "fp8_wgmma.cuh"

namespace {

// Index 0, dense: 128 x 256 tiles, 4 stages, the output through TMA stores with the next tile's
// first K block under the epilogue, 2-CTA clusters sharing B (the fastest in interleaved timings
// on one H100, 0-7% over the same without OVERLAP). At ldc % 8 != 0 it runs the direct epilogue.
// Index 1, the MoE grouped GEMM: the same schedule over each expert's rows, without clusters (a
// cluster's two row tiles could belong to two experts).
constexpr Variant VARIANTS[] = {
    variant<256, 4, TMA_STORE | OVERLAP, 2>(),
    variant<256, 4, TMA_STORE | OVERLAP | GROUPED, 1>(),
};

}  // namespace

RELAY_FP8_GEMM_ENTRY_POINTS(VARIANTS)
