"""OpenAI-compatible API server (runs in its own processes; never imports torch)."""
