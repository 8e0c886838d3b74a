"""``python -m kvlab``: the same command line as ``kvlab``."""
from kvlab.app.cli import main

raise SystemExit(main())
