"""Triton kernels of the engine's GPU paths (docs/architecture.md "GPU path"); the kernels the
trainer shares are in ops/. Import the submodules directly."""
