"""``python -m kvlab``: the same command line as ``kvlab``."""
from .cli import main

raise SystemExit(main())
