"""`python -m inferd.cli`: the `inferd` command, for a daemon started without its console script."""

from inferd.cli.inferctl import main_inferd

main_inferd()
