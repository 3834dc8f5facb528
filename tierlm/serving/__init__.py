"""A model served, as every front end uses it (the HTTP APIs, the dashboard, the
command line, tierlm.LLM): assembled from its folder (load, engine, turns),
its limits and request checks, its chat template, the pool's models by name."""
