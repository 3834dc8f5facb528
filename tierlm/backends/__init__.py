"""Backends: what tierlm adds to MLX on one of its devices (only the CPU backend, for now)."""
