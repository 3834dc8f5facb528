"""tierlm: an LLM inference server on MLX."""

from tierlm.backends.cpu import route

route.preload()  # before anything imports mlx.core
