"""Which models exist, which are loaded: the pool between the API and the engines."""
