"""The `inferd` and `inferctl` commands.

Every error is printed as one plain sentence, with no traceback, and a
non-zero exit status.
"""
