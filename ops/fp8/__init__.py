"""DeepSeek-V3 block-scaled FP8: the recipe and its torch references (recipe.py), FP8 checkpoints
(checkpoint.py), the Triton kernels (triton_gemm.py, triton_quant.py, the measured dispatch table
fp8_configs.json), the Hopper CUDA GEMM (cuda/) and the dispatch between them (dispatch.py)."""
