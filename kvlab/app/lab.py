"""``kvlab lab`` (and ``make lab``): JupyterLab on the course, wherever a student starts it.

JupyterLab refuses to run as root without ``--allow-root`` (containers and cloud machines run as root), tries to
open a browser that a headless machine does not have, and, given a notebook to open, serves only that
notebook's folder. :func:`lab_argv` builds a command line that serves a whole folder (a checkout's root, so the
README and docs are in the file browser too), opens its chapter index, adds ``--allow-root`` only for root and
``--no-browser`` only where no display is found; :func:`launch` prints the URL to open, token included, and
runs it.
"""
from __future__ import annotations

import errno
import importlib.util
import os
import secrets
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from kvlab.core.errors import ConfigError, KVLabError

# Where the chapter index lies in a folder: a checkout (chapters/) or one made by `kvlab chapters DEST`.
INDEX_PATHS = ("chapters/index.ipynb", "index.ipynb")
DEFAULT_PORT = 8888


def find_index(root: Path) -> str:
    """The chapter index under ``root`` as a path relative to it (``/``-separated), or a ConfigError saying
    how to get the chapters."""
    for rel in INDEX_PATHS:
        if (root / rel).is_file():
            return rel
    raise ConfigError(f"no chapters in {str(root)!r} (looked for {' and '.join(INDEX_PATHS)}): "
                      f"run `kvlab chapters {root}` first, or give the folder that holds them")


def headless(env: Mapping[str, str] | None = None, platform: str | None = None) -> bool:
    """True where no browser can be shown: Linux and the BSDs with neither ``DISPLAY`` nor ``WAYLAND_DISPLAY``
    (an ssh session, a container, CI). macOS and Windows always have one; ``BROWSER`` names one anywhere."""
    env = os.environ if env is None else env
    platform = sys.platform if platform is None else platform
    if env.get("BROWSER") or platform in ("darwin", "win32", "cygwin"):
        return False
    return not (env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"))


def is_root() -> bool:
    """Running as root (uid 0), where JupyterLab needs ``--allow-root``; never on Windows."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def free_port(ip: str, wanted: int = DEFAULT_PORT) -> int:
    """``wanted`` if nothing listens on it at ``ip``, else a port the system has free."""
    for port in (wanted, 0):
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            try:
                s.bind((ip, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    continue
                raise ConfigError(f"cannot listen on {ip!r}: {e.strerror or e}") from None
            return int(s.getsockname()[1])
    raise ConfigError(f"no free port to listen on at {ip!r}")


def lab_url(ip: str, port: int, index: str, token: str) -> str:
    """The address that opens ``index`` in JupyterLab (a wildcard ``ip`` is shown as this machine's name)."""
    host = socket.gethostname() if ip in ("0.0.0.0", "::", "") else ip
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/lab/tree/{index}?token={token}"


def lab_argv(root: Path, index: str, *, port: int, token: str, ip: str = "127.0.0.1", as_root: bool = False,
             no_browser: bool = False) -> list[str]:
    """The command that serves ``root`` and opens ``index`` (relative to it) in JupyterLab."""
    argv = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}", f"--ServerApp.ip={ip}",
            f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
            f"--LabApp.default_url=/lab/tree/{index}"]
    if as_root:
        argv.append("--allow-root")
    if no_browser:
        argv.append("--no-browser")
    return argv


def launch(folder: str | Path = ".", *, port: int = DEFAULT_PORT, ip: str = "127.0.0.1",
           no_browser: bool | None = None, dry_run: bool = False) -> list[str]:
    """Print the URL to open and replace this process with JupyterLab serving ``folder`` (``no_browser``:
    None decides by :func:`headless`). ``dry_run`` prints the command instead and returns it."""
    root = Path(folder).resolve()
    if not root.is_dir():
        raise ConfigError(f"{str(folder)!r} is not a folder")
    index = find_index(root)
    if importlib.util.find_spec("jupyterlab") is None:  # not the user's input: exit 1, as other failures
        raise KVLabError('JupyterLab is not installed here: pip install "kvlab[lab]" (or open the notebooks in '
                         'VS Code or Colab with "kvlab[widgets]")')
    token = secrets.token_hex(24)
    port = free_port(ip, port)
    argv = lab_argv(root, index, port=port, token=token, ip=ip, as_root=is_root(),
                    no_browser=headless() if no_browser is None else no_browser)
    if dry_run:
        print(" ".join(argv))
        return argv
    print(f"kvlab lab: serving {root}\nkvlab lab: open {lab_url(ip, port, index, token)}", flush=True)
    os.execv(argv[0], argv)
