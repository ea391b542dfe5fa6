"""The supervisor: one loop that owns the client sockets, the queue, the batching, the arenas and the child
processes (docs/design.md draws it). A request's way runs through its folders in order, intake → queueing →
dispatch, and back out through dispatch's replies; beside that way, versions runs the versions' lifecycle and
control the control plane; processes are the child processes under all of them, and shared the records and
types every part uses. The loop and its wiring are here: main (the loop, signals, life cycle), parts (the
composition root), wakeup (the self-pipe), worker_messages (the backend socket's messages), liveness (what
stopped making progress is ended)."""
