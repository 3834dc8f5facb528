"""What the API adapters share about a turn's shape: tool-call formats and
their parsers, grammars (llguidance) for tools and JSON schemas, and the
splitting of reasoning text. Knows no HTTP and no MLX: an adapter turns its
API's fields into a `Turn`, and the turn's events back into its API's shape."""
