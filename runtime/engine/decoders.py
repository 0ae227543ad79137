"""What the engine steps: a decoder holding the KV cache of up to ``max_batch`` requests, one row
each (:class:`BatchedDecoder`), and any backend's batch-1 decoder as a one-row one
(:class:`SingleRowDecoder`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from higgs_pack.runtime.loop.pipeline import Decoder
from higgs_pack.runtime.loop.prefix_cache import prefix_layout


def openvino_engine_of(backend: str, max_batch: int) -> str | None:
    """``"paged"`` for an engine of ``max_batch > 1`` rows on an OpenVINO bundle (PagedAttention,
    :mod:`higgs_pack.runtime.backends.openvino.paged`), None elsewhere: another backend's bundle,
    or one row (the bundle's own batch-1 decoder).  What ``/ready`` shows and a ``--batch``
    manifest records, so that a folder is not resumed on other kernels (the paged and batch-1
    decoders are not bit-identical, nor the spliced stateful engine of earlier versions that
    recorded ``"stateful"``)."""
    return "paged" if backend == "openvino" and max_batch > 1 else None


class BatchedDecoder(Protocol):
    """A decoder holding the KV cache of up to ``max_batch`` requests, one row each.

    It may also state ``kv_bytes_per_position`` (int: KV bytes of one position of one row, or
    None when unknown) and ``kv_device`` (``"cpu"`` when the cache is host memory); without
    them the engine admits by free rows only.
    """

    max_batch: int
    max_length: int
    """Most positions one row may hold."""

    def prefill(self, row: int, inputs_embeds: np.ndarray, start: int = 0, final: bool = True) -> np.ndarray:
        """Prefill ``S`` prompt positions of ``row`` from position ``start``: float32 [1, S, H] ->
        float32 [1, S, H].  ``start=0`` starts the row over; a later chunk continues the row's
        own positions (an earlier chunk's or a cached prefix's); ``final``: the prompt's last
        chunk (the row then takes part in :meth:`step`).  One row at a time is prefilled in
        chunks; the other rows may step meanwhile."""
        ...

    def step(self, rows: np.ndarray, inputs_embeds: np.ndarray) -> np.ndarray:
        """One position for each of ``rows`` (ascending): float32 [a, 1, H] -> float32 [a, 1, H]."""
        ...

    def release(self, row: int) -> None:
        """Forget ``row``'s positions."""
        ...


class SingleRowDecoder:
    """Any backend's batch-1 :class:`~higgs_pack.runtime.loop.pipeline.Decoder` as a one-row
    :class:`BatchedDecoder` (``max_batch=1``: the engine then serves requests one at a time).

    Args:
        decoder: the pipeline's decoder.
        max_length: most positions per request (default, and at most, the decoder's own).

    Attributes:
        kv_bytes_per_position: the wrapped decoder's own figure where it states one (ONNX
            Runtime's :class:`~higgs_pack.runtime.backends.onnxruntime.runners.OrtDecoder`), else
            None: OpenVINO's stateful decoder keeps its cache inside the plugin in a precision
            of the plugin's choosing (u8 by default on x86, with per-token scales), and the
            NPU variant's static buffers are allocated whole when the bundle loads.
        kv_device: where the wrapped decoder's cache lives (``"cpu"`` unless it says otherwise).
    """

    max_batch = 1

    def __init__(self, decoder: Decoder, max_length: int | None = None):
        self._decoder = decoder
        self.max_length = decoder.max_length if max_length is None else min(max_length, decoder.max_length)
        self.kv_bytes_per_position: int | None = getattr(decoder, "kv_bytes_per_position", None)
        self.kv_device: str = getattr(decoder, "kv_device", "cpu")

    def prefill(self, row: int, inputs_embeds: np.ndarray, start: int = 0, final: bool = True) -> np.ndarray:
        if not start:
            self._decoder.reset()
        return self._decoder.forward(inputs_embeds)

    @property
    def prefix_layout(self) -> str | None:
        """The wrapped decoder's (None when it does not take part in prefix caching)."""
        return prefix_layout(self._decoder)

    def read_prefix(self, row: int, length: int) -> dict[str, np.ndarray]:
        return self._decoder.read_prefix(length)

    def write_prefix(self, row: int, arrays: dict[str, np.ndarray], length: int) -> None:
        self._decoder.write_prefix(arrays, length)

    def step(self, rows: np.ndarray, inputs_embeds: np.ndarray) -> np.ndarray:
        return self._decoder.forward(inputs_embeds)

    def release(self, row: int) -> None:
        self._decoder.reset()
