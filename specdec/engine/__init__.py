"""Serving engine: paged KV cache, continuous batching, the one decode step, CUDA graphs.

Entry point: :class:`specdec.engine.engine.Engine` (``add_request``, ``step``, ``run_until_done``).
"""
