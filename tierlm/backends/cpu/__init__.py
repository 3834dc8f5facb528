"""MLX's CPU backend, made fast: a real BLAS behind a route, native kernels,
the weights' dtype and AMX packing."""
