"""Model implementations written for the paged KV cache, one file per family."""
