"""Build hook: compile kvlab's two C extensions.

* ``kvlab/fast/_fastpath.c``: the C base type that runs FastBlockPool's allocate and free;
* ``kvlab/fast/_paged_attention.c``: the CPU decode kernel of ``paged_attention`` (reads K/V blocks in place, on
  pthreads; ``-O3`` so its loops vectorise; the vector width is picked at run time, never ``-march=native``).

Runs for wheels and editable installs (``pip install -e .``, which ``make install`` uses). Each extension is
optional: with no C compiler or Python headers the build goes on with a warning and kvlab runs its Python/torch
paths (slower, same results). Each source's SHA-256 is compiled in, so kvlab can refuse a binary built from an
older source.

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


# (module, the hook's own flags, what runs instead when it does not build)
EXTENSIONS = (
    ("_fastpath", ["-O2"], "FastBlockPool stays in Python"),
    ("_paged_attention", ["-O3", "-pthread"], "paged_attention gathers blocks for SDPA"),
)


class FastPathHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        ldshared = sysconfig.get_config_var("LDSHARED")  # compiler + shared-library flags CPython was built with
        if not ldshared:
            self.app.display_warning("kvlab: no C build configuration here; "
                                     + "; ".join(fallback for _, _, fallback in EXTENSIONS))
            return
        link = shlex.split(ldshared)
        if os.environ.get("CC", "").strip():
            link = [*shlex.split(os.environ["CC"]), *link[1:]]
        for name, flags, fallback in EXTENSIONS:
            out = self._compile(link, name, flags, fallback)
            if out is None:
                continue
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            if version != "editable":  # an editable install imports it from the source tree, where it was built
                build_data["force_include"][str(out)] = f"kvlab/fast/{out.name}"

    def _compile(self, link: list[str], name: str, flags: list[str], fallback: str) -> Path | None:
        """Build ``kvlab/fast/<name>.c`` beside its source; the binary's path, or None (with a warning) if it fails."""
        src = Path(self.root, "kvlab", "fast", f"{name}.c")
        out = src.with_name(name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
        sha = hashlib.sha256(src.read_bytes()).hexdigest()
        cmd = [*link, *flags, "-DNDEBUG", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
               f'-DKVLAB_SOURCE_SHA256="{sha}"', *shlex.split(os.environ.get("CFLAGS", "")), str(src), "-o", str(out)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            self.app.display_warning(f"kvlab: could not compile {src.name}; {fallback}.\n{detail.strip()[-2000:]}")
            return None
        return out
