"""The API process's half of the engine (vLLM v1's ``AsyncLLM`` side). Torch-free.

Runs in every API server (and inside the offline `LLM`); the engine core never imports it.

* `tokenizer` — `load_tokenizer(ModelFiles.tokenizer_dir, chat_template=...)`.
* `input_processor` — `InputProcessor`: text / token ids / chat messages →
  `ProcessedRequest` holding the `EngineCoreRequest`\\ s (``n > 1`` fanned out). The one place
  a request is validated against ``max_model_len``.
* `output_processor` — `OutputProcessor`: `EngineCoreOutput`\\ s → `RequestOutput`\\ s
  (incremental detokenization in `detokenizer`, stop strings, logprobs, ``n > 1``
  aggregation in `parallel_sampling`).
* `async_llm` — `AsyncLLM`: the two processors around an `pkgd.ipc.client.EngineClient`.
* `metrics` — the Prometheus families the API server exports.

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
