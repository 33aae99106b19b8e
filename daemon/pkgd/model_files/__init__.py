"""Which files make the model: ``model.source`` resolved to an HF-layout directory.

`resolve` turns a ``pkg:`` reference, a ``.gguf`` file (converted once by `gguf_convert` into
a cached directory) or an HF directory into `ModelFiles`. Torch-free: API servers use it to
find tokenizer files, engine cores to find weights. Nothing is downloaded.
"""
