"""CUDA C++ kernels built with nvcc at first use (nvcc.py) and loaded through ctypes: the Hopper
FP8 GEMM (fp8_wgmma.cuh, the product's library fp8_wgmma.cu; docs/fp8.md) and the sm90 mbarrier
helpers it includes (sm90_sync.cuh, which benchmark kernels include too)."""
