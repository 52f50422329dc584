"""The scheduler actor and its pure core: continuous batching and the paged KV blocks.

Nothing here imports torch or transformers (a test checks it).
"""
