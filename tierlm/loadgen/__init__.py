"""The load generator: workloads (what to send), a streaming OpenAI-compatible
client that times every output chunk (client), and the timings' summary
(metrics). `tierlm bench` and the dashboard's benchmark both run it; it imports
nothing of either, nor of the server."""
