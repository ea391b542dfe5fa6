"""What every part of the supervisor shares: the daemon's state, the live versions and the versions under
trial, the clients' shared-memory regions, the stats every part records, how a long command answers, and the
last guard of every socket handler. Nothing here imports another part of the supervisor."""
