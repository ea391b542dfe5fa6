"""`python -m inferd.config`: print the config reference.

`--update PATH` rewrites the reference between the markers in PATH (`make docs`: docs/reference/config.md);
`--check PATH` exits 1 when the reference there is stale (`make docs-check`).
"""

import sys
from pathlib import Path

from inferd.config.docs import reference_is_current, reference_markdown, update_reference

if sys.argv[1:2] == ["--update"] and len(sys.argv) == 3:
    update_reference(Path(sys.argv[2]))
elif sys.argv[1:2] == ["--check"] and len(sys.argv) == 3:
    if not reference_is_current(Path(sys.argv[2])):
        sys.exit(f"the config reference in {sys.argv[2]} is stale: run make docs")
elif sys.argv[1:]:
    sys.exit("usage: python -m inferd.config [--update PATH | --check PATH]")
else:
    print(reference_markdown())
