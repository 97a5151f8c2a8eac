"""Tensor parallelism across machines: node 0's listener and links, a headless node's agent.

Runs in the engine process on node 0 (`_node_join`, `_remote_nodes`) and in `trillm serve
--headless` on the others (`_node_agent`). Owns the node link's handshake over the node token.
"""
