"""`tierlm bench`: side-by-side runs, engine overhead, cache tiers, agents, over tierlm.loadgen.
Not imported by the server or the dashboard; the lab instruments live in bench_lab/ (not installed)."""
