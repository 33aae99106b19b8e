"""vLLM v1's engine, small: requests, KV cache manager, scheduler, engine core, `LLM`.

Importing this package stays torch-free (API servers import its frontend-side modules);
modules that need torch import it themselves.

Engine side (runs in the engine-core process, or in-process under `LLM`):

* `request` — `Request`: tokens, ``num_computed_tokens``, status, block hashes.
* `block_pool` / `kv_cache_manager` — paged KV blocks, block tables, prefix caching.
* `scheduler` (+ `request_queue`) — the token-budget `Scheduler`.
* `core` — `EngineCore`: ``add_request`` / ``abort_requests`` / ``step`` / ``stats`` /
  ``handshake_info`` / ``shutdown``.

Frontend side (torch-free; API servers and `LLM`):

* `tokenizer` — `load_tokenizer(ModelFiles.tokenizer_dir, chat_template=...)`.
* `input_processor` — `InputProcessor`: text / token ids / chat messages →
  `ProcessedRequest` holding the `EngineCoreRequest`\\ s (``n > 1`` fanned out).
* `output_processor` — `OutputProcessor`: `EngineCoreOutput`\\ s → `RequestOutput`\\ s
  (incremental detokenization, stop strings, logprobs, ``n > 1`` aggregation).

An ``AsyncLLM`` is these two around an engine client::

    processed = input_processor.process_chat(request_id, messages, params)  # ValueError -> 400
    output_processor.add_request(processed)
    for req in processed.engine_requests:
        client.send(AddRequest(request=req))
    # on every EngineOutputs frame:
    result = output_processor.process_outputs(frame.outputs)
    if result.reqs_to_abort:
        client.send(AbortRequests(request_ids=result.reqs_to_abort))
    for ro in result.request_outputs:        # ro.request_id is the client's request_id
        queues[ro.request_id].put(ro)         # ro.finished marks the last one
    # client gone:
    client.send(AbortRequests(request_ids=output_processor.abort_requests([request_id])))
"""
