"""What a rank other than 0 runs instead of a server: the model's shard and an
engine that steps only by rank 0's plans, until rank 0's engine closes."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from tierlm.config import Settings
from tierlm.engine.lockstep import Lockstep
from tierlm.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


def run(settings: Settings, model_path: Path, lockstep: Lockstep) -> int:
    return asyncio.run(_follow(settings, model_path, lockstep))


async def _follow(settings: Settings, model_path: Path, lockstep: Lockstep) -> int:
    from tierlm.pool.discovery import read_entry
    from tierlm.serving.assembly import make_engine

    named = settings.for_model(model_path.name).served_model_name
    entry = read_entry(model_path, named or model_path.name)
    engine = make_engine(entry, entry.name, settings.for_model(entry.name), None, lockstep)
    await engine.start()
    log.info("rank %d: %s loaded, following rank 0", lockstep.rank, entry.name)
    try:
        await engine.on_worker(follow_steps, engine.scheduler, lockstep)
    finally:
        await engine.close()
    log.info("rank %d: rank 0 closed its engine; stopping", lockstep.rank)
    return 0


def follow_steps(scheduler: Scheduler, lockstep: Lockstep) -> None:
    """Worker thread: every step rank 0 takes, until it says stop. Outputs are
    rank 0's to send; here they are dropped."""
    while not (plan := lockstep.share()).stop:
        scheduler.step(plan)
        scheduler.take_outputs()
