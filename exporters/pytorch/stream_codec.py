"""The codec decoder as a stateful stream (sub-part ``audio_tokenizer_stream``): each frame of codes
is decoded once, the convolutions' left context kept as explicit state.

The Higgs Audio v2 codec decoder (RVQ decode, ``fc2``, DAC acoustic decoder: ``conv1``, five
upsampling blocks of Snake + ConvTranspose1d + three dilated residual units, Snake, ``conv2``;
transformers ``modeling_dac.py`` / ``modeling_higgs_audio_v2_tokenizer.py``) is not causal: every
Conv1d is centred (kernel 7, padding 3 x dilation), every ConvTranspose1d (kernel 2s, stride s,
padding ceil(s/2)) reads the next input.  :class:`StreamCodecDecoder` computes the same outputs
causally, each layer delayed by the future it reads:

* a Conv1d of kernel K, dilation d (reach p = (K-1)d/2 each side) given a delay a <= p keeps the
  last p + a inputs as state, runs on ``[state, new, p - a zeros]`` with no padding and so
  outputs, for each new input, the position a samples back (a < p: the last p - a future inputs
  are read as zeros, an approximation measured by :func:`lookahead_table`);
* a residual unit adds its input delayed by the same a (read from the same state);
* a ConvTranspose1d (always exact) keeps the last input and returns, per new input, the s
  samples that input completes: a delay of ceil(s/2) samples at its output rate;
* after every layer the samples of positions before the stream's start or past its end (when
  known: ``end_frame``) are zeroed, which is exactly the zero padding each layer sees in one
  pass, so the stream's output equals one-shot decoding (within float rounding) once the
  delays are whole (``lookahead_frames`` >= :attr:`StreamCodecDecoder.exact_frames`).

The output is therefore the one-shot waveform delayed by :attr:`StreamCodecDecoder.delay_samples`
samples: the runtime (:class:`higgs_pack.runtime.loop.stateful_codec.StatefulCodec`) drops that
many samples at the start and, at the end, feeds ``ceil(delay / hop)`` pad frames with
``end_frame`` set so the last samples come out.

Graph I/O (:data:`higgs_pack.manifests.model.SUBPART_IO`), B rows, each its own stream:

==================  ======================  ================================================
name                dtype, shape            meaning
==================  ======================  ================================================
audio_codes         int64 [B, N, T]         the next T frames of codes, each in [0, 1024)
start_frame         int64 [B]               frames fed to this row's stream before these
end_frame           int64 [B]               frames in the whole stream when known, else any
                                            number >= start_frame + T + lookahead (no end yet)
codec_state         float32 [B, S]          the state this row's previous call returned;
                                            zeros for a new stream
waveform            float32 [B, 1, T*960]   the next T*960 samples of the delayed stream
codec_state_out     float32 [B, S]          the state for the next call
==================  ======================  ================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from higgs_pack.runtime.loop.stateful_codec import OPEN_END


@dataclass(frozen=True)
class _Conv:
    """A centred Conv1d in the plan: its reach ``p`` each side, the delay ``a`` it is given,
    ``scale`` output samples per sample of its rate."""

    p: int
    scale: int
    a: int = 0


def _snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """DAC's Snake activation (``Snake1d.forward``): x + sin^2(alpha x) / (alpha + 1e-9)."""
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


class StreamCodecDecoder(nn.Module):
    """Codes -> waveform of one stream step (see the module docstring for the I/O).

    Args:
        decoder: the one-shot :class:`~higgs_pack.exporters.pytorch.modules.CodecDecoder` (its
            quantizers, ``fc2`` and DAC ``acoustic_decoder``; weights shared, not copied).
        lookahead_frames: right context allowed, in frames: the layers' delays are given from
            the output end back (the cheapest first: a sample of the last layer costs one output
            sample, one of ``conv1`` a whole frame) until ``lookahead_frames * hop`` output samples
            are spent; ``None`` gives every layer its whole reach (exact).
        hop: samples per frame (960).

    Attributes:
        delay_samples: output samples the stream lags one-shot decoding by.
        exact_frames: the smallest ``lookahead_frames`` with every layer exact.
        state_size: S, floats of state per row.

    Raises:
        ValueError: the decoder's layout is not DAC's (a Conv1d with an even kernel, a
            ConvTranspose1d other than kernel 2s / padding ceil(s/2)), or ``lookahead_frames``
            is below what the transposed convolutions alone need.
    """

    def __init__(self, decoder: nn.Module, lookahead_frames: int | None = None, hop: int = 960):
        super().__init__()
        object.__setattr__(self, "one_shot", decoder)  # not a submodule: its weights are these
        self.quantizers = decoder.quantizers
        self.fc2 = decoder.fc2
        dac = decoder.acoustic_decoder
        self.dac = dac
        self.hop = int(hop)
        strides = [int(b.conv_t1.stride[0]) for b in dac.block]
        if math.prod(strides) != self.hop:
            raise ValueError(f"the codec's upsampling strides {strides} do not multiply to the hop {self.hop}")
        for b, s in zip(dac.block, strides, strict=True):
            t = b.conv_t1
            if int(t.kernel_size[0]) != 2 * s or int(t.padding[0]) != math.ceil(s / 2) or int(t.dilation[0]) != 1:
                raise ValueError(f"ConvTranspose1d {t} is not DAC's (kernel 2s, padding ceil(s/2))")
        # Reach of every Conv1d in order (conv1, each block's 3 residual units, conv2) with its scale.
        convs: list[_Conv] = []
        rate = 1
        convs.append(_Conv(self._reach(dac.conv1), self.hop))
        self._t_delays = []  # each ConvTranspose1d's delay, samples at its output rate
        for b, s in zip(dac.block, strides, strict=True):
            rate *= s
            self._t_delays.append(math.ceil(s / 2))
            for unit in (b.res_unit1, b.res_unit2, b.res_unit3):
                convs.append(_Conv(self._reach(unit.conv1), self.hop // rate))
        convs.append(_Conv(self._reach(dac.conv2), 1))
        self.strides = strides
        mandatory = self._t_samples()
        exact = mandatory + sum(c.p * c.scale for c in convs)
        self.exact_frames = math.ceil(exact / self.hop)
        budget = exact if lookahead_frames is None else int(lookahead_frames) * self.hop - mandatory
        if budget < 0:
            raise ValueError(f"lookahead_frames={lookahead_frames} is below the {math.ceil(mandatory / self.hop)} "
                             "frame(s) the transposed convolutions need")
        planned = []
        for c in reversed(convs):  # cheapest delays first: the output end
            a = min(c.p, budget // c.scale)
            budget -= a * c.scale
            planned.append(_Conv(c.p, c.scale, a))
        self.convs = tuple(reversed(planned))
        self.lookahead_frames = self.exact_frames if lookahead_frames is None else int(lookahead_frames)
        self.delay_samples = mandatory + sum(c.a * c.scale for c in self.convs)
        # State layout: (channels, length) per cache, packed row-wise into [B, S].
        channels = [int(dac.conv1.in_channels)]
        for b in dac.block:
            channels.append(int(b.conv_t1.in_channels))
            channels += [int(u.conv1.in_channels) for u in (b.res_unit1, b.res_unit2, b.res_unit3)]
        channels.append(int(dac.conv2.in_channels))
        lengths = [self.convs[0].p + self.convs[0].a]
        for i in range(len(strides)):
            lengths.append(1)
            lengths += [c.p + c.a for c in self.convs[1 + 3 * i: 4 + 3 * i]]
        lengths.append(self.convs[-1].p + self.convs[-1].a)
        self.layout = tuple(zip(channels, lengths, strict=True))
        self.state_size = sum(c * n for c, n in self.layout)

    @staticmethod
    def _reach(conv: nn.Conv1d) -> int:
        k, d, p = int(conv.kernel_size[0]), int(conv.dilation[0]), int(conv.padding[0])
        if k % 2 == 0 or p != (k - 1) * d // 2 or int(conv.stride[0]) != 1:
            raise ValueError(f"Conv1d {conv} is not centred (odd kernel, padding (K-1)d/2, stride 1)")
        return p

    def _t_samples(self) -> int:
        """Output samples of delay the transposed convolutions add (exact, always)."""
        total, scale = 0, self.hop
        for s, t in zip(self.strides, self._t_delays, strict=True):
            scale //= s
            total += t * scale
        return total

    def options(self) -> dict[str, Any]:
        """The manifest entry the runtime reads (``options`` of ``audio_tokenizer_stream``), with the
        lookahead table where :func:`measured_stream` made one."""
        out = {"lookahead_frames": self.lookahead_frames, "delay_samples": self.delay_samples,
               "state_size": self.state_size, "exact_lookahead_frames": self.exact_frames}
        table = getattr(self, "lookahead_table", None)
        return {**out, "lookahead_table": table} if table is not None else out

    # ------------------------------------------------------------------ forward
    def _conv(self, x: torch.Tensor, cache: torch.Tensor, conv: nn.Conv1d, plan: _Conv, act: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One centred conv with delay ``plan.a``: returns (output [B, C', n], its input delayed by
        a [B, C, n], the new cache)."""
        n = x.shape[-1]
        full = torch.cat([cache, x], dim=-1)
        keep = plan.p + plan.a
        new_cache = full[..., full.shape[-1] - keep:]
        inp = _snake(full, act) if act is not None else full
        if plan.p > plan.a:
            inp = F.pad(inp, (0, plan.p - plan.a))
        y = F.conv1d(inp, conv.weight, conv.bias, dilation=conv.dilation)
        return y, full[..., plan.p: plan.p + n], new_cache

    @staticmethod
    def _mask(x: torch.Tensor, start: torch.Tensor, end: torch.Tensor, rate: int, delay: int) -> torch.Tensor:
        """Zero the samples of ``x`` [B, C, n] whose positions (at ``rate`` samples per frame, the
        stream ``delay`` samples late) are before 0 or at/after ``end * rate``."""
        n = x.shape[-1]
        pos = (start * rate - delay).unsqueeze(-1) + torch.arange(n, dtype=torch.int64).unsqueeze(0)  # [B, n]
        keep = (pos >= 0) & (pos < (end * rate).unsqueeze(-1))
        return x * keep.unsqueeze(1).to(x.dtype)

    def forward(self, audio_codes: torch.Tensor, start_frame: torch.Tensor, end_frame: torch.Tensor,
                codec_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = audio_codes.shape[0]
        caches, at = [], 0
        for c, n in self.layout:
            caches.append(codec_state[:, at: at + c * n].reshape(b, c, n))
            at += c * n
        quantized = self.quantizers[0].decode(audio_codes[:, 0])
        for i in range(1, len(self.quantizers)):
            quantized = quantized + self.quantizers[i].decode(audio_codes[:, i])
        x = self.fc2(quantized.transpose(1, 2)).transpose(1, 2)  # [B, hidden, T]
        x = self._mask(x, start_frame, end_frame, 1, 0)
        dac, out_caches = self.dac, []
        x, _, cache = self._conv(x, caches[0], dac.conv1, self.convs[0], None)
        out_caches.append(cache)
        rate, delay = 1, self.convs[0].a
        x = self._mask(x, start_frame, end_frame, rate, delay)
        k = 1
        for i, (block, s) in enumerate(zip(dac.block, self.strides, strict=True)):
            prev = caches[k]
            full = torch.cat([prev, _snake(x, block.snake1.alpha)], dim=-1)
            out_caches.append(full[..., full.shape[-1] - 1:])
            t = block.conv_t1
            y = F.conv_transpose1d(full, t.weight, t.bias, stride=s)
            n = x.shape[-1]
            x = y[..., s: s + n * s]
            rate, delay = rate * s, delay * s + self._t_delays[i]
            x = self._mask(x, start_frame, end_frame, rate, delay)
            k += 1
            for j, unit in enumerate((block.res_unit1, block.res_unit2, block.res_unit3)):
                plan = self.convs[1 + 3 * i + j]
                h, skip, cache = self._conv(x, caches[k], unit.conv1, plan, unit.snake1.alpha)
                out_caches.append(cache)
                h = F.conv1d(_snake(h, unit.snake2.alpha), unit.conv2.weight, unit.conv2.bias)
                delay += plan.a
                x = self._mask(skip + h, start_frame, end_frame, rate, delay)
                k += 1
        x, _, cache = self._conv(x, caches[k], dac.conv2, self.convs[-1], dac.snake1.alpha)
        out_caches.append(cache)
        delay += self.convs[-1].a
        x = self._mask(dac.tanh(x), start_frame, end_frame, rate, delay)
        state = torch.cat([c.reshape(b, -1) for c in out_caches], dim=1)
        return x, state


#: Frames of random codes the lookahead is measured on (:func:`measured_stream`): longer than the
#: exact lookahead (10 frames at the published dims) so that the middle frames see both edges' context.
PROBE_FRAMES = 24


def measured_stream(decoder: nn.Module, num_codebooks: int, codebook_size: int, hop: int, limit: float,
                    frames: int = PROBE_FRAMES, seed: int = 2026) -> StreamCodecDecoder:
    """The stream module with the smallest lookahead whose audio is within ``limit`` of one-shot decoding.

    For k = 0 .. the exact lookahead, builds :class:`StreamCodecDecoder` ``(decoder, k)``, streams
    ``frames`` frames of random codes through it one frame per call (the runtime's first calls; a
    k below the exact one reads the future it lacks as zeros, and one frame per call lacks the most)
    with :func:`~higgs_pack.runtime.loop.stateful_codec.stream_decode`, and measures the relative L2
    error ``||stream - one_shot|| / ||one_shot||`` and the largest absolute difference against
    ``decoder`` run once on the same codes.

    Args:
        decoder: the one-shot codec decoder (``CodecDecoder``), float32, eval.
        num_codebooks, codebook_size, hop: the model constants (8, 1024, 960).
        limit: the codec's parity limit (relative L2; the build passes the fp32 export limit).
        frames, seed: the probe.

    Returns:
        The chosen module; its ``lookahead_table`` attribute (in :meth:`StreamCodecDecoder.options`)
        lists ``{"frames": k, "delay_samples", "rel_l2", "max_abs"}`` per k (``rel_l2`` None and
        ``note`` where k is below what the transposed convolutions need).

    Raises:
        ValueError: even the exact stream is outside ``limit`` (a bug in the stream module).
    """
    import itertools

    from higgs_pack.runtime.loop.stateful_codec import StreamCodecSpec, runner_step, stream_decode
    from higgs_pack.runtime.verification.report import rel_l2

    rng = np.random.default_rng(seed)
    codes = rng.integers(0, codebook_size, (frames, num_codebooks), dtype=np.int64)
    with torch.no_grad():
        one_shot = decoder(torch.from_numpy(np.ascontiguousarray(codes.T[None]))).numpy().reshape(-1)
    exact = StreamCodecDecoder(decoder, None, hop).exact_frames
    table: list[dict[str, Any]] = []
    chosen = None
    for k in range(exact + 1):
        try:
            module = StreamCodecDecoder(decoder, k, hop).eval()
        except ValueError as exc:
            table.append({"frames": k, "delay_samples": None, "rel_l2": None, "max_abs": None, "note": str(exc)})
            continue
        spec = StreamCodecSpec.from_options(module.options(), hop)
        got = stream_decode(runner_step(torch_runner(module)), spec, codes, itertools.repeat(1))
        err = rel_l2(one_shot, got)
        table.append({"frames": k, "delay_samples": module.delay_samples, "rel_l2": float(f"{err:.3g}"),
                      "max_abs": float(f"{float(np.abs(got - one_shot).max()):.3g}")})
        if chosen is None and err <= limit:
            chosen = module
    if chosen is None:
        raise ValueError(f"the exact stream codec ({exact} frames of lookahead) differs from one-shot decoding by "
                         f"rel L2 {table[-1]['rel_l2']} > {limit}")
    chosen.lookahead_table = table
    return chosen


def example_inputs(module: StreamCodecDecoder, num_codebooks: int, codebook_size: int, frames: int = 3
                   ) -> tuple[torch.Tensor, ...]:
    """Deterministic export inputs: codes [1, N, frames], start 2, open end, a random state."""
    g = torch.Generator().manual_seed(4321 + frames)
    return (torch.randint(0, codebook_size, (1, num_codebooks, frames), generator=g),
            torch.tensor([2], dtype=torch.int64), torch.tensor([OPEN_END], dtype=torch.int64),
            0.1 * torch.randn(1, module.state_size, generator=g))


def torch_runner(module: StreamCodecDecoder):
    """``module`` as a runtime runner's ``run(feeds) -> outputs`` (numpy in and out, no grad)."""

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            wave, state = module(torch.from_numpy(np.ascontiguousarray(feeds["audio_codes"], dtype=np.int64)),
                                 torch.from_numpy(np.ascontiguousarray(feeds["start_frame"], dtype=np.int64)),
                                 torch.from_numpy(np.ascontiguousarray(feeds["end_frame"], dtype=np.int64)),
                                 torch.from_numpy(np.ascontiguousarray(feeds["codec_state"], dtype=np.float32)))
        return {"waveform": wave.numpy(), "codec_state_out": state.numpy()}

    return run
