"""vLLM v1's engine core, small: requests, KV cache manager, scheduler, `EngineCore` and its
process entry. Runs in the engine-core process (or in-process under the offline `LLM`).

Importing this package stays torch-free; modules that need torch import it themselves.

* `request` — `Request`: tokens, ``num_computed_tokens``, status, block hashes.
* `block_pool` / `kv_cache_manager` — paged KV blocks, block tables, prefix caching.
* `scheduler` (+ `request_queue`) — the token-budget `Scheduler`; it hands the runner a
  `pkgd.scheduler_output.SchedulerOutput` and reads back a `pkgd.runner_output.ModelRunnerOutput`.
* `core` — `EngineCore`: ``add_request`` / ``abort_requests`` / ``step`` / ``stats`` /
  ``handshake_info`` / ``shutdown``.
* `core_proc` — the engine-core process: ZeroMQ sockets around an `EngineCore`.

The API-process half (tokenizing, detokenizing, stop strings) is `pkgd.frontend`.
"""
