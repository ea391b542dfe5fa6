"""`python -m inferd.cli`: the `inferd` command, for a daemon started without its console script."""

from inferd.cli.daemon import main

main()
