"""A Python model's process (a step): its entry (`python -m inferd.step`, main), its model code (runner) and its
executor. Nothing here imports torch: a step may run under an interpreter of the operator's that has none, with
only what the `inferd[step]` extra names (numpy, ml-dtypes, pyzmq, msgspec, setproctitle)."""
