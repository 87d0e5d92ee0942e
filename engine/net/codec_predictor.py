"""Token predictors of the ``basis`` encoding: the part of a boundary row its token already says.

Halfway through a pretrained model a hidden row still carries its token's identity: on
SmolLM2-135M's layer-15 boundary a linear map of the token's input embedding (and a
constant) accounts for most of a row. The token embeddings span almost every direction of
the 576-wide row, so a rank-128 basis spends its coefficients on them; what is left once
the prediction is subtracted is far closer to low rank (measured: the typical row's error at rank 128 and 8 bits falls
from 1.3e-3 to 1.3e-4 of its energy). So both ends hold one fixed
:class:`TokenTable` (the base checkpoint's ``model.embed_tokens.weight``: the same on
every node of a run, whatever training does to a stage's copy), the sender fits a
:class:`Predictor` (a ``[cols + 1, cols]`` matrix: ``[table[token], 1] @ weights``) on the
rows it calibrates its basis from, sends it once per link with the basis, and subtracts
its prediction from every row it codes; each tensor carries its rows' token ids and the
receiver adds the same prediction back.

The prediction depends on no trainable weight (the table is the base's), so the gradient
through the boundary is unchanged.

Wire form of an inline predictor (after the basis's vectors, little-endian)::

    table id (16 bytes: sha-256 of the table's shape and float32 bytes)
    weights bfloat16 bits x (cols + 1) x cols

What this module does not know: bases, payload layout, which stage knows the token ids
(``codec_basis``, ``engine.swarm.boundary_basis``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from engine.net.codec_checks import PayloadReader
from engine.net.errors import WireFormatError

#: bytes of a token table's id (128 bits of sha-256)
TABLE_ID_BYTES = 16
#: ridge strength of the fit, relative to the mean eigenvalue of the features' covariance
DEFAULT_RIDGE = 1e-3
_BF16 = ml_dtypes.bfloat16
_TABLE_DOMAIN = b"polis-token-table-v1"


class TokenTable:
    """A fixed ``[vocab, width]`` float32 table both ends of a link hold, with its content id."""

    def __init__(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.ndim != 2 or not rows.size:
            raise ValueError(f"a token table is [vocab, width], got shape {rows.shape}")
        if not np.isfinite(rows).all():
            raise ValueError("a token table must be finite")
        self.rows = rows
        digest = hashlib.sha256(_TABLE_DOMAIN + rows.shape[0].to_bytes(4, "little")
                                + rows.shape[1].to_bytes(4, "little") + rows.tobytes())
        self.table_id = digest.digest()[:TABLE_ID_BYTES]

    @property
    def vocab(self) -> int:
        return int(self.rows.shape[0])

    @property
    def width(self) -> int:
        return int(self.rows.shape[1])

    @property
    def token_bytes(self) -> int:
        """Bytes per token id on the wire (2 while the vocabulary fits 16 bits)."""
        return 2 if self.vocab <= 1 << 16 else 4

    def features(self, tokens: np.ndarray) -> np.ndarray:
        """``[n, width + 1]``: each token's row and a constant 1 (ids must be in range)."""
        ids = np.asarray(tokens).reshape(-1)
        return np.concatenate([self.rows[ids], np.ones((ids.shape[0], 1), np.float32)], axis=1)


@dataclass(frozen=True, eq=False)
class Predictor:
    """``[table[token], 1] @ weights``: a row's prediction from its token (weights bfloat16-exact)."""

    table_id: bytes
    weights: np.ndarray  # float32 [width + 1, cols], every value exact in bfloat16

    @property
    def cols(self) -> int:
        return int(self.weights.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes the predictor costs inline."""
        return TABLE_ID_BYTES + 2 * self.weights.size

    def to_bytes(self) -> bytes:
        return self.table_id + np.ascontiguousarray(self.weights.astype(_BF16).view("<u2")).tobytes()

    @classmethod
    def from_weights(cls, table_id: bytes, weights: np.ndarray) -> Predictor:
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if len(table_id) != TABLE_ID_BYTES or weights.ndim != 2:
            raise ValueError("a predictor needs a table id and [width + 1, cols] weights")
        return cls(table_id, weights.astype(_BF16).astype(np.float32))

    @classmethod
    def fit(cls, table: TokenTable, tokens: np.ndarray, rows: np.ndarray, ridge: float = DEFAULT_RIDGE) -> Predictor:
        """Ridge least squares of ``rows [n, cols]`` on their tokens' table rows (centred, so the
        constant is not shrunk); ``ridge`` is relative to the features' mean variance."""
        ids = np.asarray(tokens).reshape(-1)
        target = np.asarray(rows, np.float64).reshape(ids.shape[0], -1)
        check_tokens(ids, table)
        x = table.rows[ids].astype(np.float64)
        x_mean, y_mean = x.mean(axis=0), target.mean(axis=0)
        xc = x - x_mean
        gram = xc.T @ xc
        gram[np.diag_indices_from(gram)] += ridge * max(float(np.trace(gram)) / gram.shape[0], 1e-12)
        slope = np.linalg.solve(gram, xc.T @ (target - y_mean))
        intercept = y_mean - x_mean @ slope
        return cls.from_weights(table.table_id, np.vstack([slope, intercept[None, :]]))

    def predict(self, table: TokenTable, tokens: np.ndarray) -> np.ndarray:
        """``[n, cols]`` float32 predictions of the rows of ``tokens`` (flattened)."""
        if table.table_id != self.table_id:
            raise WireFormatError("the predictor was fitted against another token table than this node holds")
        if table.width + 1 != self.weights.shape[0]:
            raise WireFormatError(f"a predictor of {self.weights.shape[0]} inputs does not fit a table "
                                  f"{table.width} wide")
        return table.features(tokens) @ self.weights


def check_tokens(ids: np.ndarray, table: TokenTable) -> None:
    """WireFormatError unless every id is a row of ``table``."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= table.vocab):
        raise WireFormatError(f"token id outside the table's {table.vocab} rows")


def read_predictor(reader: PayloadReader, cols: int) -> Predictor:
    """An inline predictor of a ``cols``-wide basis (its table as wide) from an untrusted payload."""
    table_id = bytes(reader.take(TABLE_ID_BYTES, "u1", "predictor table id"))
    weights = reader.take((cols + 1) * cols, "<u2", "predictor weights").view(_BF16).astype(np.float32)
    if not np.isfinite(weights).all():
        raise WireFormatError("inline predictor contains NaN or inf")
    return Predictor.from_weights(table_id, weights.reshape(cols + 1, cols))


def read_tokens(reader: PayloadReader, rows: int, token_bytes: int, table: TokenTable) -> np.ndarray:
    """The ``rows`` token ids of a predicted tensor, ``token_bytes`` each, checked against the receiver's table."""
    if token_bytes != table.token_bytes:
        raise WireFormatError(f"token ids of {token_bytes} bytes for a table of {table.vocab} rows")
    ids = reader.take(rows, "<u2" if token_bytes == 2 else "<u4", "token ids").astype(np.int64)
    check_tokens(ids, table)
    return ids
