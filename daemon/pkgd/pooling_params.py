"""`PoolingParams`: what a pooling (embedding) request asks of the engine (vLLM's names).

A seam type like `pkgd.sampling_params.SamplingParams`: the frontend builds it, it crosses the
wire inside `EngineCoreRequest`, the scheduler and the runner read it. A request carries one
or the other: sampling params make it generate, pooling params make it a prefill-only request
whose output is one pooled hidden state. Torch-free; imports nothing of pkgd.
"""

from __future__ import annotations

import msgspec


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Pooling options of one request.

    Attributes:
        dimensions: keep the first ``dimensions`` features of the pooled vector (Matryoshka
            representation learning, Kusupati et al., 2022), before normalising; None = all
            ``hidden_size``. Only models trained for it accept it (``model.pooler``).
        normalize: L2-normalise the vector; None = ``model.pooler.normalize``.
    """

    dimensions: int | None = None
    normalize: bool | None = None

    def verify(self, *, hidden_size: int, matryoshka: bool, matryoshka_dimensions: list[int] | None = None) -> None:
        """Check ``dimensions`` against the model; raises `ValueError` naming the field.

        ``matryoshka`` says whether the model accepts ``dimensions`` at all;
        ``matryoshka_dimensions``, when given, lists the only values it accepts.
        """
        d = self.dimensions
        if d is None:
            return
        if not matryoshka:
            raise ValueError(
                "dimensions is not supported by this model: it was not trained for Matryoshka "
                "representations (set model.pooler.matryoshka: true if it was)"
            )
        if d < 1:
            raise ValueError(f"dimensions must be at least 1, got {d}")
        if d > hidden_size:
            raise ValueError(f"dimensions must be at most the model's hidden size {hidden_size}, got {d}")
        if matryoshka_dimensions and d not in matryoshka_dimensions:
            raise ValueError(
                f"dimensions must be one of the model's Matryoshka dimensions {matryoshka_dimensions}, got {d}"
            )
