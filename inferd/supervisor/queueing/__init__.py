"""Waiting and batching: the bounded request queue (queue), which requests make a batch and when (batcher),
and how requests of different sizes are padded into one (padding)."""
