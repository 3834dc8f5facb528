"""tierlm: an LLM inference server on MLX."""
