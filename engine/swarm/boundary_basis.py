"""The state behind the ``basis_r<k>`` activation schemes: bases a stage fits from what it sends, who holds them.

A ``basis`` scheme (``pipeline_hops.ACTIVATION_SCHEMES``) sends rows as coefficients in a
basis both ends hold (``engine.net.codec_basis``). One node keeps, in a
:class:`BoundaryCodec`:

* per direction it sends in (``act`` forward, ``grad`` back) and stage it holds, a
  :class:`BasisFitter`: the first ``calibration_rows`` rows it sends go with the scheme's
  fallback (int8 rows with exact outliers) and are kept; then the basis is fitted from
  them and used for the later tensors (the sending stage's own activations, from the
  task's training stream: no calibration pass, nothing to agree on); a scheme with
  ``refit_rows`` refits from the latest rows after every that many rows (full fine-tuning
  moves the activations; each refit is a new basis, sent once per link; a coded basis is
  never refitted: see :class:`BasisFitter`);
* which peers hold which of its bases: a basis travels inline in the first tensor to a
  peer, and is named only after that tensor's ``send`` returned (a link delivers messages
  in call order, so the receiver has it first); a new link to a peer forgets what it held
  (a restarted peer starts with an empty book);
* per sender, the :class:`~engine.net.codec_basis_model.BasisBook` of bases received (bounded;
  a tensor naming a basis never received is a WireFormatError against its sender).

A *token-predicted* scheme (``{"predict": True}`` in the activations' params) fits, with the
basis, a linear prediction of each row from its token (``engine.net.codec_predictor``) and
codes the rows less that prediction: it needs the rows' token ids, which only the first
stage has (its inputs; ``forward_encoded`` passes them; later stages fit plain bases), and
the base checkpoint's embedding table on both ends (``token_table``, set by the node). A
first stage without the table fits a plain basis; a tensor of it without tokens goes with
the fallback and does not calibrate.

A *coded* scheme (``{"step": s}`` in the activations' params) fits its basis at up to full
rank and range-codes each coefficient quantised with one step, ``s`` times the fitted
coefficients' RMS (``engine.net.codec_entropy``): no rank to choose, bits go where the
energy is.

A *projected* gradient scheme (``{"projected": True}`` in the gradients' params) sends the
gradients back as coefficients in the basis the receiver's activations last came in
(uncentred, ``codec_basis``): the receiving node decodes them in the bases it fitted itself
(its own book); until the upstream peer has sent a basis, gradients go with the fallback.

Encoding runs on the compute thread, ``sent``/``forget_peer``/decoding on the event loop:
what both touch (the books included) is under a lock. What it does not know: jobs, links, which scheme is good.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.net.codec_basis_model import Basis, BasisBook
from engine.net.codec_predictor import Predictor, TokenTable
from engine.swarm.pipeline_hops import decode_activation, encode_with, scheme_of

#: rows a stage sends in one direction before it fits that direction's basis
DEFAULT_CALIBRATION_ROWS = 2048
#: rows after which a stage refits its basis from the latest rows (full fine-tuning moves activations)
DEFAULT_REFIT_ROWS = 32 * DEFAULT_CALIBRATION_ROWS
#: what a ``basis`` direction sends before its basis is fitted: int8 rows with exact outliers
_FALLBACK: tuple[str, dict[str, Any]] = ("subspace", {"rank": 0})
#: senders whose books a node keeps (least recently heard from out)
MAX_SENDER_BOOKS = 64

log = logging.getLogger(__name__)


class BasisFitter:
    """Fits one direction's basis from the first ``calibration_rows`` rows it sends, and (with
    ``refit_rows``) again from the latest ``calibration_rows`` rows after every ``refit_rows`` more
    (the weights move under training; a refitted basis is a new one, sent once per link again).

    A coded basis (``step``) is never refitted: at full rank it cuts nothing, so drift costs bytes,
    not accuracy, and a refit from the latest rows moved the step and cost more than it saved
    (SmolLM2, predcoded_s40, seed 0, 64 versions: 130 bytes a row with the refit after 64k rows,
    110 without, at less error)."""

    def __init__(self, rank: int, calibration_rows: int = DEFAULT_CALIBRATION_ROWS, refit_rows: int = 0,
                 outlier_fraction: float | None = None, predict: bool = False, step: float | None = None) -> None:
        self.rank = rank
        self.step = step  # a coded basis's step, relative to the coefficients' RMS (None: int8 codes)
        self.calibration_rows = calibration_rows
        self.refit_rows = 0 if step is not None else refit_rows
        self.outlier_fraction = outlier_fraction
        self.predict = predict  # fit a token predictor too (off for good when the node holds no token table)
        self._rows: list[np.ndarray] = []
        self._tokens: list[np.ndarray] = []  # the rows' token ids, while predicting
        self._kept = 0  # rows in self._rows
        self._since_fit = 0  # rows seen since the last fit
        self.basis: Basis | None = None
        self.fits = 0

    def observe(self, x: np.ndarray, tokens: np.ndarray | None = None,
                table: TokenTable | None = None) -> Basis | None:
        """The basis to send ``x`` in (fitted from the rows so far, ``x``'s included), or None
        while calibrating (``x`` then goes with the fallback); ``tokens``: ``x``'s token ids."""
        if self.basis is not None and not self.refit_rows:
            return self.basis
        if self.predict and table is None:
            log.warning("no token table (the base checkpoint's embeddings): fitting a plain basis")
            self.predict, self._tokens = False, []
        if self.predict and tokens is None:  # rows without their tokens cannot fit a predictor
            return self.basis
        rows = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
        self._since_fit += rows.shape[0]
        self._rows.append(rows[-self.calibration_rows:].copy())
        if self.predict:
            self._tokens.append(np.asarray(tokens, np.int64).reshape(-1)[-self.calibration_rows:].copy())
        self._kept += self._rows[-1].shape[0]
        while self._kept - self._rows[0].shape[0] >= self.calibration_rows:  # keep the latest rows only
            self._kept -= self._rows.pop(0).shape[0]
            if self._tokens:
                self._tokens.pop(0)
        due = self.basis is None and self._kept >= self.calibration_rows
        if due or (self.basis is not None and self._since_fit >= self.refit_rows):
            extra: dict[str, Any] = {} if self.outlier_fraction is None else {"outlier_fraction": self.outlier_fraction}
            if self.step is not None:
                extra["step"] = self.step
            fit_rows = np.concatenate(self._rows)[-self.calibration_rows:]
            if self.predict and table is not None:
                fit_tokens = np.concatenate(self._tokens)[-self.calibration_rows:]
                extra.update(predictor=Predictor.fit(table, fit_tokens, fit_rows), table=table, tokens=fit_tokens)
            self.basis = Basis.fit(fit_rows, self.rank, **extra)
            self._since_fit = 0
            self.fits += 1
        return self.basis


class BoundaryCodec:
    """One node's encoder and decoder of stage-boundary tensors (see the module docstring)."""

    def __init__(self, calibration_rows: int = DEFAULT_CALIBRATION_ROWS,
                 refit_rows: int = DEFAULT_REFIT_ROWS, token_table: TokenTable | None = None) -> None:
        self.calibration_rows = calibration_rows
        self.refit_rows = refit_rows
        #: the base checkpoint's embeddings, for token-predicted schemes (None: this node predicts nothing)
        self.token_table = token_table
        self._fitters: dict[tuple[int, str, str], BasisFitter] = {}
        self._held: dict[str, set[bytes]] = {}  # peer -> ids of our bases it holds
        self._books: OrderedDict[str, BasisBook] = OrderedDict()
        self._own = BasisBook()  # the bases this node fitted: what projected gradients come back in
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ sending (compute thread)
    def encode(self, kind: str, x: np.ndarray, encoding: str, peer: str, stage_index: int = 0,
               tokens: np.ndarray | None = None) -> tuple[dict, bytes]:
        """``(tensor header, payload)`` of activations (``kind="act"``) or input gradients
        (``"grad"``) ``x`` for ``peer``, with that half of scheme ``encoding``; ``tokens``: the
        token id of each of ``x``'s rows (``x.shape[:-1]``) where this stage knows them."""
        scheme = scheme_of(encoding)
        wire, params = (scheme.encoding, scheme.params) if kind == "act" else (scheme.grad_encoding, scheme.grad_params)
        if wire != "basis":
            return encode_with(x, wire, params)
        if params.get("projected"):
            return self._encode_projected(x, peer, params)
        table = self.token_table
        basis = self._fitter(stage_index, kind, encoding, params).observe(x, tokens, table)
        if basis is None or (basis.predictor is not None and (tokens is None or table is None)):
            return encode_with(x, *_FALLBACK)
        with self._lock:
            self._own.add(basis)
            inline = basis.basis_id not in self._held.get(peer, ())
        extra = {k: v for k, v in params.items() if k in ("outlier_fraction", "code_bits")}
        if basis.predictor is not None:
            extra.update(tokens=tokens, table=table)
        return encode_with(x, "basis", {"basis": basis, "inline": inline, **extra})

    def _encode_projected(self, grad: np.ndarray, peer: str, params: dict[str, Any]) -> tuple[dict, bytes]:
        """Gradients for ``peer`` as coefficients in the basis its activations last came in (the
        exact gradient of that projection; the fallback while ``peer`` has sent none, or one of
        another width)."""
        with self._lock:
            book = self._books.get(peer)
            basis = None if book is None else book.latest()
        if basis is None or basis.cols != grad.shape[-1]:
            return encode_with(grad, *_FALLBACK)
        extra = {k: v for k, v in params.items() if k == "code_bits"}
        return encode_with(grad, "basis", {"basis": basis, "inline": False, "centred": False,
                                           "outlier_fraction": 0.0, **extra})

    def forward_encoded(self, forward: Callable[[str, np.ndarray], np.ndarray], key: str, x: np.ndarray,
                        encoding: str, peer: str, stage_index: int = 0) -> tuple[dict, bytes]:
        """Compute thread: run a stage forward and encode its output for ``peer``, in one hop (a
        first stage's ``x`` is token ids: each output row's token, which a predicted scheme sends)."""
        out = forward(key, x)
        return self.encode("act", out, encoding, peer, stage_index, tokens=tokens_of(x, out))

    def _fitter(self, stage_index: int, kind: str, encoding: str, params: dict[str, Any]) -> BasisFitter:
        key = (stage_index, kind, encoding)
        fitter = self._fitters.get(key)
        if fitter is None:
            fitter = self._fitters[key] = BasisFitter(int(params["rank"]), self.calibration_rows,
                                                      int(params.get("refit_rows", self.refit_rows)),
                                                      params.get("outlier_fraction"),
                                                      bool(params.get("predict")) and stage_index == 0,
                                                      params.get("step"))
        return fitter

    # ------------------------------------------------------------------ links (event loop)
    def sent(self, peer: str, header: dict) -> None:
        """``header``'s tensor was handed to ``peer``'s link: an inline basis is now held there."""
        if header.get("encoding") == "basis" and header.get("params", {}).get("inline"):
            with self._lock:
                self._held.setdefault(peer, set()).add(header["params"]["id"])

    def forget_peer(self, peer: str) -> None:
        """A new link to ``peer``: it may hold none of our bases (the next tensor carries them again)."""
        with self._lock:
            self._held.pop(peer, None)

    # ------------------------------------------------------------------ receiving (event loop)
    def decode(self, header: dict, payload: bytes, hidden_size: int, sender: str) -> np.ndarray:
        """A ``[rows, tokens, hidden]`` tensor from ``sender`` (ProtocolViolation/WireFormatError on bad input)."""
        params = header.get("params")
        own = header.get("encoding") == "basis" and isinstance(params, dict) and params.get("centred") is False
        with self._lock:  # the compute thread reads the books (projected gradients) and our own bases
            if own:  # a projected gradient: in a basis we fitted and sent
                return decode_activation(header, payload, hidden_size, bases=self._own)
            book = self._books.get(sender)
            if book is None:
                book = self._books[sender] = BasisBook()
                while len(self._books) > MAX_SENDER_BOOKS:
                    self._books.popitem(last=False)
            self._books.move_to_end(sender)
            book.table = self.token_table
            return decode_activation(header, payload, hidden_size, bases=book)


def tokens_of(inputs: np.ndarray, out: np.ndarray) -> np.ndarray | None:
    """``inputs`` as the token ids of ``out``'s rows when they are (a first stage's integer inputs of
    ``out``'s leading shape), else None."""
    inputs = np.asarray(inputs)
    if inputs.dtype.kind not in "iu" or inputs.shape != out.shape[:-1]:
        return None
    return inputs
