"""The daemon's states, in the order it goes through them."""

STARTING = "starting"  # workers loading and warming; requests are answered `unavailable`
SERVING = "serving"
DRAINING = "draining"  # SIGTERM: queued work finishes, new requests are refused
STOPPING = "stopping"  # workers are told to exit
