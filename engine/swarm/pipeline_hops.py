"""What travels between pipeline stages of one job, and the checks on it.

* activation and gradient tensors: decoded with a size cap and the stage's hidden
  size, encoded with the run's activation encoding (on the compute thread, in the
  same call as the forward that produced them);
* rows of token ids / floats / flags from the coordinator, which must be rectangular;
* the route check: an ``act``/``drop``/``grad`` must be addressed to our hop of a
  route as long as the pipeline, and come from the neighbour the route names.

What it does not know: what a job is, the backend, links.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from engine.net.errors import ProtocolViolation
from engine.net.tensor_codec import decode_tensor, encode_tensor, tensor_shape
from engine.swarm.messages import MAX_ROWS, MAX_TOKENS, Act, Drop, Grad

#: most elements of one activation tensor a node decodes (rows x tokens x hidden)
MAX_ACTIVATION_ELEMENTS = 1 << 26


def rect(rows: list[list[Any]], dtype, what: str) -> np.ndarray:
    """``rows`` as a 2-D array; a ProtocolViolation if they differ in length."""
    width = len(rows[0])
    if any(len(r) != width for r in rows):
        raise ProtocolViolation(f"{what}: rows of different lengths")
    return np.asarray(rows, dtype=dtype)


def decode_activation(header: dict, payload: bytes, hidden_size: int) -> np.ndarray:
    """A ``[rows, tokens, hidden]`` float32 tensor from a peer, or a ProtocolViolation."""
    shape, _ = tensor_shape(header, MAX_ACTIVATION_ELEMENTS)  # checked before anything is decoded
    if len(shape) != 3 or shape[2] != hidden_size or shape[0] > MAX_ROWS or shape[1] > MAX_TOKENS:
        raise ProtocolViolation(f"activation of shape {list(shape)} does not fit hidden size {hidden_size}")
    return decode_tensor(header, payload, max_elements=MAX_ACTIVATION_ELEMENTS, expected_dtype="float32")


def encode_activation(x: np.ndarray, encoding: str) -> tuple[dict, bytes]:
    """Compute thread: ``(tensor header, payload)`` of ``x`` for the wire."""
    enc = encode_tensor(np.asarray(x, dtype=np.float32), encoding)
    return enc.header, bytes(enc.payload)


def forward_encoded(forward: Callable[[str, np.ndarray], np.ndarray], key: str, x: np.ndarray,
                    encoding: str) -> tuple[dict, bytes]:
    """Compute thread: run a stage forward and encode its output for the wire, in one hop."""
    return encode_activation(forward(key, x), encoding)


def check_hop(kind: str, header: Act | Drop | Grad, sender: str, me: str, stage_index: int,
              num_stages: int) -> None:
    """An ``act``/``drop``/``grad`` must be for our hop and come from the route's neighbour."""
    route, hop = header.route, header.hop
    if len(route) != num_stages or hop != stage_index or route[hop] != me:
        raise ProtocolViolation(f"'{kind}' routed to hop {hop} of {len(route)}, but we are stage {stage_index}")
    upstream = route[hop + 1] if kind == "grad" else route[hop - 1]
    if sender != upstream:
        raise ProtocolViolation(f"'{kind}' from {sender}, but the route says {upstream}")
