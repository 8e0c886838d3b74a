"""``python -m kvlab``: the same command line as ``kvlab``."""
import sys

try:  # around the import too: Ctrl-C in the first instants is one line and 130, as main() answers after them
    from kvlab.app.cli import main

    code = main()
except KeyboardInterrupt:
    print("kvlab: interrupted", file=sys.stderr)
    code = 130
raise SystemExit(code)
