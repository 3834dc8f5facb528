"""One model over several ranks (mx.distributed, started by `mlx.launch`).

Rank 0 runs the HTTP server, the scheduler's decisions and its cache tiers;
every rank holds a shard of the model (mlx-lm's tensor-parallel `shard`) and
runs the same engine steps in lockstep (engine/lockstep.py). ranks.py joins the
group (the CLI hands rank 0's place down to the model pool); follower.py is
what the other ranks run instead of a server."""
