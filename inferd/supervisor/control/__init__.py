"""The control plane and what it reports: the control socket (control_server) and its commands, the
narrow view of the daemon they read (view), stats and status (report), Prometheus (metrics), a SIGHUP's
plan (reconfigure), and the pod annotation that asks for a trim (trim_requests)."""
