"""Keeping every rank's scheduler in step with rank 0's.

Each scheduler step, rank 0 (the leader) decides and the others (followers) do
the same: one `StepPlan` per step carries what the leader's step began with
(the requests that arrived, the requests that ended since the last plan, for
whatever reason: a stop string, an abort, a fault, a refusal) and the requests
it admits. Every rank then looks the admitted prompts up in its own cache tiers
(each holds its own shard of every block) and the ranks agree on the shortest
hit (`agree_min`), so a block one rank lacks is computed by all.

Only the leader samples: its samplers' tokens are summed with the followers'
zeros inside the step's own graph (`lead_sampler`, `follow_sampler`), so every
rank feeds the same next token and no step waits for an extra round trip.
Grammars, penalties, seeds and logprobs therefore live on the leader alone.
Rows share a sampler object on a follower exactly where they do on the leader
(mlx-lm calls one sampler for the whole batch when every row has the same one,
else one per row), so the ranks' collectives come in the same order and shapes.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from tierlm.engine.request import Request


@dataclass
class StepPlan:
    arrived: list[Request] = field(default_factory=list)  # as the followers run them (follower_copy)
    ended: list[str] = field(default_factory=list)  # request ids ended on the leader since the last plan
    admitted: list[tuple[str, int]] = field(default_factory=list)  # (request id, the leader's cached tokens)
    stop: bool = False  # the leader's engine is closing: followers end

    def __bool__(self) -> bool:
        return bool(self.arrived or self.ended or self.admitted or self.stop)


_EMPTY = b""


def fingerprint_key(lockstep: Lockstep | None) -> dict:
    """What a rank's shard adds to the model's fingerprint: a block of one rank's
    heads is never another rank's, nor the whole model's."""
    return {} if lockstep is None else {"rank": lockstep.rank, "ranks": lockstep.size}


class Lockstep:
    """One rank's side of the lockstep. Every collective runs on `stream`, the
    engine's: in one stream they run in program order, the same on every rank
    (the model's own sums inside a step included)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.leader = self.rank == 0
        self.stream = None  # the engine's, set when its scheduler is built
        # why a collective failed (a rank gone): no collective runs after, as one
        # with a peer gone can wait for it forever (a rank that would never exit)
        self.broken: str | None = None

    def share(self, plan: StepPlan | None = None) -> StepPlan:
        """Every rank: the leader's plan (the leader passes it, followers get it).
        An empty plan costs one collective of one number; a plan with news, two."""
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL) if self.leader and plan else _EMPTY
        size = int(self._sum(mx.array([len(data)], dtype=mx.int32)).item())
        if size == 0:
            return StepPlan()
        payload = mx.array(np.frombuffer(data, dtype=np.uint8)) if self.leader else mx.zeros((size,), mx.uint8)
        got = self._sum(payload)
        return plan if self.leader else pickle.loads(np.array(got).tobytes())

    def agree_min(self, values: list[int]) -> list[int]:
        """The smallest of every rank's values, position by position."""
        if not values:
            return []
        out = mx.distributed.all_min(mx.array(values, dtype=mx.int32), group=self.group, stream=self.stream)
        return [int(v) for v in out.tolist()]

    def _sum(self, x: mx.array) -> mx.array:
        out = mx.distributed.all_sum(x, group=self.group, stream=self.stream)
        mx.eval(out)
        return out

    # ---- sampling: the leader's tokens on every rank ------------------------

    def lead_sampler(self, sampler):
        """The leader's `sampler`, its tokens sent to every rank."""
        group, stream = self.group, self.stream

        def sample(logprobs: mx.array) -> mx.array:
            return mx.distributed.all_sum(sampler(logprobs).astype(mx.int32), group=group, stream=stream)

        return sample

    def follow_sampler(self):
        """A follower's stand-in for a sampler: the leader's tokens."""
        group, stream = self.group, self.stream

        def sample(logprobs: mx.array) -> mx.array:
            return mx.distributed.all_sum(mx.zeros(logprobs.shape[:-1], dtype=mx.int32), group=group,
                                          stream=stream)

        return sample
