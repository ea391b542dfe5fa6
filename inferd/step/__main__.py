"""`python -m inferd.step`: how the supervisor starts a Python model's process, its spec on standard input."""

from inferd.step.main import main

main()
