"""Measures every tensor codec on realistic tensors: bytes saved, error, speed.

Used by ``polis bench transport`` (and the codec tests) so the figures in the
report and the thresholds in the tests come from the same tensors:

* activations ``[8, 32, 128]``: standard normal, a few *outlier channels*
  (hidden dims 20x larger in every token, as in trained LMs) and an
  *attention-sink* token per sequence (8x larger);
* an update of about a million elements: normal values times a log-normal
  per-row magnitude (heavy-tailed, like a gradient of a weight matrix), and a
  stream of such updates sharing a common direction for error feedback.

``rel_error`` is ``||x - decode(encode(x))|| / ||x||``. For top-k it is large by
design (most entries are not sent); what matters there is ``ef_rel_error``: the
part of the summed updates still owed after ``rounds`` rounds of error feedback,
and ``value_rel_error``: the quantisation error on the entries that were sent.

What this module does not know: links or the bench's command line.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from engine.net.error_feedback import ErrorFeedback
from engine.net.tensor_codec import decode_tensor, encode_tensor

#: (report key, tensor kind, encoding, params) measured by :func:`codec_report`.
CODEC_CASES: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    ("fp32", "activation", "fp32", {}),
    ("fp16", "activation", "fp16", {}),
    ("bf16", "activation", "bf16", {}),
    ("int8", "activation", "int8_rowwise", {}),
    ("int8_no_col_scales", "activation", "int8_rowwise", {"col_scaling": False}),
    ("topk", "update", "topk", {"fraction": 0.01}),
    ("topk_uint32_idx", "update", "topk", {"fraction": 0.01, "index_coding": "uint32"}),
    ("topk_4bit", "update", "topk", {"fraction": 0.01, "value_bits": 4, "block": 256}),
    ("topk_2bit", "update", "topk", {"fraction": 0.01, "value_bits": 2, "block": 256}),
)


def realistic_activations(seed: int = 0, shape: tuple[int, int, int] = (8, 32, 128), *,
                          outlier_channels: int = 4, outlier_scale: float = 20.0,
                          sink_scale: float = 8.0) -> np.ndarray:
    """Hidden states ``[batch, seq, hidden]`` with outlier channels and a sink token."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    channels = rng.choice(shape[-1], size=min(outlier_channels, shape[-1]), replace=False)
    x[..., channels] *= np.float32(outlier_scale)
    x[:, 0, :] *= np.float32(sink_scale)
    return x


def realistic_update(seed: int = 0, numel: int = 1_000_000) -> np.ndarray:
    """A flat float32 gradient-like update: normal times a log-normal row magnitude."""
    rng = np.random.default_rng(seed)
    rows = max(1, int(np.sqrt(numel)))
    row_scale = np.exp(rng.normal(0.0, 1.0, size=rows)).astype(np.float32)
    values = rng.standard_normal(numel).astype(np.float32)
    values *= np.resize(np.repeat(row_scale, -(-numel // rows)), numel) * np.float32(1e-3)
    return values


def update_stream(seed: int, numel: int, rounds: int, *, noise: float = 1.0) -> list[np.ndarray]:
    """``rounds`` updates sharing one direction plus independent noise of relative size ``noise``."""
    rng = np.random.default_rng(seed + 1)
    common = realistic_update(seed, numel)
    scale = float(np.std(common))
    return [common + (noise * scale * rng.standard_normal(numel)).astype(np.float32)
            for _ in range(rounds)]


@dataclass
class CodecFigures:
    """What one codec does to one tensor."""

    tensor: str
    encoding: str
    params: dict[str, Any]
    numel: int
    wire_bytes: int
    ratio_vs_fp32: float
    rel_error: float
    encode_mb_s: float  # float32-equivalent megabytes (1e6 bytes) per second
    decode_mb_s: float
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


def _rel(reference: np.ndarray, approx: np.ndarray) -> float:
    norm = float(np.linalg.norm(reference.astype(np.float64)))
    return float(np.linalg.norm((reference - approx).astype(np.float64))) / max(norm, 1e-30)


def measure_codec(array: np.ndarray, encoding: str, *, tensor: str = "tensor", repeats: int = 3,
                  **params: Any) -> CodecFigures:
    """Ratio, relative error and best-of-``repeats`` speed of one encoding on ``array``."""
    enc_s, dec_s = float("inf"), float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        encoded = encode_tensor(array, encoding, **params)
        t1 = time.perf_counter()
        decoded = decode_tensor(encoded.header, encoded.payload, max_elements=max(1, array.size),
                                 expected_shape=array.shape)
        t2 = time.perf_counter()
        enc_s, dec_s = min(enc_s, t1 - t0), min(dec_s, t2 - t1)
    fp32_mb = array.size * 4 / 1e6
    extra: dict[str, float] = {}
    if encoding == "topk":
        sent = decoded != 0
        extra["value_rel_error"] = _rel(array[sent], decoded[sent]) if sent.any() else 0.0
        extra["k"] = float(encoded.header["params"]["k"])
    return CodecFigures(tensor=tensor, encoding=encoding, params=dict(encoded.header["params"]),
                        numel=int(array.size), wire_bytes=encoded.wire_nbytes,
                        ratio_vs_fp32=encoded.ratio_vs_fp32, rel_error=_rel(array, decoded),
                        encode_mb_s=fp32_mb / max(enc_s, 1e-9), decode_mb_s=fp32_mb / max(dec_s, 1e-9),
                        extra=extra)


def error_feedback_figures(updates: list[np.ndarray], encoding: str = "topk",
                           **params: Any) -> dict[str, float]:
    """Send ``updates`` with and without error feedback; how much of their sum is lost.

    ``ef_rel_error``: error of the summed transmitted updates with error feedback
    (it equals the final residual's relative size); ``no_ef_rel_error``: the same
    when each update is compressed on its own and the dropped part is lost.
    """
    feedback = ErrorFeedback(encoding, **params)
    total = np.zeros_like(updates[0], dtype=np.float64)
    sent = np.zeros_like(total)
    sent_without = np.zeros_like(total)
    for update in updates:
        encoded = feedback.compress("update", update)
        sent += decode_tensor(encoded.header, encoded.payload, max_elements=max(1, update.size),
                              expected_shape=update.shape)
        plain = encode_tensor(update, encoding, **params)
        sent_without += decode_tensor(plain.header, plain.payload, max_elements=max(1, update.size),
                                      expected_shape=update.shape)
        total += update
    return {"rounds": float(len(updates)), "ef_rel_error": _rel(total, sent),
            "no_ef_rel_error": _rel(total, sent_without)}


def codec_report(seed: int = 0, *, update_numel: int = 1_000_000, ef_rounds: int = 20,
                 repeats: int = 3) -> dict[str, dict[str, Any]]:
    """Every case of :data:`CODEC_CASES` as a JSON-ready dict keyed by case name."""
    tensors = {"activation": realistic_activations(seed), "update": realistic_update(seed, update_numel)}
    stream = update_stream(seed, update_numel, ef_rounds) if ef_rounds > 0 else []
    report: dict[str, dict[str, Any]] = {}
    for key, kind, encoding, params in CODEC_CASES:
        figures = measure_codec(tensors[kind], encoding, tensor=kind, repeats=repeats, **params)
        if encoding == "topk" and stream:
            figures.extra.update(error_feedback_figures(stream, encoding, **params))
        report[key] = figures.as_dict()
    return report


def format_codec_table(report: dict[str, dict[str, Any]]) -> str:
    """A readable table of :func:`codec_report`'s result."""
    lines = [f"{'codec':<20} {'tensor':<10} {'ratio':>8} {'rel err':>9} {'EF err':>8} "
             f"{'enc MB/s':>9} {'dec MB/s':>9}"]
    for key, row in report.items():
        ef = f"{row['ef_rel_error']:.4f}" if "ef_rel_error" in row else "-"
        lines.append(f"{key:<20} {row['tensor']:<10} {row['ratio_vs_fp32']:>7.1f}x {row['rel_error']:>9.4f} "
                     f"{ef:>8} {row['encode_mb_s']:>9.0f} {row['decode_mb_s']:>9.0f}")
    return "\n".join(lines)
