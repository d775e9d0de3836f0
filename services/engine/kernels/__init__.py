"""GPU kernels of the engine's fast path (docs/architecture.md, "GPU path"). Import the modules
directly; nothing here is imported on the CPU path."""
