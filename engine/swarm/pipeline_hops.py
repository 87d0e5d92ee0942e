"""What travels between pipeline stages of one job, and the checks on it.

* activation and gradient tensors: decoded with a size cap and the stage's hidden
  size, encoded with one wire encoding (``encode_with``; ``boundary_basis.BoundaryCodec``
  picks it from the run's activation encoding, on the compute thread, in the same call as
  the forward that produced them, and keeps the bases of ``basis`` schemes). An encoding name is a scheme
  (:data:`ACTIVATION_SCHEMES`): a wire encoding and its params for activations going
  forward and for their gradients going back (gradients have other statistics);
  ``subspace_r<k>`` sends rank-k rows with exact outliers, and a tensor too small
  for rank k to pay (a few rows, e.g. one decoding step) goes as int8 rows with the
  outliers exact (``subspace`` at rank 0 with a residual); ``basis_r<k>`` sends rank-k
  coefficients in a basis fitted once per stage and sent once per link; a ``_b4`` suffix
  sends the gradients' basis and coefficients with 4-bit codes (``basis_r<k>_b4``: the
  coefficients both ways); ``_gp`` sends the gradients as coefficients in the activations'
  own basis, which the receiver of the gradients fitted (``boundary_basis``);
* rows of token ids / floats / flags from the coordinator, which must be rectangular;
* the route check: an ``act``/``drop``/``grad`` must be addressed to our hop of a
  route as long as the pipeline, and come from the neighbour the route names.

What it does not know: what a job is, the backend, links.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.net import codec_subspace
from engine.net.codec_basis_model import MAX_RANK, BasisBook
from engine.net.errors import ProtocolViolation
from engine.net.tensor_codec import decode_tensor, encode_tensor, tensor_shape
from engine.swarm.messages import MAX_ROWS, MAX_TOKENS, Act, Drop, Grad

#: most elements of one activation tensor a node decodes (rows x tokens x hidden)
MAX_ACTIVATION_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class BoundaryScheme:
    """How one run's tensors cross a stage boundary: activations forward, gradients back."""

    encoding: str  # tensor_codec encoding of activations
    grad_encoding: str  # tensor_codec encoding of their gradients
    params: dict[str, Any] = field(default_factory=dict)  # the activations' codec params
    grad_params: dict[str, Any] = field(default_factory=dict)  # the gradients' codec params


def _same(encoding: str) -> BoundaryScheme:
    return BoundaryScheme(encoding, encoding)


def _subspace(rank: int, grad_rank: int) -> BoundaryScheme:
    return BoundaryScheme("subspace", "subspace", {"rank": rank}, {"rank": grad_rank})


def _basis(rank: int, grad_rank: int) -> BoundaryScheme:
    return BoundaryScheme("basis", "basis", {"rank": rank}, {"rank": grad_rank})


#: run-config ``activation_encoding`` name -> scheme (``run_config.ActivationEncoding`` lists the names)
ACTIVATION_SCHEMES: dict[str, BoundaryScheme] = {
    "fp32": _same("fp32"), "fp16": _same("fp16"), "bf16": _same("bf16"), "int8_rowwise": _same("int8_rowwise"),
    # int8 rows with the largest 0.1 % of entries exact (2x fewer bytes than bf16, safe with massive activations)
    "int8_outliers": _subspace(0, 0),
    "subspace_r8": _subspace(8, 8), "subspace_r16": _subspace(16, 16), "subspace_r32": _subspace(32, 32),
    "subspace_r64": _subspace(64, 64), "subspace_r96": _subspace(96, 96), "subspace_r128": _subspace(128, 128),
    # rank-k coefficients in a basis fitted once per stage and sent once per link (``boundary_basis``)
    **{f"basis_r{k}": _basis(k, k) for k in (8, 16, 32, 48, 64, 96, 128)},
    # the same forward; gradients in each tensor's own rank-j basis (SmolLM2's share no fixed subspace:
    # rank 128 of a fixed one misses 31 % of them, rank 64 of their own 21 %)
    **{f"basis_r{k}_gs{j}": BoundaryScheme("basis", "subspace", {"rank": k}, {"rank": j})
       for k, j in ((8, 8), (64, 64), (96, 64), (96, 96), (128, 64), (128, 128))},
    # the same forward; gradients in each tensor's own rank-j basis with 4-bit codes (basis and
    # coefficients: half their bytes, where the rank-j fit already loses ~20 % of a gradient)
    **{f"basis_r{k}_gs{j}_b4": BoundaryScheme("basis", "subspace", {"rank": k}, {"rank": j, "code_bits": 4})
       for k, j in ((96, 64), (128, 64), (128, 96))},
    # activations and gradients as 4-bit coefficients in their fixed bases (the tiny base's
    # 64-wide boundary, where rank 8 lost learning, needs the bits more than the rank)
    **{f"basis_r{k}_b4": BoundaryScheme("basis", "basis", {"rank": k, "code_bits": 4}, {"rank": k, "code_bits": 4})
       for k in (16, 24, 32)},
    # the same forward; gradients as int8 rows with exact outliers
    **{f"basis_r{k}_g8": BoundaryScheme("basis", "subspace", {"rank": k}, {"rank": 0}) for k in (96, 128)},
    # the same forward; gradients as coefficients in the activations' own basis (8 or 4 bits): the exact
    # gradient of the rank-k cut the activations went through, at ~k bytes a row and no basis per tensor
    "basis_r128_gp": BoundaryScheme("basis", "basis", {"rank": 128}, {"projected": True}),
    "basis_r128_gp_b4": BoundaryScheme("basis", "basis", {"rank": 128}, {"projected": True, "code_bits": 4}),
    # basis_r128_gs64_b4 less each row's linear prediction from its token (``codec_predictor``): the
    # first stage sends its rows' token ids, both ends hold the base checkpoint's embeddings
    "predicted_r128_gs64_b4": BoundaryScheme("basis", "subspace", {"rank": 128, "predict": True},
                                             {"rank": 64, "code_bits": 4}),
    # transform coding: every coefficient of a full-rank fitted basis quantised with one step (s x 0.01
    # of the coefficients' RMS) and range-coded (``codec_entropy``); the gradients as in _gs64_b4;
    # predcoded_ codes each row less its token's prediction, as predicted_ does (never refitted:
    # ``boundary_basis.BasisFitter``)
    **{f"coded_s{s}_gs64_b4": BoundaryScheme("basis", "subspace", {"rank": MAX_RANK, "step": s / 100},
                                             {"rank": 64, "code_bits": 4}) for s in (10, 20, 40)},
    **{f"predcoded_s{s}_gs64_b4": BoundaryScheme("basis", "subspace",
                                                 {"rank": MAX_RANK, "step": s / 100, "predict": True},
                                                 {"rank": 64, "code_bits": 4}) for s in (20, 40)},
}


def _subspace_params(shape: tuple[int, ...], params: dict[str, Any]) -> dict[str, Any]:
    """Rank k where it saves bytes over int8 rows; else int8 rows with exact outliers (rank 0)."""
    cols = shape[-1] if shape else 1
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    rank = min(int(params.get("rank", 32)), rows, cols)
    outliers = int(np.ceil(codec_subspace.DEFAULT_OUTLIER_FRACTION * rows * cols))
    low_rank = codec_subspace.payload_nbytes(rows, cols, rank, centred=True, coef_col_scaled=True, residual=False,
                                             residual_col_scaled=False, outliers=outliers,
                                             outlier_index_bytes=2 * outliers,
                                             code_bits=int(params.get("code_bits", 8)))
    if rank and low_rank < rows * (cols + 1):
        return {**params, "rank": rank}
    return {**params, "rank": 0, "residual": True, "centred": False, "code_bits": 8}


def scheme_of(name: str) -> BoundaryScheme:
    """The scheme of an ``activation_encoding`` name (ValueError if unknown)."""
    try:
        return ACTIVATION_SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown activation encoding {name!r} (known: {', '.join(ACTIVATION_SCHEMES)})") from None


def rect(rows: list[list[Any]], dtype, what: str) -> np.ndarray:
    """``rows`` as a 2-D array; a ProtocolViolation if they differ in length."""
    width = len(rows[0])
    if any(len(r) != width for r in rows):
        raise ProtocolViolation(f"{what}: rows of different lengths")
    return np.asarray(rows, dtype=dtype)


def decode_activation(header: dict, payload: bytes, hidden_size: int, bases: BasisBook | None = None) -> np.ndarray:
    """A ``[rows, tokens, hidden]`` float32 tensor from a peer, or a ProtocolViolation; ``bases``:
    what this node holds of the sender's bases (``basis`` schemes, see ``boundary_basis``)."""
    shape, _ = tensor_shape(header, MAX_ACTIVATION_ELEMENTS)  # checked before anything is decoded
    if len(shape) != 3 or shape[2] != hidden_size or shape[0] > MAX_ROWS or shape[1] > MAX_TOKENS:
        raise ProtocolViolation(f"activation of shape {list(shape)} does not fit hidden size {hidden_size}")
    return decode_tensor(header, payload, max_elements=MAX_ACTIVATION_ELEMENTS, expected_dtype="float32",
                         bases=bases)


def encode_with(x: np.ndarray, encoding: str, params: dict[str, Any]) -> tuple[dict, bytes]:
    """``(tensor header, payload)`` of ``x`` with one wire encoding and its params (a subspace
    tensor too small for its rank goes as int8 rows with exact outliers)."""
    x = np.asarray(x, dtype=np.float32)
    if encoding == "subspace":
        params = _subspace_params(x.shape, params)
    enc = encode_tensor(x, encoding, **params)
    return enc.header, bytes(enc.payload)


def check_hop(kind: str, header: Act | Drop | Grad, sender: str, me: str, stage_index: int,
              num_stages: int) -> None:
    """An ``act``/``drop``/``grad`` must be for our hop and come from the route's neighbour."""
    route, hop = header.route, header.hop
    if len(route) != num_stages or hop != stage_index or route[hop] != me:
        raise ProtocolViolation(f"'{kind}' routed to hop {hop} of {len(route)}, but we are stage {stage_index}")
    upstream = route[hop + 1] if kind == "grad" else route[hop - 1]
    if sender != upstream:
        raise ProtocolViolation(f"'{kind}' from {sender}, but the route says {upstream}")
