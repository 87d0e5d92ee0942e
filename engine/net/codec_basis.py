"""The ``basis`` encoding: rows as int8 coefficients in a basis both ends hold, plus exact outliers.

``subspace`` (``codec_subspace``) sends each tensor's own basis in its payload: no state,
but on SmolLM2's 576-wide boundary a rank-128 basis costs as much as ~30 float32 rows, so a
decoding step (one row per sequence) pays the basis for a handful of rows and rank 128
ends at ~11x fewer bytes than float32. Here the basis is fitted once from the rows a
stage has already sent (``codec_basis_model``), identified by a content hash (``basis_id``)
and sent *once per link* (``inline``); every later tensor names it and carries only

* each row's coefficients ``(row - mean) @ pinv(basis)`` as ``codec_int8`` rows (per-row
  scales, column-scaled when the coefficients' spreads differ, as principal components do),
  with 8-bit codes, or 4-bit ones when ``params["bits"]`` is 4 (absent: 8);
* the ``outliers`` entries the low-rank rows miss most (the massive activations of a
  pretrained model's attention sink are the first of them), exact as bfloat16, positions as
  varint gaps (``codec_topk``'s writing).

Rank 128 of 576 then costs ~135 bytes a row (17x fewer than float32), rank 64 ~70 (33x).

A *coded* basis (``Basis.step``, ``Basis.scales``: a fit at up to full rank, ``Basis.fit(step=...)``)
quantises every coefficient with one step, ``round(coefficient / step)``, and range-codes the
codes under a per-column Laplace model (``codec_entropy``); ``params["coded"]`` is the coded
section's length. The model's scales are the basis's, or (``params["own_scales"]``, when that
is fewer bytes) the tensor's own, a byte per coefficient column ahead of the codes. No
coefficient is cut, and a low-variance one costs a fraction of a bit: on held-out greedy
completions at SmolLM2-135M's layer-15 boundary (step 0.2) ~97 bytes a row at a third of the
mean error of rank 128 with 8-bit codes (~132 bytes a row); rows of RL traffic (sampled
answers) cost more (see the README).

A *token-predicted* basis (``Basis.predictor``, ``codec_predictor``) first subtracts from each
row what its token predicts (a linear map of a token table both ends hold); the basis and
the outliers code what is left, each tensor carries its rows' token ids (``params["tokens"]``
bytes each), and the receiver adds the prediction back.

An *uncentred* tensor (``params["centred"]`` false) is a gradient going back through such a
boundary: its rows are the coefficients ``row @ pinv(basis)`` with no mean, in the basis of
the activations they are the gradient of, which the *receiver* fitted and sent (so it never
travels inline). ``coefficients @ vectors`` is then the exact gradient of the projection the
activations went through (``pinv(V) @ V`` is symmetric), not an approximation of the
gradient the uncut activations would have had (the few entries that crossed exactly as
outliers get the projection's gradient too: the one approximation).

Payload, in order (little-endian)::

    [inline basis: mean float32 x cols, vectors bfloat16 bits x rank x cols]   when params["inline"]
    [  its predictor: table id, weights (codec_predictor)]                     inline and params["tokens"]
    [  its coding: step float32, Laplace scales float32 x rank]                inline and params["coded"]
    [coefficients: int8_rowwise payload of [rows, rank]]                      column-scaled, bits per params
      or [[own scales: uint8 x rank], range-coded codes, params["coded"] bytes]  when params["coded"]
    [outlier positions: varint gaps, index_bytes long]
    [outlier values: bfloat16 bits as uint16 x outliers]
    [token ids: uint16 or uint32 x rows]                                       when params["tokens"]

    value = mean + coefficients @ vectors, then value[position] = outlier   (uncentred: no mean)
    (coded: coefficients = codes * step)
    then value += predictor(token)                                             (token-predicted)

The receiver checks an inline basis against its id and stores it in its ``BasisBook``; a
tensor naming a basis the book lacks is a WireFormatError.
Decoding does a matrix product: machines may decode a few ulps apart (fine for
activations, not for shadow copies).

What this module does not know: how a basis is fitted and identified (``codec_basis_model``),
when it is fitted and which link has seen it (``engine.swarm.boundary_basis``), header checks
(``tensor_codec``).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import numpy as np
from msgspec import Meta

from engine.net import codec_entropy, codec_int8, codec_outliers, codec_predictor
from engine.net.codec_basis_model import (
    BASIS_ID_BYTES,
    DEFAULT_OUTLIER_FRACTION,
    FILL_ROUNDS,
    MAX_COLS,
    MAX_RANK,
    Basis,
    BasisBook,
    read_basis,
)
from engine.net.codec_checks import PayloadReader, convert_params, require_in_range
from engine.net.codec_predictor import TokenTable
from engine.net.errors import WireFormatError
from engine.net.wire import WireRecord

#: outlier positions are varints of at most this many bytes
_VARINT_MAX_BYTES = 5



class BasisParams(WireRecord, frozen=True):
    """The header params of ``basis`` (bounds that depend on the shape are checked in decode).

    Short names: a decoding step of a small model is a few hundred bytes, the header a good part of it."""

    id: Annotated[bytes, Meta(min_length=BASIS_ID_BYTES, max_length=BASIS_ID_BYTES)]  # the basis's content id
    rank: Annotated[int, Meta(ge=1, le=MAX_RANK)]  # its vectors
    inline: bool  # the basis leads the payload (the first tensor a link carries in it)
    col_scaled: bool  # the coefficients' int8 payload carries column scales
    outliers: Annotated[int, Meta(ge=0, le=1 << 40)]  # entries sent exactly (<= the tensor's elements)
    index_bytes: Annotated[int, Meta(ge=0, le=_VARINT_MAX_BYTES << 40)]  # bytes of the outliers' positions
    bits: Literal[8, 4] = 8  # bits per coefficient code (sent only when 4)
    centred: bool = True  # false: coefficients of rows with no mean, in the receiver's own basis (sent only then)
    tokens: Literal[0, 2, 4] = 0  # bytes of each row's token id (token-predicted basis; sent only then)
    # bytes of the range-coded coefficient codes (a coded basis; sent only then; None: int8 codes)
    coded: Annotated[int, Meta(ge=0, le=1 << 40, multiple_of=codec_entropy.WORD_BYTES)] | None = None
    own_scales: bool = False  # the coded codes carry their columns' own scales, a byte each (sent only then)


def payload_nbytes(rows: int, cols: int, rank: int, *, inline: bool, coef_col_scaled: bool, outliers: int,
                   outlier_index_bytes: int, bits: int = 8, token_bytes: int = 0, coded: int | None = None,
                   own_scales: bool = False) -> int:
    """Exact payload length the params imply (the decoder refuses any other); ``coded``: bytes of
    range-coded coefficients (None: int8 codes)."""
    basis = (4 * cols + 2 * rank * cols) if inline else 0
    if inline and coded is not None:  # the coding: step, [rank] scales
        basis += 4 + 4 * rank
    if inline and token_bytes:  # the predictor: table id, [cols + 1, cols] weights
        basis += codec_predictor.TABLE_ID_BYTES + 2 * (cols + 1) * cols
    coefficients = codec_int8.payload_nbytes(rows, rank, coef_col_scaled, bits) if coded is None else coded
    coefficients += rank if own_scales else 0
    return basis + coefficients + outlier_index_bytes + 2 * outliers + token_bytes * rows


def encode(array: np.ndarray, basis: Basis, inline: bool = False,
           outlier_fraction: float = DEFAULT_OUTLIER_FRACTION, code_bits: int = 8,
           centred: bool = True, tokens: np.ndarray | None = None,
           table: TokenTable | None = None) -> tuple[dict[str, Any], bytes]:
    """Encode a float32 array whose last dim is ``basis.cols`` (ValueError for a sender mistake);
    ``code_bits``: 8 or 4 bits per coefficient code; ``centred`` false: rows with no mean, in a
    basis the receiver holds as its own (never inline; a predictor is not applied, nor a coded
    basis's coding: its codes are int8); a token-predicted basis needs ``tokens`` (one id per
    row, ``array.shape[:-1]``) and ``table``; a coded basis ignores ``code_bits``."""
    if not isinstance(basis, Basis):
        raise ValueError("the basis encoding needs a Basis")
    if not centred and inline:
        raise ValueError("an uncentred tensor is in the receiver's own basis: it cannot carry one inline")
    if code_bits not in codec_int8.CODE_BITS:
        raise ValueError(f"code_bits must be one of {codec_int8.CODE_BITS}, got {code_bits!r}")
    if not np.isfinite(array).all():
        raise ValueError("basis cannot encode NaN or inf")
    if not 0.0 <= outlier_fraction <= 1.0:
        raise ValueError(f"outlier_fraction must be in [0, 1], got {outlier_fraction}")
    rows, cols = codec_int8.rows_and_cols(array.shape, array.size)
    if cols != basis.cols:
        raise ValueError(f"rows of {cols} values do not fit a basis of {basis.cols} columns")
    matrix = array.reshape(rows, cols).astype(np.float32, copy=False)
    predictor = basis.predictor if centred else None
    ids = np.zeros(0, np.int64)
    if predictor is not None:
        if tokens is None or table is None:
            raise ValueError("a token-predicted basis needs the rows' tokens and the token table")
        ids = np.asarray(tokens, np.int64).reshape(-1)
        if ids.shape[0] != rows:
            raise ValueError(f"{ids.shape[0]} token ids for {rows} rows")
        codec_predictor.check_tokens(ids, table)
        matrix = matrix - predictor.predict(table, ids)
    n_out = min(array.size, math.ceil(outlier_fraction * array.size)) if outlier_fraction > 0 and rows else 0
    mean = basis.mean if centred else np.zeros_like(basis.mean)
    coef = (matrix - mean) @ basis.pinv()
    if n_out:  # the massive entries travel exactly: fit the rows without them
        big = np.argpartition(np.abs(matrix - mean).reshape(-1), matrix.size - n_out)[matrix.size - n_out:]
        touched = np.unique(big // cols)
        sub = matrix[touched].copy()  # only rows holding such an entry are refitted
        local = np.searchsorted(touched, big // cols) * cols + big % cols
        sub.reshape(-1)[local] = mean[big % cols]
        for _ in range(FILL_ROUNDS):  # converges to the least-squares fit of the other entries
            fit = (sub - mean) @ basis.pinv()
            sub.reshape(-1)[local] = (fit @ basis.vectors + mean).reshape(-1)[local]
        coef[touched] = (sub - mean) @ basis.pinv()
    step, scales = (basis.step, basis.scales) if centred else (None, None)  # a gradient's codes are int8
    coded: int | None = None  # bytes of the range-coded codes (None: int8 codes)
    own_scales = False
    if step is not None and scales is not None:
        codes = np.clip(np.rint(coef / step), -codec_entropy.CODE_LIMIT, codec_entropy.CODE_LIMIT).astype(np.int32)
        words = codec_entropy.encode_codes(codes, scales)
        own = codec_entropy.tensor_scale_codes(codes)
        own_words = codec_entropy.encode_codes(codes, codec_entropy.scales_of(own))
        own_scales = len(own) + len(own_words) < len(words)  # rows unlike the fitted ones: their own model
        coded = len(own_words if own_scales else words)
        col_scaled, coef_payload = False, own.tobytes() + own_words if own_scales else words
        coef_q = codes.astype(np.float32) * np.float32(step)
    else:
        coef_params, coef_payload = codec_int8.encode(coef.astype(np.float32), bits=code_bits)
        col_scaled = bool(coef_params["col_scaled"])
        coef_q = codec_int8.decode((rows, basis.rank), rows * basis.rank, coef_params,
                                   PayloadReader(memoryview(coef_payload)), code_bits).reshape(rows, basis.rank)
    parts = [basis.to_bytes()] if inline else []
    parts.append(coef_payload)
    index_section = b""
    if n_out:  # the entries the decoded rows miss most
        miss = np.abs(matrix - (coef_q @ basis.vectors + mean)).reshape(-1)
        positions = np.sort(np.argpartition(miss, miss.size - n_out)[miss.size - n_out:]).astype(np.int64)
        index_section, values = codec_outliers.pack(matrix.reshape(-1), positions)
        parts += [index_section, values]
    token_bytes = table.token_bytes if predictor is not None and table is not None else 0
    if token_bytes:
        parts.append(ids.astype("<u2" if token_bytes == 2 else "<u4").tobytes())
    params = {"id": basis.basis_id, "rank": basis.rank, "inline": bool(inline),
              "col_scaled": col_scaled, "outliers": int(n_out),
              "index_bytes": len(index_section), **({"bits": code_bits} if code_bits != 8 and coded is None else {}),
              **({"coded": coded} if coded is not None else {}), **({"own_scales": True} if own_scales else {}),
              **({} if centred else {"centred": False}), **({"tokens": token_bytes} if token_bytes else {})}
    return params, b"".join(parts)


def decode(shape: tuple[int, ...], numel: int, params: Any, reader: PayloadReader,
           book: BasisBook | None) -> np.ndarray:
    """Decode an untrusted payload into a flat float32 array (raises WireFormatError); an inline
    basis that matches its id goes into ``book`` first."""
    typed = convert_params(params, BasisParams, "basis params")
    if book is None:
        raise WireFormatError("a 'basis' tensor arrived where no basis book is kept")
    rows, cols = codec_int8.rows_and_cols(shape, numel)
    require_in_range(cols, "columns", 1, MAX_COLS)
    n_out = require_in_range(typed.outliers, "outliers", 0, numel)
    index_bytes = require_in_range(typed.index_bytes, "index_bytes", n_out,
                                   _VARINT_MAX_BYTES * n_out)
    reader.expect_total(payload_nbytes(rows, cols, typed.rank, inline=typed.inline,
                                       coef_col_scaled=typed.col_scaled, outliers=n_out,
                                       outlier_index_bytes=index_bytes, bits=typed.bits,
                                       token_bytes=typed.tokens, coded=typed.coded, own_scales=typed.own_scales))
    if typed.inline and not typed.centred:
        raise WireFormatError("an uncentred basis tensor names the receiver's own basis; it cannot carry one inline")
    if typed.tokens and not typed.centred:
        raise WireFormatError("an uncentred basis tensor carries no token ids")
    if typed.coded is not None and (not typed.centred or typed.col_scaled or typed.bits != 8):
        raise WireFormatError("coded coefficients are centred, with no column scales or code bits")
    if typed.own_scales and typed.coded is None:
        raise WireFormatError("own scales come with coded coefficients only")
    if typed.inline:
        basis = read_basis(reader, typed.rank, cols, predicted=bool(typed.tokens), coded=typed.coded is not None)
        if basis.basis_id != typed.id:
            raise WireFormatError(f"inline basis hashes to {basis.basis_id.hex()}, not the {typed.id.hex()} it claims")
        book.add(basis)
    else:
        found = book.get(typed.id)
        if found is None:
            raise WireFormatError(f"basis {typed.id.hex()} was never received from this sender" if typed.centred
                                  else f"basis {typed.id.hex()} of an uncentred tensor is not one this node sent")
        basis = found
    if basis.rank != typed.rank or basis.cols != cols:
        raise WireFormatError(f"basis {typed.id.hex()} is {basis.rank} x {basis.cols}, the tensor says "
                              f"{typed.rank} x {cols}")
    if typed.centred and (basis.predictor is not None) != bool(typed.tokens):
        raise WireFormatError(f"basis {typed.id.hex()} {'has' if basis.predictor else 'has no'} token predictor, "
                              f"the tensor says otherwise")
    if typed.centred and (basis.step is not None) != (typed.coded is not None):
        raise WireFormatError(f"basis {typed.id.hex()} is {'' if basis.step is not None else 'not '}coded, "
                              f"the tensor says otherwise")
    if typed.coded is not None and basis.step is not None and basis.scales is not None:
        scales = (codec_entropy.scales_of(reader.take(typed.rank, "u1", "own scales")) if typed.own_scales
                  else basis.scales)
        words = reader.take(typed.coded // codec_entropy.WORD_BYTES, "<u4", "coded coefficients")
        codes = codec_entropy.decode_codes(words, rows, scales)
        with np.errstate(over="ignore"):  # a huge step shows as inf: tensor_codec refuses it
            coef = codes.astype(np.float32) * np.float32(basis.step)
    else:
        coef = codec_int8.take_matrix(reader, rows, typed.rank, typed.col_scaled, "coefficients", typed.bits)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow shows as inf: tensor_codec refuses it
        out = coef.reshape(rows, typed.rank) @ basis.vectors
        if typed.centred:
            out += basis.mean
    codec_outliers.apply(reader, out, n_out, index_bytes)
    if typed.tokens and basis.predictor is not None:
        if book.table is None:
            raise WireFormatError("a token-predicted tensor arrived but this node holds no token table "
                                  "(it needs the base checkpoint's embeddings)")
        ids = codec_predictor.read_tokens(reader, rows, typed.tokens, book.table)
        with np.errstate(over="ignore", invalid="ignore"):
            out += basis.predictor.predict(book.table, ids)
    return out.reshape(-1).astype(np.float32, copy=False)
