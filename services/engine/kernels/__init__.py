"""Triton kernels of the engine's GPU paths (docs/kernels.md); the kernels the
trainer shares are in ops/. Import the submodules directly."""
