"""The swarm: a coordinator and nodes that run pipeline RL over WebRTC."""
