"""ignis.server: `ignis serve` (the supervisor), its front-end processes, and the OpenAI-compatible app they run.

Owns HTTP only: the GPU process is reached through ignis.client, and the metrics it serves are the engine's own.
"""
