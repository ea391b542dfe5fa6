"""inferd-fleet: a Kubernetes controller for a fleet of inferd pods (docs/scaling/kubernetes.md)."""
