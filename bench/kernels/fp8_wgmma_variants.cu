// The product's FP8 GEMM kernel (ops/fp8/cuda/fp8_wgmma.cuh) in the configurations the benchmarks
// time against each other (fp8_wgmma_variants.py builds it; bench/fp8/wgmma.py, grouped.py,
// sass_compare.py, deepgemm.py use it). Indices 0 and 7 are the product's two.
#include "fp8_wgmma.cuh"

namespace {

constexpr Variant VARIANTS[] = {
    // 128 x 256 tiles: TMA-store epilogue with the next tile under it (the product's), without
    // OVERLAP, and the direct epilogue; each with 2-CTA clusters and without.
    variant<256, 4, TMA_STORE | OVERLAP, 2>(),  // 0
    variant<256, 4, TMA_STORE | OVERLAP, 1>(),  // 1
    variant<256, 4, TMA_STORE, 2>(),            // 2
    variant<256, 4, TMA_STORE, 1>(),            // 3
    variant<256, 4, 0, 2>(),                    // 4
    variant<256, 4, 0, 1>(),                    // 5
    // 128 x 128 tiles, 6 stages.
    variant<128, 6, TMA_STORE, 2>(),  // 6
    // MoE grouped: the product's, and without OVERLAP.
    variant<256, 4, TMA_STORE | OVERLAP | GROUPED, 1>(),  // 7
    variant<256, 4, TMA_STORE | GROUPED, 1>(),            // 8
};

}  // namespace

RELAY_FP8_GEMM_ENTRY_POINTS(VARIANTS)
