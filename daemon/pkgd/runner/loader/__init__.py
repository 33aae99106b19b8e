"""Model sources: resolving ``model.source`` to an HF-layout directory, GGUF conversion, and
loading safetensors weights into a model.

`resolve` is torch-free (API servers import it to find tokenizer files); `weights` and
`dtype` need torch and are imported only by engine processes.
"""
