"""`python -m inferd.config`: print the config reference; `--update README.md` rewrites it there (`make docs`)."""

import sys
from pathlib import Path

from inferd.config.docs import reference_markdown, update_readme

if sys.argv[1:2] == ["--update"]:
    update_readme(Path(sys.argv[2]))
else:
    print(reference_markdown())
