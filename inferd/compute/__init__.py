"""What both kinds of compute process share, without torch: the process's life and control messages (process),
and the executor thread's loop, with the rule that a bad request fails alone (executor). A worker (inferd.worker)
computes with torch on a device; a step (inferd.step) runs a Python model under an interpreter that may hold no
torch at all."""
