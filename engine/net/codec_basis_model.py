"""The basis a ``basis`` tensor is coded in: its fit, wire form, content id, and the book a receiver keeps.

A :class:`Basis` is a row mean and ``rank`` vectors (bfloat16-exact), fitted once from rows a
stage has already sent (``Basis.fit``: principal directions, the largest entries refilled
first because they travel exactly). It may carry

* a token predictor (``codec_predictor``): rows are coded after subtracting what their token
  predicts, and
* a coding (``Basis.step``, ``Basis.scales``; ``Basis.fit(step=...)``): the step every
  coefficient is quantised with, relative to the RMS of the fitted coefficients, and their
  per-column Laplace scales in steps (``codec_entropy``).

Its inline wire form (``Basis.to_bytes``, read back from an untrusted payload by
:func:`read_basis`)::

    mean float32 x cols, vectors bfloat16 bits x rank x cols,
    [step float32, scales float32 x rank]   (coded)
    [predictor: table id, weights]          (token-predicted)

Its id is sha-256 over its shape and those bytes, so a sender cannot make one id mean two
bases; a receiver keeps the bases it was sent in a :class:`BasisBook` (bounded, least recently
used out).

What this module does not know: the tensor payload that names a basis (``codec_basis``),
when a basis is fitted or which link has seen it (``engine.swarm.boundary_basis``).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from engine.net import codec_entropy, codec_predictor
from engine.net.codec_checks import PayloadReader
from engine.net.codec_predictor import Predictor, TokenTable
from engine.net.errors import WireFormatError

#: most basis vectors, columns and entries one basis may have (4 MiB of bfloat16 at most)
MAX_RANK = 1 << 10
MAX_COLS = 1 << 12
MAX_ENTRIES = 1 << 21
#: default share of entries sent exactly as outliers
DEFAULT_OUTLIER_FRACTION = 0.001
#: bytes of a basis id (128 bits of sha-256)
BASIS_ID_BYTES = 16
#: rounds of refitting the rows whose largest entries travel exactly
FILL_ROUNDS = 4
#: bases a book keeps per sender before the least recently used goes
DEFAULT_BOOK_CAPACITY = 8
_BF16 = ml_dtypes.bfloat16
_ID_DOMAIN = b"polis-basis-v1"


def basis_id_of(rank: int, cols: int, body: bytes) -> bytes:
    """Content id of a basis: sha-256 over its shape and its wire bytes (mean, vectors)."""
    digest = hashlib.sha256(_ID_DOMAIN + rank.to_bytes(4, "little") + cols.to_bytes(4, "little") + body)
    return digest.digest()[:BASIS_ID_BYTES]


@dataclass(frozen=True, eq=False)
class Basis:
    """A row mean and ``rank`` basis vectors (bfloat16-exact float32), with their content id, the
    token predictor the rows are coded after (None: plain rows), and for a coded basis the step
    its coefficients are quantised with and their per-column Laplace scales in steps."""

    mean: np.ndarray  # float32 [cols]
    vectors: np.ndarray  # float32 [rank, cols], every value exact in bfloat16
    basis_id: bytes
    predictor: Predictor | None = None
    step: float | None = None  # a coded basis's quantisation step (None: int8 coefficient rows)
    scales: np.ndarray | None = None  # float32 [rank]: a coded basis's Laplace scales, in steps
    _pinv: list = field(default_factory=list, repr=False)  # encoder's cache: [cols, rank] float32

    @property
    def rank(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def cols(self) -> int:
        return int(self.mean.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the basis costs inline (what a link pays once)."""
        return len(self.to_bytes())

    def to_bytes(self) -> bytes:
        """The inline wire form: mean, vectors, [step and scales], [predictor]."""
        return _body(self.mean, self.vectors, self.predictor, self.step, self.scales)

    @classmethod
    def from_arrays(cls, mean: np.ndarray, vectors: np.ndarray, predictor: Predictor | None = None,
                    step: float | None = None, scales: np.ndarray | None = None) -> Basis:
        """A basis of ``mean [cols]`` and ``vectors [rank, cols]`` (rounded to bfloat16), coding
        rows after ``predictor``'s prediction when given, coded with ``step`` and Laplace
        ``scales [rank]`` (both or neither)."""
        mean = np.ascontiguousarray(mean, dtype=np.float32).reshape(-1)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32).astype(_BF16).astype(np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != mean.shape[0]:
            raise ValueError(f"vectors of shape {vectors.shape} do not fit a mean of {mean.shape[0]} columns")
        if (not 1 <= vectors.shape[0] <= MAX_RANK or not 1 <= mean.shape[0] <= MAX_COLS
                or vectors.size > MAX_ENTRIES):
            raise ValueError(f"a basis has 1..{MAX_RANK} vectors of 1..{MAX_COLS} columns, at most "
                             f"{MAX_ENTRIES} entries, got {vectors.shape}")
        if not (np.isfinite(mean).all() and np.isfinite(vectors).all()):
            raise ValueError("a basis must be finite")
        if predictor is not None and predictor.weights.shape != (mean.shape[0] + 1, mean.shape[0]):
            raise ValueError(f"a predictor of shape {predictor.weights.shape} does not fit {mean.shape[0]} columns")
        if (step is None) != (scales is None):
            raise ValueError("a coded basis needs both its step and its scales")
        if step is not None and scales is not None:
            step = float(np.float32(step))
            scales = np.ascontiguousarray(scales, dtype=np.float32).reshape(-1)
            if not (np.isfinite(step) and step > 0 and scales.shape[0] == vectors.shape[0]
                    and np.isfinite(scales).all() and (scales > 0).all()):
                raise ValueError("a coded basis needs a positive step and one positive scale per vector")
        body = _body(mean, vectors, predictor, step, scales)
        return cls(mean, vectors, basis_id_of(vectors.shape[0], mean.shape[0], body), predictor, step, scales)

    @classmethod
    def fit(cls, rows: np.ndarray, rank: int, outlier_fraction: float = DEFAULT_OUTLIER_FRACTION,
            predictor: Predictor | None = None, table: TokenTable | None = None,
            tokens: np.ndarray | None = None, step: float | None = None) -> Basis:
        """The mean and top ``rank`` principal directions of ``rows [n, cols]`` (less what
        ``predictor`` says of their ``tokens`` in ``table``, when given), the largest
        ``outlier_fraction`` of entries replaced by their column's mean first (they travel
        exactly, so they must not pull the directions the other entries are fitted in).
        With ``step``, a coded basis: its step is ``step`` times the RMS of the fitted rows'
        coefficients, its scales their per-column Laplace fit (``codec_entropy``)."""
        matrix = np.asarray(rows, dtype=np.float64)
        if matrix.ndim != 2 or not matrix.size:
            raise ValueError(f"fit needs rows [n, cols], got shape {matrix.shape}")
        if not np.isfinite(matrix).all():
            raise ValueError("fit needs finite rows")
        if predictor is not None:
            if table is None or tokens is None:
                raise ValueError("a token-predicted fit needs the table and the rows' tokens")
            matrix = matrix - predictor.predict(table, tokens)
        n, cols = matrix.shape
        rank = max(1, min(int(rank), cols, MAX_RANK, MAX_ENTRIES // cols))
        n_out = min(matrix.size, math.ceil(outlier_fraction * matrix.size)) if outlier_fraction > 0 else 0
        mean, top = _principal(matrix, rank)
        if n_out:  # refill the largest entries with what the fit of the others says, and fit again
            positions = np.argpartition(np.abs(matrix - mean).reshape(-1), matrix.size - n_out)[matrix.size - n_out:]
            keep = np.ones(matrix.size, bool)
            keep[positions] = False
            keep2 = keep.reshape(n, cols)
            col_mean = (matrix * keep2).sum(axis=0) / np.maximum(keep2.sum(axis=0), 1)
            matrix = matrix.copy()
            matrix.reshape(-1)[positions] = col_mean[positions % cols]
            for _ in range(FILL_ROUNDS):
                mean, top = _principal(matrix, rank)
                fit = (matrix - mean) @ top.T @ top + mean
                matrix.reshape(-1)[positions] = fit.reshape(-1)[positions]
            mean, top = _principal(matrix, rank)
        signs = np.sign(top[np.arange(rank), np.abs(top).argmax(axis=1)])  # deterministic orientation
        top = top * np.where(signs == 0, 1.0, signs)[:, None]
        if step is None:
            return cls.from_arrays(mean, top, predictor)
        coef = (matrix - mean) @ top.T
        absolute = float(step) * max(float(np.sqrt(np.mean(coef ** 2))), 1e-30)
        return cls.from_arrays(mean, top, predictor, absolute, codec_entropy.fit_scales(coef, absolute))

    def pinv(self) -> np.ndarray:
        """``[cols, rank]``: least-squares coefficients of rows in the (bfloat16-rounded) vectors."""
        if not self._pinv:
            v = self.vectors.astype(np.float64)
            self._pinv.append(np.linalg.solve(v @ v.T, v).T.astype(np.float32))
        return self._pinv[0]


def _body(mean: np.ndarray, vectors: np.ndarray, predictor: Predictor | None, step: float | None,
          scales: np.ndarray | None) -> bytes:
    """A basis's wire bytes (what its id hashes): mean, vectors, [step, scales], [predictor]."""
    body = mean.astype("<f4").tobytes() + np.ascontiguousarray(vectors.astype(_BF16).view("<u2")).tobytes()
    if step is not None and scales is not None:
        body += np.float32(step).astype("<f4").tobytes() + scales.astype("<f4").tobytes()
    return body + (predictor.to_bytes() if predictor is not None else b"")


def _principal(matrix: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(column mean, top ``rank`` principal directions as rows) of float64 ``matrix``."""
    mean = matrix.mean(axis=0)
    centred = matrix - mean
    _, vectors = np.linalg.eigh(centred.T @ centred)
    return mean, vectors[:, ::-1][:, :rank].T


def read_basis(reader: PayloadReader, rank: int, cols: int, predicted: bool = False, coded: bool = False) -> Basis:
    """An inline basis (with its coding when ``coded``, its predictor when ``predicted``) from an
    untrusted payload (finite values, or a WireFormatError)."""
    if rank * cols > MAX_ENTRIES:
        raise WireFormatError(f"an inline basis of {rank} x {cols} exceeds {MAX_ENTRIES} entries")
    mean = reader.take(cols, "<f4", "basis mean")
    vectors = reader.take(rank * cols, "<u2", "basis vectors").view(_BF16).astype(np.float32).reshape(rank, cols)
    if not (np.isfinite(mean).all() and np.isfinite(vectors).all()):
        raise WireFormatError("inline basis contains NaN or inf")
    step, scales = None, None
    if coded:
        step = float(reader.take(1, "<f4", "basis step")[0])
        scales = reader.take(rank, "<f4", "basis scales").copy()
        if not (np.isfinite(step) and step > 0 and np.isfinite(scales).all() and (scales > 0).all()):
            raise WireFormatError("an inline coded basis needs a positive finite step and scales")
    predictor = codec_predictor.read_predictor(reader, cols) if predicted else None
    return Basis.from_arrays(mean.copy(), vectors, predictor, step, scales)


class BasisBook:
    """The bases one receiver holds from one sender, by id; at most ``capacity``, least recently used out."""

    def __init__(self, capacity: int = DEFAULT_BOOK_CAPACITY, table: TokenTable | None = None) -> None:
        self.capacity = capacity
        self.table = table  # the token table the receiver adds predictions from (None: none held)
        self._bases: OrderedDict[bytes, Basis] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bases)

    def add(self, basis: Basis) -> None:
        self._bases[basis.basis_id] = basis
        self._bases.move_to_end(basis.basis_id)
        while len(self._bases) > self.capacity:
            self._bases.popitem(last=False)

    def latest(self) -> Basis | None:
        """The basis added or named most recently (None when the book is empty)."""
        return next(reversed(self._bases.values()), None)

    def get(self, basis_id: bytes) -> Basis | None:
        basis = self._bases.get(basis_id)
        if basis is not None:
            self._bases.move_to_end(basis_id)
        return basis
