"""Model definitions per family on top of layers/: qwen3.py (dense Qwen3 and Llama-3), qwen3_moe.py,
deepseek_v3.py (MLA + MoE, also Kimi-K2), glm5.py (DeepSeek-V3 with DSA); the decoder they share
(decoder.py: a pre-norm block, the stack, the causal LM with its weight loading). Import the
submodules directly."""
