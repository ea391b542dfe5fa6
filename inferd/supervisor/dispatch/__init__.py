"""Out to the workers and back: a batch stacked into an arena slot and sent (dispatcher), the batch in flight
(batch), what batches took to compute (compute_times), each request's answer and every reply (replies), and
shadow trials' copies (shadow)."""
