"""Every message of the swarm, as schemas: coordinator <-> node and node <-> node.

Two channels, one rule: nothing is used before it validates here.

* **Coordinator <-> node**: JSON objects over the node's websocket (``/node``),
  validated with :data:`COORDINATOR_TO_NODE` / :data:`NODE_TO_COORDINATOR`.
  The coordinator sends jobs (token ids, advantages); nodes send back sampled
  tokens, losses and counters. Activations and weights never go this way.
* **Node <-> node**: msgpack headers (+ a binary payload) over WebRTC data
  channels (``engine.net.peer_link``), validated with :data:`PEER_MESSAGES`.
  Tensors inside payloads are decoded by ``engine.net.tensor_codec`` with caps.

Message flow of one generation job (S stages, route = one peer per stage)::

    coordinator --gen--> stage 0 --act--> stage 1 ... --act--> last stage
    last stage --tok--> stage 0 (next step)      last stage --gen_done--> coordinator

and of one training micro-batch::

    coordinator --train_in--> stage 0,  --train_out--> last stage
    stage 0 --act--> ... --> last stage (loss) --grad--> ... --> stage 0 --mb_done--> coordinator
    coordinator --apply--> every trainer; replicas --share--> each other; --stepped--> coordinator

and of the weight stream to inference replicas (``engine.swarm.inference_replica``)::

    stage leader --wdelta--> each inference replica of its stage (after every applied step)
    stage leader --streamed--> coordinator (bytes, shadow checksums, quantisation residual)
    inference replica --served--> coordinator (the version it now generates with)
    leader without a stream to a replica --wlead--> it; it answers --weights_req(stream)--> leader

It knows the shapes of messages, not what nodes or the coordinator do with them.
"""

from __future__ import annotations

from engine.net.schema import Any_, Bool, Float, Int, List, Map, Schema, SchemaRegistry, Str

#: longest websocket text message either side accepts (characters)
MAX_WS_MESSAGE_CHARS = 8 * 1024 * 1024
MAX_ROWS = 4096
MAX_TOKENS = 4096
MAX_STAGES = 256
MAX_PEERS = 4096

_PEER_ID = Str(4, 64)
_JOB = Str(1, 64)
_TOKEN = Int(0, 1 << 24)
_VERSION = Int(0, 1 << 40)
_STEP = Int(0, 1 << 40)
_ROUTE = List(_PEER_ID, min_len=1, max_len=MAX_STAGES)
_TOKEN_ROWS = List(List(_TOKEN, min_len=1, max_len=MAX_TOKENS), min_len=1, max_len=MAX_ROWS)
_FLOAT_ROWS = List(List(Float(-1e4, 1e4), max_len=MAX_TOKENS), min_len=1, max_len=MAX_ROWS)
_FLOAT_ROWS_OPT = List(List(Float(-1e4, 1e4), max_len=MAX_TOKENS), min_len=1, max_len=MAX_ROWS, required=False)
_BOOL_ROWS = List(List(Bool(), max_len=MAX_TOKENS), min_len=1, max_len=MAX_ROWS)
_COUNT = Float(0, 1e18)
#: what a node does: trains its stage (and generates), or only generates (inference replica)
ROLES = ("trainer", "inference")
_ROLE = Str(choices=set(ROLES), required=False)
_PEER_LIST = List(_PEER_ID, max_len=MAX_PEERS, required=False)
#: how the last stage samples a generation job (travels with every generation step)
_GEN_PARAMS = Schema("gen_params", {"max_new_tokens": Int(1, MAX_TOKENS), "temperature": Float(0, 100),
                                    "top_p": Float(1e-6, 1), "seed": Int(0, 2**63 - 1), "eos_id": _TOKEN})

# ---------------------------------------------------------------- coordinator -> node
COORDINATOR_TO_NODE = SchemaRegistry([
    Schema("challenge", {"nonce": Str(16, 128)}),
    Schema("welcome", {
        "stage": Int(0, MAX_STAGES - 1), "num_stages": Int(1, MAX_STAGES),
        "layer_start": Int(0, 1 << 16), "layer_end": Int(1, 1 << 16), "num_layers": Int(1, 1 << 16),
        "source": Str(choices={"keep", "checkpoint", "peer"}), "source_peer": Str(4, 64, nullable=True),
        "stage_checkpoint": Str(0, 4096, nullable=True), "version": _VERSION, "run": Any_(),
        "run_id": Str(1, 64), "signal_url": Str(1, 2048)}),
    # inference: the members that are inference replicas (the rest train)
    Schema("members", {"stages": List(List(_PEER_ID, max_len=MAX_PEERS), max_len=MAX_STAGES),
                       "version": _VERSION, "inference": _PEER_LIST}),
    Schema("gen", {"job": _JOB, "route": _ROUTE, "prompt_ids": _TOKEN_ROWS, "params": Map(_GEN_PARAMS)}),
    # prox=True: forward only, to get the proximal log-probs of a batch before its first update
    Schema("train_in", {"step": _STEP, "mb": Int(0, 1 << 20), "route": _ROUTE, "inputs": _TOKEN_ROWS,
                        "prox": Bool(required=False)}),
    Schema("train_out", {"step": _STEP, "mb": Int(0, 1 << 20), "route": _ROUTE, "targets": _TOKEN_ROWS,
                         "mask": _BOOL_ROWS, "behaviour": _FLOAT_ROWS, "advantages": List(Float(-1e4, 1e4),
                                                                                           max_len=MAX_ROWS),
                         "normaliser": Float(1e-9, 1e12), "prox": Bool(required=False),
                         "proximal": _FLOAT_ROWS_OPT}),
    # replicas: the stage's trainers (sorted; the first is the stage leader);
    # inference: the stage's inference replicas, which the leader streams weight deltas to
    Schema("apply", {"step": _STEP, "version": _VERSION, "replicas": List(_PEER_ID, min_len=1, max_len=MAX_PEERS),
                     "checkpoint": Bool(), "inference": _PEER_LIST}),
    Schema("abort", {"step": _STEP}),
    Schema("sync", {"source_peer": _PEER_ID}),
    Schema("shutdown", {"reason": Str(0, 500)}),
])

# ---------------------------------------------------------------- node -> coordinator
NODE_TO_COORDINATOR = SchemaRegistry([
    Schema("hello", {
        "peer_id": _PEER_ID, "public_key": Str(1, 128), "signature": Str(1, 256),
        "backend": Str(1, 32), "device": Str(0, 200), "max_layers": Int(0, 1 << 16, nullable=True),
        "stage": Int(0, MAX_STAGES - 1, nullable=True), "num_stages": Int(1, MAX_STAGES, nullable=True),
        "version": _VERSION, "run_id": Str(0, 64, nullable=True), "has_base": Bool(), "role": _ROLE}),
    Schema("ready", {"stage": Int(0, MAX_STAGES - 1), "version": _VERSION}),
    Schema("gen_done", {"job": _JOB, "tokens": _TOKEN_ROWS, "logprobs": _FLOAT_ROWS,
                        "versions": List(_VERSION, min_len=1, max_len=MAX_STAGES)}),
    Schema("job_failed", {"job": _JOB, "reason": Str(0, 500)}),
    Schema("mb_loss", {"step": _STEP, "mb": Int(0, 1 << 20), "loss": Float(-1e6, 1e6), "tokens": Int(0, 1 << 30),
                       "masked_fraction": Float(0, 1), "ess": Float(0, 1), "clipped_fraction": Float(0, 1)}),
    Schema("mb_done", {"step": _STEP, "mb": Int(0, 1 << 20)}),
    Schema("prox_done", {"step": _STEP, "mb": Int(0, 1 << 20), "logprobs": _FLOAT_ROWS}),
    Schema("mb_failed", {"step": _STEP, "mb": Int(0, 1 << 20), "reason": Str(0, 500)}),
    Schema("stepped", {"step": _STEP, "version": _VERSION, "grad_norm": Float(0, 1e12),
                       "checksum": Float(-1e30, 1e30), "update_bytes": Int(0, 1 << 40),
                       "dense_bytes": Int(0, 1 << 40), "checkpoint_path": Str(0, 4096, nullable=True)}),
    # a stage leader sent weight deltas of ``version``: one entry per inference replica
    # (checksum: of its shadow, i.e. of what that replica holds once it applies the delta)
    Schema("streamed", {"version": _VERSION, "streams": List(Map(Schema("stream", {
        "peer": _PEER_ID, "checksum": Float(-1e30, 1e30), "delta_bytes": Int(0, 1 << 40),
        "dense_bytes": Int(0, 1 << 40), "residual_max_abs": Float(0, 1e30)})), min_len=1, max_len=MAX_PEERS)}),
    # an inference replica now generates with these weights (after a delta or a full load)
    Schema("served", {"version": _VERSION, "checksum": Float(-1e30, 1e30), "source": _PEER_ID,
                      "full": Bool()}),
    Schema("report", {"tokens_generated": _COUNT, "microbatches_trained": _COUNT, "bytes_sent": _COUNT,
                      "bytes_received": _COUNT, "uptime_s": _COUNT}),
])

# ---------------------------------------------------------------- node <-> node (msgpack)
_TENSOR_HEADER = Any_()  # validated by engine.net.tensor_codec.decode_tensor
_STREAM_MAX = 2**31 - 1
PEER_MESSAGES = SchemaRegistry([
    # activations forward (generation step or training micro-batch)
    Schema("act", {"kind": Str(choices={"gen", "train", "prox"}), "job": _JOB, "route": _ROUTE, "hop": Int(1, MAX_STAGES),
                   "versions": List(_VERSION, min_len=1, max_len=MAX_STAGES), "tensor": _TENSOR_HEADER,
                   "step": _STEP, "mb": Int(0, 1 << 20), "params": Map(_GEN_PARAMS, required=False)}),
    # sampled tokens back to stage 0 (done: the job is finished, free the caches)
    Schema("tok", {"job": _JOB, "tokens": List(_TOKEN, min_len=1, max_len=MAX_ROWS), "done": Bool()}),
    Schema("drop", {"job": _JOB, "route": _ROUTE, "hop": Int(1, MAX_STAGES)}),
    # gradient of a stage's input, backwards along a training route
    Schema("grad", {"job": _JOB, "route": _ROUTE, "hop": Int(0, MAX_STAGES - 1), "tensor": _TENSOR_HEADER,
                    "step": _STEP, "mb": Int(0, 1 << 20)}),
    # compressed gradients between replicas of one stage
    Schema("share", {"step": _STEP, "tensors": List(Map(Schema("entry", {
        "name": Str(1, 200), "tensor": _TENSOR_HEADER, "nbytes": Int(0, 1 << 31)})), max_len=4096)}),
    # full weights of a stage, for a replica that joins or resyncs
    # stream=True (inference replicas): also start a weight-delta stream from exactly these weights
    Schema("weights_req", {"stage": Int(0, MAX_STAGES - 1), "stream": Bool(required=False)}),
    Schema("weights", {"stage": Int(0, MAX_STAGES - 1), "version": _VERSION, "config": Any_(), "tensors": List(Map(Schema("entry", {
        "name": Str(1, 200), "tensor": _TENSOR_HEADER, "nbytes": Int(0, 1 << 31)})), max_len=4096),
        "stream": Int(0, _STREAM_MAX, required=False)}),
    # a quantised weight delta of stream ``stream`` (engine.net.shadow_delta wire form in ``delta``)
    Schema("wdelta", {"stage": Int(0, MAX_STAGES - 1), "version": _VERSION, "stream": Int(0, _STREAM_MAX),
                      "delta": Any_()}),
    # "I lead your stage now and hold no stream for you: fetch full weights from me"
    Schema("wlead", {"stage": Int(0, MAX_STAGES - 1), "version": _VERSION}),
])
