"""The supervisor's child processes: the worker table (workers), starting, backing off, giving up and stopping
any child (children), the gateways (gateway_processes), the reaper of a killed supervisor, and what the
supervisor reads of the machine (probes, devices, nvml)."""
