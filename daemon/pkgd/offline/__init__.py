"""The offline `LLM` (``from pkgd import LLM``): the frontend's processors and an in-process
`EngineCore`, composed in one process with no IPC.

* `llm` — `LLM`: ``generate`` / ``chat`` / ``beam_search``.
* `llm_config` — `build_llm_config`: vLLM-style keyword arguments → a validated `VllmConfig`.
* `beam_search` — beam search over the engine's logprobs (vLLM keeps it out of the engine too).
* `progress` — the optional progress bar of a batch.
"""
