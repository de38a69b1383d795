"""`python -m minedraft.profile`: `minedraft profile` on a machine with torch and the repository's files only."""

import sys

from minedraft.profile.cli import main

sys.exit(main())
