"""Triton kernels of the engine's GPU paths (docs/architecture.md "GPU path"; fp8_gemm: docs/fp8.md).
Import the submodules directly."""
