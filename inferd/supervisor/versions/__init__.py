"""The versions' lifecycle: blue-green reloads and the one writer of the live versions (reload), canary
and shadow trials (canary), and which worker holds each on-demand model (placement)."""
