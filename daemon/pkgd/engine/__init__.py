"""vLLM v1's engine, small: requests, KV cache manager, scheduler, engine core, `LLM`.

Importing this package stays torch-free (API servers import its frontend-side modules);
modules that need torch import it themselves.
"""
