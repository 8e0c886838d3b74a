"""Build hook: compile ``kvlab/_fastpath.c``, the C base type that runs FastBlockPool's allocate and free.

Runs for wheels and editable installs (``pip install -e .``, which ``make install`` uses). The extension is
optional: with no C compiler or Python headers the build goes on with a warning and FastBlockPool runs its
Python paths (slower, identical results). The source's SHA-256 is compiled in, so ``kvlab.perf`` can refuse a
binary built from an older ``_fastpath.c``.

``CC`` replaces the compiler CPython was built with (the first word of its ``LDSHARED``); ``CFLAGS`` are added
after the hook's own flags, so they win (``CFLAGS="-O0 -g"`` for a debugger).
"""
from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sysconfig
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class FastPathHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        src = Path(self.root, "kvlab", "_fastpath.c")
        out = src.with_name("_fastpath" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
        ldshared = sysconfig.get_config_var("LDSHARED")  # compiler + shared-library flags CPython was built with
        if not ldshared:
            self.app.display_warning("kvlab: no C build configuration here; FastBlockPool stays in Python")
            return
        link = shlex.split(ldshared)
        if os.environ.get("CC", "").strip():
            link = [*shlex.split(os.environ["CC"]), *link[1:]]
        sha = hashlib.sha256(src.read_bytes()).hexdigest()
        cmd = [*link, "-O2", "-DNDEBUG", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
               f'-DKVLAB_SOURCE_SHA256="{sha}"', *shlex.split(os.environ.get("CFLAGS", "")), str(src), "-o", str(out)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            self.app.display_warning(f"kvlab: could not compile {src.name}; FastBlockPool stays in Python.\n"
                                     f"{detail.strip()[-2000:]}")
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":  # an editable install imports it from the source tree, where it was built
            build_data["force_include"][str(out)] = f"kvlab/{out.name}"
