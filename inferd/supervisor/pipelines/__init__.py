"""Pipelines: a request of a pipeline run as its steps' requests, each queued and batched with its model's."""
