"""Kernel builds that only benchmarks run: measured alternatives to the product's kernels."""
