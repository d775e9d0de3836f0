"""Numerics shared by the inference engine (services/engine) and the trainer (trainer/): the FP8
recipe, its quantisers and GEMMs (fp8/), the float32 LM head (lm_head.py), the fused residual-add
+ RMSNorm and SiLU-mul kernels (fused_norm.py, launched with pdl.py), RoPE frequency scaling
(rope.py), top-k with ties to the earlier position (topk.py). Builds on services.common only. Import the submodules directly."""
