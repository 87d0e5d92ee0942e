"""Every message of the swarm, as typed structs: coordinator <-> node and node <-> node.

Two channels, one rule: nothing is used before it decodes here (typed, bounded,
unknown keys refused, NaN/inf refused; see :mod:`engine.net.wire`).

* **Coordinator <-> node**: JSON objects over the node's websocket (``/node``):
  :func:`decode_from_coordinator` (-> :data:`CoordinatorToNode`) and
  :func:`decode_from_node` (-> :data:`NodeToCoordinator`). The coordinator sends
  jobs (token ids, advantages); nodes send back sampled tokens, losses and counters.
  Activations and weights never go this way.
* **Node <-> node**: msgpack headers (+ a binary payload) over WebRTC data channels
  (``engine.net.peer_link``): :func:`decode_peer_header` (-> :data:`PeerMessage`).
  Tensors inside payloads are decoded by ``engine.net.tensor_codec`` with caps; the
  ``tensor`` fields here are that codec's header, checked there.

Senders build the structs and write them with :func:`encode` (JSON text for the
websocket) or :func:`encode_peer_header` (msgpack bytes, which ``engine.net.framing``
accepts as an already-packed header). The bytes keep the shape of the old dicts:
same keys, same ``"type"`` strings, optional keys left out when at their default.

Message flow of one generation job (S stages, route = one peer per stage)::

    coordinator --gen--> stage 0 --act--> stage 1 ... --act--> last stage
    last stage --tok--> stage 0 (next step)      last stage --gen_done--> coordinator

and of one training micro-batch::

    coordinator --train_in--> stage 0,  --train_out--> last stage
    stage 0 --act--> ... --> last stage (loss) --grad--> ... --> stage 0 --mb_done--> coordinator
    coordinator --apply--> every trainer; replicas --share--> each other; --stepped--> coordinator
    (with a full-weight digest: the majority decides; --sync--> a minority replica names a majority
    source and the digest, and a mismatch comes back as --weights_refused-->)

and of the weight stream to inference replicas (``engine.swarm.inference_replica``)::

    stage leader (named by the coordinator in ``apply``, ``members``)
        --wdelta--> each inference replica of its stage (after every applied step)
    stage leader --streamed--> coordinator (bytes, shadow checksums, quantisation residual)
    inference replica --served--> coordinator (the version it now generates with)
    leader without a stream to a replica --wlead--> it; it answers --weights_req(stream)--> leader

It knows the shapes of messages, not what nodes or the coordinator do with them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from msgspec import Meta

from engine.net.wire import MessageSet, WireMessage, WireRecord, encode_json, encode_msgpack

#: longest websocket text message either side accepts (characters)
MAX_WS_MESSAGE_CHARS = 8 * 1024 * 1024
#: longest msgpack peer header (bytes; engine.net.framing caps headers at 64 KiB first)
MAX_PEER_HEADER_BYTES = 64 * 1024
MAX_ROWS = 4096
MAX_TOKENS = 4096
#: most model turns of one episode, and tokens of one episode's context (prompt, turns, observations)
MAX_TURNS = 64
MAX_CONTEXT_TOKENS = 1 << 20
MAX_STAGES = 256
MAX_PEERS = 4096
#: most ids that end a completion (a model's EOS ids plus its end-of-turn token)
MAX_STOP_IDS = 16
#: what a node does: trains its stage (and generates), or only generates (inference replica)
ROLES = ("trainer", "inference")
_STREAM_MAX = 2**31 - 1

# ---------------------------------------------------------------- field types
PeerId = Annotated[str, Meta(min_length=4, max_length=64)]
JobId = Annotated[str, Meta(min_length=1, max_length=64)]
TokenId = Annotated[int, Meta(ge=0, le=1 << 24)]
RowIndex = Annotated[int, Meta(ge=0, le=MAX_ROWS - 1)]
Version = Annotated[int, Meta(ge=0, le=1 << 40)]
Step = Annotated[int, Meta(ge=0, le=1 << 40)]
MicroBatch = Annotated[int, Meta(ge=0, le=1 << 20)]
StageIndex = Annotated[int, Meta(ge=0, le=MAX_STAGES - 1)]
StageCount = Annotated[int, Meta(ge=1, le=MAX_STAGES)]
LayerIndex = Annotated[int, Meta(ge=0, le=1 << 16)]
ByteCount = Annotated[int, Meta(ge=0, le=1 << 40)]
StreamId = Annotated[int, Meta(ge=0, le=_STREAM_MAX)]
Reason = Annotated[str, Meta(max_length=500)]
#: a run's id: it names a folder on every node (``stages/<run_id>/``), so no separators, no dots
RunId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
FilePath = Annotated[str, Meta(max_length=4096)]
Route = Annotated[list[PeerId], Meta(min_length=1, max_length=MAX_STAGES)]
PeerList = Annotated[list[PeerId], Meta(max_length=MAX_PEERS)]
Versions = Annotated[list[Version], Meta(min_length=1, max_length=MAX_STAGES)]
TokenRows = Annotated[list[Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_TOKENS)]],
                      Meta(min_length=1, max_length=MAX_ROWS)]
#: a log-probability or an advantage
Value = Annotated[float, Meta(ge=-1e4, le=1e4)]
FloatRows = Annotated[list[Annotated[list[Value], Meta(max_length=MAX_TOKENS)]],
                      Meta(min_length=1, max_length=MAX_ROWS)]
#: per row of a training micro-batch its packed layout ``[prefix_len, n_1, ..., n_G]``
#: (``backends.base.segment_layout``: a group's prompt once, then its completions), or null for a plain row
Segments = Annotated[list[Annotated[list[Annotated[int, Meta(ge=0, le=MAX_TOKENS)]],
                                    Meta(min_length=2, max_length=MAX_ROWS + 1)] | None],
                     Meta(min_length=1, max_length=MAX_ROWS)]
BoolRows = Annotated[list[Annotated[list[bool], Meta(max_length=MAX_TOKENS)]],
                     Meta(min_length=1, max_length=MAX_ROWS)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
Checksum = Annotated[float, Meta(ge=-1e30, le=1e30)]
#: blake2b-128 hex of a stage's full trainable weights (``engine.swarm.weight_votes.weights_digest``)
Digest = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]
Count = Annotated[float, Meta(ge=0.0, le=1e18)]
#: a bit rate, megabits per second (10**6 bit/s)
Mbps = Annotated[float, Meta(ge=0.0, le=1e6)]
#: an engine.net.tensor_codec header (validated by decode_tensor, not here)
TensorHeader = Annotated[dict[str, Any], Meta(max_length=16)]
#: a map validated by its own reader (run config, model config, weight-delta header)
OpaqueMap = Annotated[dict[str, Any], Meta(max_length=256)]


PublicKey = Annotated[str, Meta(min_length=1, max_length=128)]  # base64 raw Ed25519 public key
Signature = Annotated[str, Meta(min_length=1, max_length=256)]  # base64 Ed25519 signature
Nonce = Annotated[str, Meta(min_length=16, max_length=128)]  # hex the other side signs


class Ticket(WireRecord, frozen=True):
    """The coordinator's signed word that ``route`` carries job ``job`` (``engine.swarm.tickets``).

    Peers act on an ``act``, ``grad`` or ``drop`` only with a ticket for its job and route whose
    signature the coordinator's key verifies, so no member can name itself a job's neighbour.
    """

    job: JobId  # generation job id, or a training micro-batch key (``engine.swarm.training.train_key``)
    route: Route  # one peer per stage, as the coordinator assigned it
    expires_s: Annotated[int, Meta(ge=0, le=1 << 40)]  # unix seconds (coordinator clock) it is good until
    signature: Signature  # by the coordinator's key, over ``engine.swarm.tickets.ticket_bytes``


class GenParams(WireRecord, frozen=True):
    """How the last stage samples a generation job (travels with every generation step)."""

    max_new_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)]  # completion budget incl. EOS
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)]  # softmax temperature (0 = greedy)
    top_p: Annotated[float, Meta(ge=1e-6, le=1.0)]  # nucleus truncation (1 = off)
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)]  # sampler seed of this job
    # the ids that end a completion (EOS ids + the chat template's end-of-turn token); the first is
    # the canonical EOS, written for a row that produced nothing
    stop_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_STOP_IDS)]
    # multi-turn episodes (engine.swarm.episodes): the job's turn (0-based); a stage that sees a new
    # turn of a job checks its KV cache before the first step of it
    turn: Annotated[int, Meta(ge=0, le=MAX_TURNS)] = 0
    # tokens of this job every stage's cache must already hold at the turn's start (0: start a fresh
    # cache); a stage whose cache holds another count fails the job with "cache miss"
    cached_tokens: Annotated[int, Meta(ge=0, le=MAX_CONTEXT_TOKENS)] = 0
    # keep the caches when the turn ends (a continuation follows; gen_release or expiry frees them)
    keep_cache: bool = False
    # activations of this job cross stage boundaries exact (fp32), not in the run's lossy encoding:
    # set for held-out evals, so a score is the weights' and equals the exported model's
    exact_activations: bool = False


# ---------------------------------------------------------------- coordinator -> node
class Challenge(WireMessage, frozen=True, tag="challenge"):
    nonce: Nonce  # hex the node signs in its hello


class Welcome(WireMessage, frozen=True, tag="welcome"):
    stage: StageIndex  # the stage this node serves
    num_stages: StageCount  # stages in the pipeline
    layer_start: LayerIndex  # first layer of the stage (inclusive)
    layer_end: Annotated[int, Meta(ge=1, le=1 << 16)]  # last layer of the stage (exclusive)
    num_layers: Annotated[int, Meta(ge=1, le=1 << 16)]  # layers of the whole model
    source: Literal["keep", "checkpoint", "peer"]  # where the stage's weights come from
    source_peer: PeerId | None  # the peer to fetch weights from (source "peer")
    stage_checkpoint: FilePath | None  # checkpoint to load (source "checkpoint")
    version: Version  # policy version the weights must have
    run: OpaqueMap  # RunConfig.to_dict(); rebuilt by engine.swarm.run_config
    run_id: RunId  # the run's id (letters, digits, '-' and '_' only)
    signal_url: Annotated[str, Meta(min_length=1, max_length=2048)]  # signalling websocket URL
    coordinator_key: PublicKey | None = None  # the coordinator's identity key (tickets are signed by it)
    # over engine.swarm.coordinator_session.welcome_bytes (the hello's nonce): the coordinator holds that key
    coordinator_signature: Signature | None = None
    # the role the coordinator gives the node (None: the one its hello offered); a trainer whose links would
    # set every step's pace serves generation only (``engine.swarm.link_roles``), and why, in words
    role: Literal["trainer", "inference"] | None = None
    role_reason: Annotated[str, Meta(max_length=300)] | None = None


class Members(WireMessage, frozen=True, tag="members"):
    stages: Annotated[list[PeerList], Meta(max_length=MAX_STAGES)]  # peer ids per stage
    version: Version  # current policy version
    inference: PeerList = []  # the members that are inference replicas (the rest train)
    # per stage, the trainer the coordinator named leader (None: none yet); inference replicas take
    # weight-stream messages from it alone
    leaders: Annotated[list[PeerId | None], Meta(max_length=MAX_STAGES)] = []


class Gen(WireMessage, frozen=True, tag="gen"):
    job: JobId  # generation job id
    route: Route  # one peer per stage
    prompt_ids: TokenRows  # prompt token ids, one row per sequence
    params: GenParams  # sampling settings
    ticket: Ticket | None = None  # the job's signed ticket, forwarded with every hop


class GenRelease(WireMessage, frozen=True, tag="gen_release"):
    """The episode of a job that kept its caches is over: free them along the route."""

    job: JobId  # the job whose caches to free
    route: Route  # the route it ran on (sent to its first stage)
    # stop the job even while a turn of it runs: a duplicate of it on another route (a hedge of a
    # straggler) already delivered its result
    cancel: bool = False


class TrainIn(WireMessage, frozen=True, tag="train_in"):
    step: Step  # optimiser step the micro-batch belongs to
    mb: MicroBatch  # micro-batch index in the step
    route: Route  # one peer per stage
    inputs: TokenRows  # input token ids, one row per sequence
    prox: bool = False  # forward only, for the proximal log-probs before the first update
    ticket: Ticket | None = None  # the micro-batch's signed ticket, forwarded with every hop
    segments: Segments | None = None  # packed rows' layouts (null: every row plain); every hop carries it


class TrainOut(WireMessage, frozen=True, tag="train_out"):
    step: Step  # optimiser step the micro-batch belongs to
    mb: MicroBatch  # micro-batch index in the step
    route: Route  # one peer per stage
    targets: TokenRows  # next-token targets per row
    mask: BoolRows  # which targets count in the loss
    behaviour: FloatRows  # log-probs of the targets under the sampling policy
    advantages: Annotated[list[Value], Meta(max_length=MAX_ROWS)]  # one per row (empty with token_advantages)
    normaliser: Annotated[float, Meta(ge=1e-9, le=1e12)]  # divides the summed loss (tokens of the batch)
    prox: bool = False  # forward only: return the log-probs (prox_done), no loss
    proximal: FloatRows | None = None  # proximal log-probs (decoupled PPO's anchor)
    ticket: Ticket | None = None  # the micro-batch's signed ticket (its gradient goes back with it)
    token_advantages: FloatRows | None = None  # per target instead of per row (packed rows: one per sample)


class Apply(WireMessage, frozen=True, tag="apply"):
    step: Step  # the step whose gradients are complete
    version: Version  # the version the stage has after applying it
    replicas: Annotated[list[PeerId], Meta(min_length=1, max_length=MAX_PEERS)]  # the stage's trainers, sorted
    checkpoint: bool  # write a stage checkpoint after this step
    inference: PeerList = []  # the stage's inference replicas, which the leader streams deltas to
    # the trainer the coordinator named to lead the stage (stream to inference replicas); None: nobody
    leader: PeerId | None = None
    # per replica (in ``replicas``' order), its fraction of the stage's training tokens in this step
    # (micro-batches follow the routes' measured speed, so slow trainers train fewer rows); the
    # aggregation weighs contributions by it. Empty: equal shares
    token_shares: Annotated[list[Fraction], Meta(max_length=MAX_PEERS)] = []
    # the longest the trainer may wait on its replicas in this step (their shares, or DiLoCo's outer
    # sync) before going on without them; the tied gradient's wait ends twice this after ``apply``
    # (the other end may first wait out its own replicas). The coordinator sets a third of its step
    # deadline, so a trainer kept waiting by a silent peer still says ``stepped`` in time and is not
    # blamed for that peer. None: the node's own timeouts
    peer_wait_s: Annotated[float, Meta(gt=0.0, le=3600.0)] | None = None


class Abort(WireMessage, frozen=True, tag="abort"):
    step: Step  # drop everything of this step


class Sync(WireMessage, frozen=True, tag="sync"):
    source_peer: PeerId  # fetch full weights from this peer
    # the majority's digest of the stage's weights and their version: install only weights of this
    # version that hash to it (None: no vote behind this sync)
    weights_hash: Digest | None = None
    version: Version | None = None
    # a trainer that said ready with weights older than its stage's: install these, then say ready again
    catch_up: bool = False


class Shutdown(WireMessage, frozen=True, tag="shutdown"):
    reason: Reason  # words for the user


class ExportPermit(WireMessage, frozen=True, tag="export_permit"):
    """The coordinator lets ``peer`` (an exporter, not a member) ask this stage leader for its full
    weights (``weights_req``) until ``expires_s``: ``polis export --coordinator`` (``engine.swarm.export_api``)."""

    peer: PeerId  # the exporter's peer id (its signalling identity)
    stage: StageIndex  # the stage it may fetch
    expires_s: Annotated[int, Meta(ge=0, le=1 << 40)]  # unix seconds (coordinator clock) it is good until


CoordinatorToNode = Union[Challenge, Welcome, Members, Gen, GenRelease, TrainIn, TrainOut, Apply, Abort, Sync, Shutdown,
                          ExportPermit]


# ---------------------------------------------------------------- node -> coordinator
class Hello(WireMessage, frozen=True, tag="hello"):
    peer_id: PeerId  # hash of public_key
    public_key: Annotated[str, Meta(min_length=1, max_length=128)]  # base64 Ed25519 key
    signature: Annotated[str, Meta(min_length=1, max_length=256)]  # base64, over the challenge
    backend: Annotated[str, Meta(min_length=1, max_length=32)]  # compute backend name
    device: Annotated[str, Meta(max_length=200)]  # device in words
    max_layers: LayerIndex | None  # most layers this node can hold (None = no limit)
    stage: StageIndex | None  # stage it served before (resume), if any
    num_stages: StageCount | None  # pipeline depth it served before, if any
    version: Version  # policy version of the weights it holds
    run_id: RunId | None  # run those weights belong to
    has_base: bool  # it has the base checkpoint on disk
    role: Literal["trainer", "inference"] = "trainer"  # what it offers to do
    nonce: Nonce | None = None  # the node's challenge: the coordinator signs it in the welcome
    uplink_mbps: Mbps | None = None  # its upload cap, if its user set one (placement advice; measured rates win)


class Ready(WireMessage, frozen=True, tag="ready"):
    stage: StageIndex  # the stage now loaded
    version: Version  # its weights' version


class GenDone(WireMessage, frozen=True, tag="gen_done"):
    job: JobId  # the finished job
    tokens: TokenRows  # sampled completion ids per row
    logprobs: FloatRows  # their behaviour log-probs
    versions: Versions  # policy version of each stage that generated


class JobFailed(WireMessage, frozen=True, tag="job_failed"):
    job: JobId  # the job given up
    reason: Reason  # why, in words


class MbLoss(WireMessage, frozen=True, tag="mb_loss"):
    step: Step  # optimiser step
    mb: MicroBatch  # micro-batch index
    loss: Annotated[float, Meta(ge=-1e6, le=1e6)]  # summed, normalised loss of the micro-batch
    tokens: Annotated[int, Meta(ge=0, le=1 << 30)]  # tokens that counted
    masked_fraction: Fraction  # share of tokens masked by the importance band
    ess: Fraction  # effective sample size / tokens
    clipped_fraction: Fraction  # share of tokens where the PPO clip was active


class MbDone(WireMessage, frozen=True, tag="mb_done"):
    step: Step  # optimiser step
    mb: MicroBatch  # micro-batch whose backward pass reached stage 0


class ProxDone(WireMessage, frozen=True, tag="prox_done"):
    step: Step  # optimiser step
    mb: MicroBatch  # micro-batch index
    logprobs: FloatRows  # proximal log-probs of its targets


class MbFailed(WireMessage, frozen=True, tag="mb_failed"):
    step: Step  # optimiser step
    mb: MicroBatch  # micro-batch index
    reason: Reason  # why, in words


class Stepped(WireMessage, frozen=True, tag="stepped"):
    step: Step  # the applied step
    version: Version  # the stage's version after it
    grad_norm: Annotated[float, Meta(ge=0.0, le=1e12)]  # stage gradient norm before clipping
    checksum: Checksum  # of the stage's weights (a cheap sample; the stream book pairs it with ``served``)
    update_bytes: ByteCount  # bytes sent for the replica gradient exchange
    dense_bytes: ByteCount  # what fp32 would have taken
    checkpoint_path: FilePath | None  # stage checkpoint written at this step, if any
    weights_hash: Digest | None = None  # of the stage's full trainable weights (the replicas' vote)
    skipped: bool = False  # the aggregate was not finite: not applied, weights kept (``grad_norm`` 0)


class StreamReport(WireRecord, frozen=True):
    """One inference replica's weight delta sent by a stage leader."""

    peer: PeerId  # the replica
    checksum: Checksum  # of the leader's shadow of that replica (what it holds after applying)
    delta_bytes: ByteCount  # bytes of the delta on the wire
    dense_bytes: ByteCount  # what fp32 weights would have taken
    residual_max_abs: Annotated[float, Meta(ge=0.0, le=1e30)]  # largest quantisation residual


class Streamed(WireMessage, frozen=True, tag="streamed"):
    version: Version  # the version streamed
    streams: Annotated[list[StreamReport], Meta(min_length=1, max_length=MAX_PEERS)]  # one per replica


class Served(WireMessage, frozen=True, tag="served"):
    version: Version  # the version this inference replica now generates with
    checksum: Checksum  # of its weights
    source: PeerId  # the leader they came from
    full: bool  # a full load (True) or a delta (False)
    weights_hash: Digest | None = None  # full loads: digest of the weights received (vs the majority's)


class WeightsRefused(WireMessage, frozen=True, tag="weights_refused"):
    """A ``sync`` whose source sent weights that did not hash to the digest the ``sync`` named."""

    source: PeerId  # the peer that sent them
    version: Version  # the version they claimed
    reason: Reason  # what did not match, in words


class Report(WireMessage, frozen=True, tag="report"):
    # every count is a delta since the last report, and the node's own word: the ledger keeps the bytes,
    # uptime and compute seconds as self-reported figures and credits none of it (engine.swarm.ledger)
    tokens_generated: Count  # claimed; not credited (the coordinator counts the results it accepts)
    microbatches_trained: Count  # claimed; not credited (the coordinator counts the ones it saw complete)
    bytes_sent: Count  # on peer links
    bytes_received: Count  # on peer links
    uptime_s: Count  # seconds the node ran
    gen_compute_s: Count = 0.0  # compute-thread seconds of generation steps (also paces generation)
    gen_steps: Count = 0.0  # generation steps (one job, one stage, one token) in those seconds
    link_rtt_ms: Annotated[dict[PeerId, Annotated[float, Meta(ge=0.0, le=600_000.0)]],
                           Meta(max_length=MAX_PEERS)] = {}  # smoothed round trip of each open peer link
    # (those below place nodes by bandwidth: engine.swarm.bandwidth_placement)
    link_send_mbps: Annotated[dict[PeerId, Mbps], Meta(max_length=MAX_PEERS)] = {}  # measured send rate per link
    uplink_mbps: Mbps = 0.0  # fastest a link sent while the path set the pace (capped by the upload limit); 0: unknown
    uplink_floor_mbps: Mbps = 0.0  # fastest any link sent: the uplink is at least this


NodeToCoordinator = Union[Hello, Ready, GenDone, JobFailed, MbLoss, MbDone, ProxDone, MbFailed, Stepped,
                          Streamed, Served, WeightsRefused, Report]


# ---------------------------------------------------------------- node <-> node (msgpack)
class TensorEntry(WireRecord, frozen=True):
    """One named tensor of a bundle; its bytes follow the previous entry's in the payload."""

    name: Annotated[str, Meta(min_length=1, max_length=200)]  # parameter name
    tensor: TensorHeader  # its tensor_codec header
    nbytes: Annotated[int, Meta(ge=0, le=1 << 31)]  # its payload bytes


class Act(WireMessage, frozen=True, tag="act"):
    """Activations forward (a generation step or a training micro-batch)."""

    kind: Literal["gen", "train", "prox"]  # what the activations are for
    job: JobId  # generation job or training micro-batch key
    route: Route  # one peer per stage
    hop: Annotated[int, Meta(ge=1, le=MAX_STAGES)]  # index in route of the receiver
    versions: Versions  # version of each stage passed so far
    tensor: TensorHeader  # the activations' tensor_codec header
    step: Step  # optimiser step (0 for generation)
    mb: MicroBatch  # micro-batch index (0 for generation)
    params: GenParams | None = None  # sampling settings (generation)
    ticket: Ticket | None = None  # the coordinator's ticket for this job and route
    #: a generation prefill of the job's distinct prompt rows: job row i is tensor row expand[i]
    #: (every stage expands its cache to the job's rows after it); None: one tensor row per job row
    expand: Annotated[list[RowIndex], Meta(min_length=1, max_length=MAX_ROWS)] | None = None
    #: a decoding step after rows finished: every stage first keeps only these rows of its cache of
    #: the job (strictly increasing indices; Tok.keep of the step before); None: every row goes on
    keep: Annotated[list[RowIndex], Meta(min_length=1, max_length=MAX_ROWS)] | None = None
    segments: Segments | None = None  # a training micro-batch's packed rows (TrainIn.segments)


class Tok(WireMessage, frozen=True, tag="tok"):
    """Sampled tokens back to stage 0."""

    job: JobId  # generation job
    tokens: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_ROWS)]  # one per row going on
    done: bool  # the job is finished: free the caches
    turn: Annotated[int, Meta(ge=0, le=MAX_TURNS)] = 0  # the turn the tokens belong to (GenParams.turn)
    #: rows finished: the cache rows that go on (strictly increasing), one token each; the next
    #: step's Act carries the same list so that every stage drops the other rows. None: all rows
    keep: Annotated[list[RowIndex], Meta(min_length=1, max_length=MAX_ROWS)] | None = None


class Drop(WireMessage, frozen=True, tag="drop"):
    job: JobId  # the job whose caches to free
    route: Route  # one peer per stage
    hop: Annotated[int, Meta(ge=1, le=MAX_STAGES)]  # index in route of the receiver
    through_last: bool = False  # the last stage frees its cache too (it kept it: gen_release)
    cancel: bool = False  # the job was cancelled mid-turn (gen_release cancel): stop decoding it here too
    ticket: Ticket | None = None  # the coordinator's ticket for this job and route


class Grad(WireMessage, frozen=True, tag="grad"):
    """Gradient of a stage's input, backwards along a training route."""

    job: JobId  # micro-batch key
    route: Route  # one peer per stage
    hop: Annotated[int, Meta(ge=0, le=MAX_STAGES - 1)]  # index in route of the receiver
    tensor: TensorHeader  # the gradient's tensor_codec header
    step: Step  # optimiser step
    mb: MicroBatch  # micro-batch index
    ticket: Ticket | None = None  # the coordinator's ticket for this micro-batch and route


class Share(WireMessage, frozen=True, tag="share"):
    """Compressed gradients between replicas of one stage."""

    step: Step  # optimiser step
    tensors: Annotated[list[TensorEntry], Meta(max_length=4096)]  # one per parameter


class WeightsReq(WireMessage, frozen=True, tag="weights_req"):
    """Ask for full weights of a stage (a replica that joins or resyncs)."""

    stage: StageIndex  # the stage wanted
    stream: bool = False  # inference replicas: also start a weight-delta stream from these weights
    outer_state: bool = False  # diloco resync: send the outer momentum next to the synced weights
    optimizer_state: bool = False  # a trainer (every-step sync): send the AdamW moments too (adamw_transfer)


class Weights(WireMessage, frozen=True, tag="weights"):
    stage: StageIndex  # the stage sent
    version: Version  # its version
    config: OpaqueMap  # model config (HF dict), checked by the model loader
    tensors: Annotated[list[TensorEntry], Meta(max_length=4096)]  # one per parameter
    stream: StreamId | None = None  # the weight-delta stream that starts from exactly these weights


class WDelta(WireMessage, frozen=True, tag="wdelta"):
    """A quantised weight delta of stream ``stream``."""

    stage: StageIndex  # the stage
    version: Version  # the version after applying it
    stream: StreamId  # the stream it belongs to
    delta: OpaqueMap  # engine.net.shadow_delta wire header, checked there


class TiedGrad(WireMessage, frozen=True, tag="tied_grad"):
    """The first or the last stage's replica-aggregated gradient of the embedding both hold (tied),
    fp32, with the squared norm of the rest of its gradient (the two stages clip as one unit)."""

    step: Step  # optimiser step
    stage: StageIndex  # the sender's stage (0 or the last)
    rest_sq_norm: Annotated[float, Meta(ge=0.0, le=1e30)]  # squared L2 norm of its other gradients
    tensors: Annotated[list[TensorEntry], Meta(max_length=16)]  # the tied tensors, fp32


class WLead(WireMessage, frozen=True, tag="wlead"):
    """I lead your stage now and hold no stream for you: fetch full weights from me."""

    stage: StageIndex  # the stage
    version: Version  # the leader's version


PeerMessage = Union[Act, Tok, Drop, Grad, Share, TiedGrad, WeightsReq, Weights, WDelta, WLead]


# ---------------------------------------------------------------- decoders and encoders
COORDINATOR_TO_NODE: MessageSet[CoordinatorToNode] = MessageSet(
    "coordinator->node", CoordinatorToNode, max_size=MAX_WS_MESSAGE_CHARS)
NODE_TO_COORDINATOR: MessageSet[NodeToCoordinator] = MessageSet(
    "node->coordinator", NodeToCoordinator, max_size=MAX_WS_MESSAGE_CHARS)
PEER_MESSAGES: MessageSet[PeerMessage] = MessageSet("peer", PeerMessage, max_size=MAX_PEER_HEADER_BYTES)


def decode_from_coordinator(text: str | bytes) -> CoordinatorToNode:
    """One untrusted websocket message from the coordinator (raises ProtocolViolation)."""
    return COORDINATOR_TO_NODE.decode_json(text)


def decode_from_node(text: str | bytes) -> NodeToCoordinator:
    """One untrusted websocket message from a node (raises ProtocolViolation)."""
    return NODE_TO_COORDINATOR.decode_json(text)


def decode_peer_header(header: dict | bytes) -> PeerMessage:
    """One untrusted peer header: a map from engine.net.framing, or raw msgpack bytes."""
    if isinstance(header, (bytes, bytearray, memoryview)):
        return PEER_MESSAGES.decode_msgpack(header)
    return PEER_MESSAGES.convert(header)


def encode(message: CoordinatorToNode | NodeToCoordinator) -> str:
    """A coordinator <-> node message as websocket text (``ws.send_str(encode(msg))``)."""
    return encode_json(message)


def encode_peer_header(message: PeerMessage) -> bytes:
    """A peer header as packed msgpack (pass it to the link instead of a dict)."""
    return encode_msgpack(message)
