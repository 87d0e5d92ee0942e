"""Peer-to-peer networking: the only package that imports aiortc and zeroconf.

identity (Ed25519 keys in the OS keyring), signalling (signed SDP relay),
peer_link / peer_manager (framed WebRTC data channels), tensor_codec and friends
(wire format and compression), wire (typed message structs and their decoders),
discovery (zeroconf), wan_emulator (user-space UDP impairment), measure and
echo_peer (the transport bench). Nothing here knows about RL or stages.
"""
