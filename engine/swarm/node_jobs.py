"""What a node does with each job message: generation steps, training micro-batches, steps.

:class:`NodeJobs` is the job half of :class:`engine.swarm.node.Node` (a mixin
over the node's attributes: ``rt``, ``compute``, ``spec``, ``run_cfg``, ...).
Every handler checks that the message came from the peer its route names and
fits this stage before touching the backend; tensors are decoded with caps.
Compute runs on the node's compute thread; sends are awaited on the loop.

What it does not know: how links are made, how the node joined, rewards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.net.errors import LinkClosed, NetError, ProtocolViolation
from engine.swarm import tensor_bundle
from engine.swarm.inference_replica import TRAINING_MESSAGES
from engine.swarm.replica_sync import aggregate, dense_nbytes

log = logging.getLogger(__name__)

#: generation caches / training slots untouched this long are freed (seconds)
JOB_TTL_S = 120.0


def _train_key(m: dict) -> str:
    """Key of a training micro-batch; proximal (forward-only) passes get their own."""
    return f"{'p' if m.get('prox') or m.get('kind') == 'prox' else ''}{m['step']}:{m['mb']}"


def _rect(rows: list[list[Any]], dtype, what: str) -> np.ndarray:
    width = len(rows[0])
    if any(len(r) != width for r in rows):
        raise ProtocolViolation(f"{what}: rows of different lengths")
    return np.asarray(rows, dtype=dtype)


class NodeJobs:
    """Job handlers of a node (mixed into ``Node``)."""

    # ------------------------------------------------------------------ dispatch
    def _on_coordinator(self, m: dict) -> None:
        kind = m["type"]
        if kind in TRAINING_MESSAGES and self.role != "trainer":
            log.warning("ignored '%s': this node is an inference replica and does no training", kind)
            return
        if kind == "gen":
            self._spawn(self._guard(self._gen_start(m), job=m["job"]), f"polis-gen-{m['job']}")
        elif kind == "train_in":
            self._spawn(self._guard(self._train_in(m), step=m["step"], mb=m["mb"]), f"polis-train-{m['step']}-{m['mb']}")
        elif kind == "train_out":
            key = _train_key(m)
            self._slot(key).out = m
            self._spawn(self._guard(self._train_last_if_ready(key), step=m["step"], mb=m["mb"]), f"polis-last-{key}")
        elif kind == "apply":
            self._spawn(self._apply_step(m), f"polis-apply-{m['step']}")
        elif kind == "abort":
            self._spawn(self._abort(m["step"]), f"polis-abort-{m['step']}")
        elif kind == "members":
            self.members = m["stages"]
            self.inference_peers = set(m.get("inference") or ())
            self.coordinator_version = m["version"]
            self._connect_neighbours()
            self._emit_status()
        elif kind == "sync":
            self._spawn(self._resync(m["source_peer"]), "polis-resync")
        elif kind == "welcome":
            self._spawn(self._reassign(m), "polis-reassign")
        elif kind == "shutdown":
            log.info("coordinator asked us to stop: %s", m["reason"])
            self.request_stop()

    async def _guard(self, coro, *, job: str | None = None, step: int | None = None, mb: int | None = None) -> None:
        """Run a job coroutine; report a failure to the coordinator instead of dying."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except (ProtocolViolation, NetError, LinkClosed, ValueError, RuntimeError) as exc:
            log.warning("job %s failed: %s", job or f"{step}:{mb}", exc)
            if job is not None:
                await self._send_coordinator({"type": "job_failed", "job": job, "reason": str(exc)[:500]})
            else:
                key = f"{step}:{mb}"
                self._train_slots.pop(key, None)
                if key in self._train_keys:
                    self._train_keys.discard(key)
                    await self.compute.run(self.rt.release, key)
                await self._send_coordinator({"type": "mb_failed", "step": step, "mb": mb, "reason": str(exc)[:500]})

    def _on_peer(self, sender: str, h: dict, payload: bytes) -> None:
        kind = h["type"]
        me = self.identity.peer_id
        if kind in ("wdelta", "wlead"):  # queued even while loading; handled once a stage is loaded
            self._on_stream_message(sender, h, payload)
            return
        if self.spec is None or self.rt is None or self.rt.backend is None:
            raise ProtocolViolation(f"'{kind}' arrived before this node holds a stage")
        if kind in ("act", "drop", "grad"):
            route, hop = h["route"], h["hop"]
            if len(route) != self.spec.num_stages or hop != self.spec.stage_index or route[hop] != me:
                raise ProtocolViolation(f"'{kind}' routed to hop {hop} of {len(route)}, but we are stage "
                                        f"{self.spec.stage_index}")
            upstream = route[hop + 1] if kind == "grad" else route[hop - 1]
            if sender != upstream:
                raise ProtocolViolation(f"'{kind}' from {sender}, but the route says {upstream}")
        if kind == "act":
            x = self._decode_activation(h["tensor"], payload)
            if h["kind"] == "gen":
                self._spawn(self._guard(self._gen_hop(h, x), job=h["job"]), f"polis-gen-{h['job']}")
            else:
                key = _train_key(h)
                if self.spec.is_last:
                    self._slot(key).act = (h, x)
                    self._spawn(self._guard(self._train_last_if_ready(key), step=h["step"], mb=h["mb"]),
                                f"polis-last-{key}")
                else:
                    self._spawn(self._guard(self._train_mid(h, x), step=h["step"], mb=h["mb"]), f"polis-mid-{key}")
        elif kind == "grad":
            g = self._decode_activation(h["tensor"], payload)
            self._spawn(self._guard(self._train_back(h, g), step=h["step"], mb=h["mb"]), f"polis-back-{h['job']}")
        elif kind == "tok":
            state = self._gen_first.get(h["job"])
            if state is None:
                return  # an abandoned job
            if sender != state["route"][-1]:
                raise ProtocolViolation(f"tokens for {h['job']} from {sender}, not the route's last stage")
            if len(h["tokens"]) != state["rows"]:
                raise ProtocolViolation(f"{len(h['tokens'])} tokens for a job of {state['rows']} rows")
            self._spawn(self._guard(self._gen_tokens(h), job=h["job"]), f"polis-tok-{h['job']}")
        elif kind == "drop":
            self._spawn(self._gen_drop(h["job"], h["route"], h["hop"]), f"polis-drop-{h['job']}")
        elif kind == "share":
            if sender not in self._stage_members():
                raise ProtocolViolation(f"gradient share from {sender}, who is not a replica of our stage")
            if len(self._shares) > 4 and h["step"] not in self._shares:
                raise ProtocolViolation("too many steps of gradient shares in flight")
            self._shares.setdefault(h["step"], {})[sender] = (h["tensors"], payload)
            self._share_event.set()
        elif kind == "weights_req":
            if h["stage"] != self.spec.stage_index or sender not in self._stage_members():
                raise ProtocolViolation(f"weights of stage {h['stage']} asked by {sender}, not a replica of ours")
            if h.get("stream"):
                if self.role != "trainer" or sender not in self.inference_peers:
                    raise ProtocolViolation(f"a weight stream asked by {sender}, not an inference replica, "
                                            f"or of a node that does not train")
                self._spawn(self._send_stream_weights(sender), f"polis-weights-{sender[:8]}")
            else:
                self._spawn(self._send_weights(sender), f"polis-weights-{sender[:8]}")
        elif kind == "weights":
            waiter = self._weights_waiter
            if waiter is None or waiter.done() or sender != self._weights_from:
                raise ProtocolViolation("unrequested weights")
            waiter.set_result((h, payload, h["config"]))

    def _connect_neighbours(self) -> None:
        """Open links ahead of need to every peer we will exchange with (neighbour stages, replicas).

        Only the side with the smaller peer id dials, so two peers never race to connect;
        connecting under load can take seconds and must not delay the first job.
        """
        if self.spec is None or self._pm is None:
            return
        me, stage = self.identity.peer_id, self.spec.stage_index
        wanted = set()
        for s in (stage - 1, stage, stage + 1):
            if 0 <= s < len(self.members):
                wanted.update(self.members[s])
        if self.spec.is_last and self.members:
            wanted.update(self.members[0])  # sampled tokens go back to stage 0
        for peer in sorted(wanted):
            if peer > me and self._pm.link(peer) is None and peer not in self._dialing:
                self._dialing.add(peer)
                self._spawn(self._dial(peer), f"polis-dial-{peer[:8]}")

    async def _dial(self, peer: str) -> None:
        try:
            await self._link(peer)
        except (NetError, OSError, asyncio.TimeoutError) as exc:
            log.info("could not open a link to %s yet: %s", peer, exc)
        finally:
            self._dialing.discard(peer)

    def _stage_members(self) -> list[str]:
        stage = self.spec.stage_index
        return self.members[stage] if stage < len(self.members) else []

    def _slot(self, key: str):
        from engine.swarm.node import _TrainSlot

        slot = self._train_slots.get(key)
        if slot is None:
            if len(self._train_slots) > 4096:
                raise ProtocolViolation("too many training micro-batches waiting")
            slot = self._train_slots[key] = _TrainSlot()
        return slot

    # ------------------------------------------------------------------ generation
    async def _gen_start(self, m: dict) -> None:
        route = m["route"]
        if not self.spec.is_first or len(route) != self.spec.num_stages or route[0] != self.identity.peer_id:
            raise ProtocolViolation("generation job sent to a node that is not its first stage")
        ids = _rect(m["prompt_ids"], np.int64, "prompt_ids")
        if ids.max() >= self.rt.vocab_size:
            raise ProtocolViolation("prompt token id outside the vocabulary")
        self._gen_first[m["job"]] = {"route": route, "params": m["params"], "rows": ids.shape[0],
                                     "touched": time.monotonic()}
        await self._gen_advance(m["job"], ids)

    async def _gen_advance(self, job: str, x: np.ndarray) -> None:
        state = self._gen_first[job]
        state["touched"] = time.monotonic()
        self.counters["tokens_generated"] += state["rows"]
        if self.spec.is_last:  # a one-stage swarm samples right here
            header = {"job": job, "route": state["route"], "params": state["params"], "versions": []}
            await self._gen_sample(header, x)
            return
        tensor, payload = await self.compute.run(self._forward_encoded, self.rt.gen_forward, job, x)
        await self._send(state["route"][1], {"type": "act", "kind": "gen", "job": job, "route": state["route"],
                                             "hop": 1, "versions": [self.rt.version], "tensor": tensor, "step": 0,
                                             "mb": 0, "params": state["params"]}, payload)

    async def _gen_hop(self, h: dict, x: np.ndarray) -> None:
        self.counters["tokens_generated"] += x.shape[0]
        if self.spec.is_last:
            await self._gen_sample(h, x)
            return
        self._gen_mid_touch[h["job"]] = time.monotonic()
        tensor, payload = await self.compute.run(self._forward_encoded, self.rt.gen_forward, h["job"], x)
        hop = h["hop"] + 1
        await self._send(h["route"][hop], {**h, "hop": hop, "versions": h["versions"] + [self.rt.version],
                                           "tensor": tensor}, payload)

    async def _gen_sample(self, h: dict, x: np.ndarray) -> None:
        from engine.swarm.node import _LastStageJob

        job, params = h["job"], h.get("params")
        if params is None:
            raise ProtocolViolation("generation step without sampling parameters")
        versions = h["versions"] + [self.rt.version]
        state = self._gen_last.get(job)
        if state is None:
            if len(self._gen_last) > 1024:
                raise ProtocolViolation("too many generation jobs in flight")
            state = self._gen_last[job] = _LastStageJob(rows=x.shape[0], tokens=[[] for _ in range(x.shape[0])],
                                                        logprobs=[[] for _ in range(x.shape[0])],
                                                        finished=np.zeros(x.shape[0], dtype=bool), versions=versions)
        if x.shape[0] != state.rows or len(versions) != len(state.versions):
            raise ProtocolViolation("generation step does not match its job")
        state.versions = [min(a, b) for a, b in zip(state.versions, versions)]
        tokens, logprobs = await self.compute.run(self.rt.gen_sample, job, x, temperature=params["temperature"],
                                                  top_p=params["top_p"], seed=params["seed"], step=state.steps)
        for r in range(state.rows):
            if not state.finished[r]:
                state.tokens[r].append(int(tokens[r]))
                state.logprobs[r].append(float(logprobs[r]))
                state.finished[r] = tokens[r] == params["eos_id"]
        state.steps += 1
        done = bool(state.finished.all()) or state.steps >= params["max_new_tokens"]
        route = h["route"]
        if done:
            del self._gen_last[job]
            await self.compute.run(self.rt.drop, job)
            await self._send_coordinator({"type": "gen_done", "job": job,
                                          "tokens": [t or [params["eos_id"]] for t in state.tokens],
                                          "logprobs": [lp or [0.0] for lp in state.logprobs],
                                          "versions": state.versions})
        if len(route) == 1:
            if not done:
                await self._gen_advance(job, tokens[:, None])
            else:
                self._gen_first.pop(job, None)
            return
        await self._send(route[0], {"type": "tok", "job": job, "tokens": [int(t) for t in tokens], "done": done})

    async def _gen_tokens(self, h: dict) -> None:
        job = h["job"]
        state = self._gen_first[job]
        if h["done"]:
            del self._gen_first[job]
            await self.compute.run(self.rt.drop, job)
            if len(state["route"]) > 2:
                await self._send(state["route"][1], {"type": "drop", "job": job, "route": state["route"], "hop": 1})
            return
        tokens = np.asarray(h["tokens"], dtype=np.int64)
        if tokens.max() >= self.rt.vocab_size:
            raise ProtocolViolation("sampled token id outside the vocabulary")
        await self._gen_advance(job, tokens[:, None])

    async def _gen_drop(self, job: str, route: list[str], hop: int) -> None:
        self._gen_mid_touch.pop(job, None)
        await self.compute.run(self.rt.drop, job)
        if hop + 1 < len(route) - 1:
            await self._send(route[hop + 1], {"type": "drop", "job": job, "route": route, "hop": hop + 1})

    # ------------------------------------------------------------------ training
    async def _train_in(self, m: dict) -> None:
        route, key = m["route"], _train_key(m)
        if not self.spec.is_first or len(route) != self.spec.num_stages or route[0] != self.identity.peer_id:
            raise ProtocolViolation("training input sent to a node that is not its first stage")
        inputs = _rect(m["inputs"], np.int64, "inputs")
        if inputs.max() >= self.rt.vocab_size:
            raise ProtocolViolation("input token id outside the vocabulary")
        prox = bool(m.get("prox"))
        if self.spec.is_last:
            self._slot(key).act = ({"route": route}, inputs)
            await self._train_last_if_ready(key)
            return
        if prox:
            tensor, payload = await self.compute.run(self._forward_encoded, self._forward_only, key, inputs)
        else:
            self._train_keys.add(key)
            tensor, payload = await self.compute.run(self._forward_encoded, self.rt.train_forward, key, inputs)
        await self._send(route[1], {"type": "act", "kind": "prox" if prox else "train", "job": key, "route": route,
                                    "hop": 1,
                                    "versions": [self.rt.version], "tensor": tensor, "step": m["step"],
                                    "mb": m["mb"]}, payload)

    def _forward_only(self, key: str, x: np.ndarray) -> np.ndarray:
        return self.rt.forward_only(x)

    async def _train_mid(self, h: dict, x: np.ndarray) -> None:
        key = _train_key(h)
        if h["kind"] == "prox":
            tensor, payload = await self.compute.run(self._forward_encoded, self._forward_only, key, x)
        else:
            self._train_keys.add(key)
            tensor, payload = await self.compute.run(self._forward_encoded, self.rt.train_forward, key, x)
        hop = h["hop"] + 1
        await self._send(h["route"][hop], {**h, "hop": hop, "tensor": tensor,
                                           "versions": h["versions"] + [self.rt.version]}, payload)

    async def _train_last_if_ready(self, key: str) -> None:
        slot = self._train_slots.get(key)
        if slot is None or slot.act is None or slot.out is None:
            return
        del self._train_slots[key]
        (h, x), out = slot.act, slot.out
        if h["route"] != out["route"]:
            raise ProtocolViolation("activations and targets of a micro-batch name different routes")
        targets = _rect(out["targets"], np.int64, "targets")
        mask = _rect(out["mask"], bool, "mask")
        behaviour = _rect(out["behaviour"], np.float32, "behaviour")
        advantages = np.asarray(out["advantages"], dtype=np.float32)
        rows, width = x.shape[0], x.shape[1]
        if targets.shape != (rows, width) or mask.shape != targets.shape or behaviour.shape != targets.shape \
                or advantages.shape != (rows,):
            raise ProtocolViolation("targets, mask, behaviour or advantages do not fit the activations")
        if targets.max() >= self.rt.vocab_size:
            raise ProtocolViolation("target token id outside the vocabulary")
        temperature = self.run_cfg.sampling.temperature
        if out.get("prox"):
            logp = await self.compute.run(self.rt.prox_logprobs, x, targets, temperature)
            await self._send_coordinator({"type": "prox_done", "step": out["step"], "mb": out["mb"],
                                          "logprobs": np.round(logp, 6).tolist()})
            return
        proximal = None
        if out.get("proximal") is not None:
            proximal = _rect(out["proximal"], np.float32, "proximal")
            if proximal.shape != targets.shape:
                raise ProtocolViolation("proximal log-probs do not fit the targets")
        self._train_keys.add(key)
        grad_in, stats = await self.compute.run(
            self.rt.train_last, key, x, targets, mask, behaviour, advantages, out["normaliser"],
            self.run_cfg.objective, temperature, proximal)
        self._train_keys.discard(key)
        self.counters["microbatches_trained"] += 1
        step, mb = out["step"], out["mb"]
        await self._send_coordinator({"type": "mb_loss", "step": step, "mb": mb, **stats})
        route = out["route"]
        if len(route) == 1:
            await self._send_coordinator({"type": "mb_done", "step": step, "mb": mb})
            return
        tensor, payload = await self.compute.run(self._encode_activation, grad_in)
        hop = len(route) - 2
        await self._send(route[hop], {"type": "grad", "job": key, "route": route, "hop": hop, "tensor": tensor,
                                      "step": step, "mb": mb}, payload)

    async def _train_back(self, h: dict, g: np.ndarray) -> None:
        key = f"{h['step']}:{h['mb']}"
        if key not in self._train_keys:
            raise ProtocolViolation(f"gradient for unknown micro-batch {key}")
        self._train_keys.discard(key)
        grad_in = await self.compute.run(self.rt.train_backward, key, g)
        self.counters["microbatches_trained"] += 1
        if self.spec.is_first:
            await self._send_coordinator({"type": "mb_done", "step": h["step"], "mb": h["mb"]})
            return
        tensor, payload = await self.compute.run(self._encode_activation, grad_in)
        hop = h["hop"] - 1
        await self._send(h["route"][hop], {**h, "hop": hop, "tensor": tensor}, payload)

    async def _abort(self, step: int) -> None:
        prefix = f"{step}:"
        for key in [k for k in self._train_keys if k.startswith(prefix)]:
            self._train_keys.discard(key)
            await self.compute.run(self.rt.release, key)
        for key in [k for k in self._train_slots if k.startswith(prefix)]:
            del self._train_slots[key]
        await self.compute.run(self.rt.zero_grad)
        self._shares.pop(step, None)

    # ------------------------------------------------------------------ optimiser step
    async def _apply_step(self, m: dict) -> None:
        step, version = m["step"], m["version"]
        me = self.identity.peer_id
        others = sorted(p for p in m["replicas"] if p != me)
        grads = await self.compute.run(self.rt.grads)
        dense = dense_nbytes(grads)
        update_bytes = 0
        if others:
            encoded, own = await self.compute.run(self._compressor.compress, grads)
            entries, payload = tensor_bundle.pack(encoded)
            update_bytes = len(payload)
            results = await asyncio.gather(*(self._send(p, {"type": "share", "step": step, "tensors": entries},
                                                        payload) for p in others), return_exceptions=True)
            for peer, result in zip(others, results):
                if isinstance(result, Exception):
                    log.warning("could not send our gradient to replica %s: %s", peer, result)
            received = await self._await_shares(step, others)
            shapes = {name: g.shape for name, g in grads.items()}
            contributions = {me: own}
            for peer, (peer_entries, peer_payload) in received.items():
                try:
                    contributions[peer] = tensor_bundle.unpack(peer_entries, peer_payload, shapes, require_all=True)
                except ProtocolViolation as exc:
                    log.warning("replica %s sent an unusable gradient (%s); stepping without it", peer, exc)
            agg = await self.compute.run(aggregate, contributions)
        else:
            agg = grads
        norm = await self.compute.run(self.rt.apply, agg, self.run_cfg.max_grad_norm, version)
        checksum = await self.compute.run(self.rt.checksum)
        self._shares = {s: v for s, v in self._shares.items() if s > step}
        for key in [k for k in self._train_keys if int(k.split(":")[0]) <= step]:
            self._train_keys.discard(key)
            await self.compute.run(self.rt.release, key)
        path = None
        if m["checkpoint"]:
            path = str(self._stage_checkpoint_path())
            await self.compute.run(self.rt.save_stage, path, version)
        await self._send_coordinator({"type": "stepped", "step": step, "version": version, "grad_norm": norm,
                                      "checksum": checksum, "update_bytes": update_bytes, "dense_bytes": dense,
                                      "checkpoint_path": path})
        self._spawn(self._stream_after_step(m), f"polis-wstream-{version}")
        self._emit_status()

    async def _await_shares(self, step: int, others: list[str]) -> dict[str, tuple[list, bytes]]:
        deadline = time.monotonic() + self.config.share_timeout_s
        while True:
            got = self._shares.get(step, {})
            missing = [p for p in others if p not in got]
            alive = [p for p in missing if p in self._stage_members()]
            if not alive or time.monotonic() >= deadline:
                if missing:
                    log.warning("step %d: no gradient from %s; stepping without them", step, missing)
                return {p: got[p] for p in others if p in got}
            self._share_event.clear()
            try:
                await asyncio.wait_for(self._share_event.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass

    def _stage_checkpoint_path(self) -> Path:
        if self.config.data_dir:
            root = Path(self.config.data_dir)
        else:
            from engine.paths import user_data_dir

            root = user_data_dir()
        return root / "stages" / (self.run_id or "run") / f"stage{self.spec.stage_index}.safetensors"

    # ------------------------------------------------------------------ weights between replicas
    async def _send_weights(self, peer: str) -> None:
        state, version = await self.compute.run(self.rt.snapshot)
        entries, payload = await self.compute.run(tensor_bundle.pack_arrays, state)
        await self._send(peer, {"type": "weights", "stage": self.spec.stage_index, "version": version,
                                "config": self.rt.model_config.to_hf_dict(), "tensors": entries}, payload)

    async def _resync(self, source: str) -> None:
        waiter = self._expect_weights(source)
        await self._send(source, {"type": "weights_req", "stage": self.spec.stage_index})
        header, payload, _ = await asyncio.wait_for(waiter, 60.0)
        weights = tensor_bundle.unpack(header["tensors"], payload, await self.compute.run(self.rt.shapes),
                                       require_all=True)
        await self.compute.run(self.rt.set_weights, weights, header["version"])
        self._compressor.reset()
        log.info("resynchronised stage %d from %s at version %d", self.spec.stage_index, source, header["version"])

    async def _reassign(self, m: dict) -> None:
        self._abandon_jobs()
        await self._apply_welcome(m)
        await self._send_coordinator({"type": "ready", "stage": self.spec.stage_index, "version": self.rt.version})
        self._set_state("contributing", f"serving {self.spec.describe(self.num_layers)}")
        self._emit_status()

    # ------------------------------------------------------------------ housekeeping
    def _abandon_jobs(self) -> None:
        """Forget every job in flight (coordinator lost, or reassigned); free their memory."""
        if self.rt is None or self.rt.backend is None:
            return
        jobs = set(self._gen_first) | set(self._gen_last) | set(self._gen_mid_touch)
        keys = set(self._train_keys)
        self._gen_first.clear()
        self._gen_last.clear()
        self._gen_mid_touch.clear()
        self._train_keys.clear()
        self._train_slots.clear()
        self._shares.clear()
        for job in jobs:
            self.compute.submit(self.rt.drop, job)
        for key in keys:
            self.compute.submit(self.rt.release, key)
        if keys and self.rt.backend is not None:
            self.compute.submit(self.rt.zero_grad)

    def _expire_jobs(self) -> None:
        cutoff = time.monotonic() - JOB_TTL_S
        stale = [j for j, s in self._gen_first.items() if s["touched"] < cutoff]
        stale += [j for j, t in self._gen_mid_touch.items() if t < cutoff]
        for job in stale:
            self._gen_first.pop(job, None)
            self._gen_mid_touch.pop(job, None)
            self.compute.submit(self.rt.drop, job)
        for key in [k for k, s in self._train_slots.items() if s.created < cutoff]:
            del self._train_slots[key]

    async def _report_loop(self) -> None:
        busy_before, wall_before = self.compute.busy_seconds, time.monotonic()
        ticks = 0
        while True:
            await asyncio.sleep(self.config.report_every_s)
            busy_now, wall_now = self.compute.busy_seconds, time.monotonic()
            busy_fraction = (busy_now - busy_before) / max(wall_now - wall_before, 1e-6)
            busy_before, wall_before = busy_now, wall_now
            log.debug("compute busy %.0f%% of the last %.1f s", 100 * busy_fraction, self.config.report_every_s)
            sent, received = self.bytes_moved()
            now = {**self.counters, "bytes_sent": sent, "bytes_received": received,
                   "uptime_s": time.monotonic() - self._started}
            delta = {k: max(0.0, now[k] - self._reported[k]) for k in self._reported}
            self._reported = now
            await self._send_coordinator({"type": "report", **delta})
            self.emit("stats", tokens_generated=int(now["tokens_generated"]),
                      microbatches_trained=int(now["microbatches_trained"]), bytes_sent=int(sent),
                      bytes_received=int(received), uptime_s=round(now["uptime_s"], 1),
                      points=round(now["tokens_generated"] / 100 + now["microbatches_trained"], 1),
                      policy_version=self.rt.version, staleness_mean=None,
                      tokens_per_s=round(delta["tokens_generated"] / self.config.report_every_s, 1),
                      compute_busy_fraction=round(busy_fraction, 3))
            self._expire_jobs()
            ticks += 1
            if ticks % 3 == 1:
                await self._emit_swarm()

    async def _emit_swarm(self) -> None:
        """Swarm-wide figures for the supervisor, from the coordinator's stats API."""
        import aiohttp

        url = self.config.coordinator_url.rstrip("/") + "/api/stats"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
                async with http.get(url) as response:
                    stats = await response.json()
            me = self.identity.peer_id
            self.emit("swarm", policy_version=int(stats["version"]),
                      eval=[{"version": int(e["version"]), "accuracy": float(e["accuracy"])}
                            for e in stats["evals"][-200:]],
                      reward=[{"version": int(v["version"]), "reward": float(v["reward"] or 0.0)}
                              for v in stats["versions"][-500:]],
                      stages=[{"stage": int(s["stage"]), "layers": str(s["layers"]),
                               "replicas": len(s["replicas"]) + len(s.get("inference", ())),
                               "mine": me in s["replicas"] or me in s.get("inference", ())}
                              for s in stats["stages"]])
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as exc:
            log.debug("no swarm stats this time: %s", exc)

    def _emit_status(self, force: bool = False) -> None:
        if self.spec is None:
            if force:
                self.emit("status", state=self.state, coordinator=self.config.coordinator_url, stage=None,
                          num_stages=None, layers=None, role=self.role, peers=0, policy_version=None,
                          limits=self.limits)
            return
        self.emit("status", state=self.state, coordinator=self.config.coordinator_url,
                  stage=self.spec.stage_index, num_stages=self.spec.num_stages,
                  layers=self.spec.describe(self.num_layers), role=self.role,
                  peers=len(self._pm.links) if self._pm else 0, policy_version=self.rt.version,
                  limits=self.limits)
