"""tierlm: an LLM inference server on MLX."""

from tierlm import cpu_blas

cpu_blas.preload()  # before anything imports mlx.core
