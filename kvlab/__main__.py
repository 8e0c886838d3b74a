"""``python -m kvlab`` and the ``kvlab`` script: the command line of :mod:`kvlab.app.cli`."""
import sys


def run() -> None:
    """Import the command line and run it; Ctrl-C while it imports is one line and exit 130, as ``main`` answers
    once it runs (the script points here, not at ``main``, so that the import is inside the guard too)."""
    try:
        from kvlab.app.cli import main

        code = main()
    except KeyboardInterrupt:
        print("kvlab: interrupted", file=sys.stderr)
        code = 130
    raise SystemExit(code)


if __name__ == "__main__":
    run()
