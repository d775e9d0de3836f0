"""CUDA C++ kernels built with nvcc at first use (nvcc.py) and loaded through ctypes: the Hopper
FP8 GEMM (fp8_wgmma; docs/fp8.md) and the mbarrier helpers it shares with the benchmarks."""
