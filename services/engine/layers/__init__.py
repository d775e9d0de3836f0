"""The engine's building blocks, shared by every model family (models/): linear layers and their
fused rows (linear.py), RMSNorm (norm.py), RoPE (rope.py), GQA attention over the paged cache
(attention.py), MLA and DSA attention (mla.py), the SwiGLU MLP (mlp.py), MoE (moe.py), FP8 layers
(fp8.py), the LM head's logits (embed_head.py) and the sampler (sampler.py). Import the submodules
directly."""
