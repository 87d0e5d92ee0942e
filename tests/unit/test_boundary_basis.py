import numpy as np
import pytest

from engine.bench.act_boundary import totals, wrap_stages
from engine.model.checkpoint import Checkpoint
from engine.model.loader import load_stage
from engine.model.shard_plan import plan_stages
from engine.net.errors import WireFormatError
from engine.paths import base_checkpoint_dir
from engine.rl.pipeline import LocalPipeline
from engine.swarm.boundary_basis import BoundaryCodec


def _activations(seed, rows=4, tokens=50, cols=64, rank=6):
    rng = np.random.default_rng(seed)
    mixing = np.random.default_rng(7).standard_normal((rank, cols))
    x = rng.standard_normal((rows * tokens, rank)) @ mixing + 0.01 * rng.standard_normal((rows * tokens, cols))
    return x.reshape(rows, tokens, cols).astype(np.float32)


def _send(sender, receiver, x, peer="B", me="A", scheme="basis_r8", kind="act", mark=True):
    header, payload = sender.encode(kind, x, scheme, peer)
    y = receiver.decode(header, payload, hidden_size=x.shape[-1], sender=me)
    if mark:
        sender.sent(peer, header)
    return header, y


def test_a_stage_calibrates_on_its_first_rows_then_sends_its_basis_once_per_peer():
    sender, receiver = BoundaryCodec(calibration_rows=300), BoundaryCodec()
    first, _ = _send(sender, receiver, _activations(0))  # 200 rows: still calibrating
    assert first["encoding"] == "subspace" and first["params"]["rank"] == 0  # int8 rows, exact outliers
    second, _ = _send(sender, receiver, _activations(1))  # 400 rows seen: fitted
    assert second["encoding"] == "basis" and second["params"]["inline"] is True
    x = _activations(2)
    third, y = _send(sender, receiver, x)
    assert third["params"]["inline"] is False and third["params"]["id"] == second["params"]["id"]
    assert float(np.linalg.norm(y - x) / np.linalg.norm(x)) < 0.02
    other, _ = _send(sender, BoundaryCodec(), x, peer="C")  # another peer gets it inline
    assert other["params"]["inline"] is True
    sender.forget_peer("B")  # a new link to B: it may have restarted
    again, _ = _send(sender, receiver, x)
    assert again["params"]["inline"] is True


def test_a_tensor_never_handed_to_the_link_leaves_the_basis_unsent():
    sender = BoundaryCodec(calibration_rows=100)
    cancelled, _ = _send(sender, BoundaryCodec(), _activations(0), mark=False)  # a job cancelled before its send
    assert cancelled["encoding"] == "basis" and cancelled["params"]["inline"] is True
    header, _ = sender.encode("act", _activations(1), "basis_r8", "B")
    assert header["params"]["inline"] is True
    sender.sent("B", header)
    header, _ = sender.encode("act", _activations(2), "basis_r8", "B")
    assert header["params"]["inline"] is False


def test_bases_are_kept_per_sender_and_per_direction_and_stage():
    sender, receiver = BoundaryCodec(calibration_rows=100), BoundaryCodec()
    _send(sender, receiver, _activations(0), me="A")
    header, payload = sender.encode("act", _activations(1), "basis_r8", "B")
    assert header["params"]["inline"] is False
    with pytest.raises(WireFormatError, match="never received"):  # B holds it from A, not from M
        receiver.decode(header, payload, hidden_size=64, sender="M")
    grad, _ = _send(sender, receiver, _activations(3), kind="grad")  # gradients fit their own basis
    assert grad["params"]["id"] != header["params"]["id"]
    other_stage, _ = sender.encode("act", _activations(4), "basis_r8", "B", stage_index=1)
    assert other_stage["params"]["inline"] is True  # a stage fits its own basis (after a reassignment)
    assert other_stage["params"]["id"] != header["params"]["id"]


def test_schemes_without_a_basis_need_no_calibration():
    sender = BoundaryCodec()
    header, _ = sender.encode("act", _activations(0), "int8_rowwise", "B")
    assert header["encoding"] == "int8_rowwise"
    header, _ = sender.encode("grad", _activations(0), "basis_r8_gs8", "B")
    assert header["encoding"] == "subspace" and header["params"]["rank"] == 8


def _tiny_stages(backend):
    ck = Checkpoint(base_checkpoint_dir())
    return [load_stage(ck, spec, backend, "cpu") for spec in plan_stages(ck.config.num_hidden_layers, 2)]


@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_a_basis_scheme_crosses_a_real_boundary_at_a_fraction_of_int8s_bytes(backend):
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    stages = _tiny_stages(backend)
    tokens = np.random.default_rng(0).integers(3, 20, size=(16, 40))
    exact = LocalPipeline(stages).token_logprobs(tokens, tokens)
    wrapped = wrap_stages(stages, "basis_r16")
    for boundary in wrapped:
        boundary.codec.calibration_rows = 600  # the first micro-batch calibrates
    pipeline = LocalPipeline(wrapped)
    for n in range(3):
        logp = pipeline.token_logprobs(tokens, tokens, key=f"k{n}")
        pipeline.backward(f"k{n}", np.ones_like(logp))
    pipeline.zero_grad()
    acts, grads = totals(wrapped, "act"), totals(wrapped, "grad")
    assert acts["tensors"] == grads["tensors"] == 3
    assert acts["x_fewer_than_fp32"] > 8 and grads["x_fewer_than_fp32"] > 8  # int8 rows: 3.9x
    assert np.abs(logp - exact).mean() < 0.03 and acts["relative_error"] < 0.1  # random tokens, rank 16 of 64
    for stage in stages:
        stage.close()


def test_a_scheme_with_refits_sends_a_new_basis_after_that_many_rows():
    sender, receiver = BoundaryCodec(calibration_rows=100, refit_rows=400), BoundaryCodec()
    ids = []
    for n in range(6):  # 200 rows each: fit, -, refit (400 since), -, refit, -
        header, y = _send(sender, receiver, _activations(n) * (1 + n))  # the activations drift
        ids.append((header["params"]["id"], header["params"]["inline"]))
        assert float(np.linalg.norm(y - _activations(n) * (1 + n)) / np.linalg.norm(y)) < 0.05
    assert [inline for _, inline in ids] == [True, False, True, False, True, False]
    assert len({i for i, _ in ids}) == 3
