"""Joining the ranks `mlx.launch` started (once per process, at start)."""

from __future__ import annotations

import logging
import os

from tierlm.engine.lockstep import Lockstep

log = logging.getLogger(__name__)


def join() -> Lockstep | None:
    """This process's place among several ranks (MLX_RANK set by `mlx.launch`),
    or None when it runs alone. The backend is MLX's choice from what the
    launcher set up (ring over TCP, MPI, NCCL on CUDA, JACCL on Macs)."""
    if "MLX_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        return None
    import mlx.core as mx

    group = mx.distributed.init(strict=True)
    if group.size() < 2:
        return None
    lockstep = Lockstep(group)
    log.info("rank %d of %d (pid %d): %s", group.rank(), group.size(), os.getpid(),
             "serving HTTP, deciding every step" if lockstep.leader else "following rank 0's steps")
    return lockstep
