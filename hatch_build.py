"""Build hook: compile kvlab's two C extensions.

* ``kvlab/fast/_fastpath.c``: the C base type that runs FastBlockPool's allocate and free;
* ``kvlab/fast/_paged_attention.c``: the CPU decode kernel of ``paged_attention`` (reads K/V blocks in place, on
  pthreads; ``-O3`` so its loops vectorise; the vector width is picked at run time, never ``-march=native``).

Runs for wheels and editable installs (``pip install -e .``, which ``make install`` uses). Each extension is
optional: with no C compiler or Python headers the build goes on with one warning line that names what to install,
and kvlab runs its Python/torch paths (slower, same results). Each source's SHA-256 is compiled in, so kvlab can
refuse a binary built from an older source.

What the hook did is written to ``kvlab/fast/_build.json`` (into the wheel; beside the sources for an editable
install): :mod:`kvlab.fast.compiled` reads it, so ``kvlab --version`` and the import-time warning say why a part is
not compiled and what fixes it, and stay quiet where that was chosen.

Environment:

* ``KVLAB_NO_EXT=1``: compile nothing; the wheel is pure Python (``py3-none-any``), as the release's pure wheel and
  CI's pure-Python route are built.
* ``KVLAB_REQUIRE_EXT=1``: an extension that applies to this platform and does not compile fails the build (the
  release's compiled wheels must never ship without their binaries).
* ``CC`` replaces the compiler CPython was built with (the first word of its ``LDSHARED``); ``CFLAGS`` are added
  after the hook's own flags, so they win (``CFLAGS="-O0 -g"`` for a debugger).

Where CPython has no ``LDSHARED`` (Windows), setuptools' ``build_ext`` drives MSVC; ``_paged_attention.c`` needs
POSIX threads and is not built there.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


# (module, the hook's own flags, what runs instead when it does not build)
EXTENSIONS = (
    ("_fastpath", ["-O2"], "FastBlockPool stays in Python"),
    ("_paged_attention", ["-O3", "-pthread"], "paged_attention gathers blocks for SDPA"),
)
RECORD = "kvlab/fast/_build.json"


class CannotCompile(Exception):
    """An extension does not compile here: ``why`` (one line) and ``fix`` (what to install, or None where nothing
    needs doing)."""

    def __init__(self, why: str, fix: str | None) -> None:
        super().__init__(why)
        self.why, self.fix = why, fix


def flag(name: str) -> bool:
    """An environment switch: set to anything but empty or 0."""
    return os.environ.get(name, "").strip() not in ("", "0")


def what_to_install() -> str:
    """What brings a C compiler and CPython's headers on this platform (python.org's, Homebrew's and conda's
    Pythons carry their headers; Debian's and Ubuntu's keep them in python3-dev)."""
    if sys.platform == "darwin":
        return "install Xcode's Command Line Tools (xcode-select --install)"
    if sys.platform == "win32":
        return "install Microsoft C++ Build Tools (MSVC: the 'Desktop development with C++' workload)"
    return ("install a C compiler and Python's headers (Debian/Ubuntu: sudo apt-get install gcc python3-dev; "
            "Fedora: sudo dnf install gcc python3-devel)")


class FastPathHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        editable = version == "editable"
        again = ("then `make install` again (without make: pip install --no-deps -e .)" if editable
                 else "then install kvlab again from source with pip's --force-reinstall --no-deps --no-cache-dir")
        record: dict[str, dict] = {}
        built: list[Path] = []
        for name, flags, _ in EXTENSIONS:
            try:
                built.append(self._compile(name, flags))
                record[name] = {"built": True, "why": None, "fix": None}
            except CannotCompile as e:
                fix = f"{e.fix}; {again}" if e.fix else None
                record[name] = {"built": False, "why": e.why, "fix": fix}
                if fix and flag("KVLAB_REQUIRE_EXT"):
                    raise RuntimeError(f"kvlab: KVLAB_REQUIRE_EXT is set and {name}.c did not compile: {e.why}") \
                        from None
        self._warn_once(record)
        self._write_record(record, editable, build_data)
        if built:
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
        if not editable:  # an editable install imports them from the source tree, where they were built
            for out in built:
                build_data["force_include"][str(out)] = f"kvlab/fast/{out.name}"

    def finalize(self, version: str, build_data: dict, artifact_path: str) -> None:
        if getattr(self, "_tmp", None):
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _warn_once(self, record: dict[str, dict]) -> None:
        """One line for everything that did not compile (the reason is usually the same for both)."""
        missing = {n: r for n, r in record.items() if not r["built"]}
        if not missing:
            return
        by_cause: dict[tuple, list[str]] = {}
        for name, r in missing.items():
            by_cause.setdefault((r["why"], r["fix"]), []).append(f"{name}.c")
        fallbacks = "; ".join(f for n, _, f in EXTENSIONS if n in missing)
        causes = " / ".join(f"{', '.join(names)}: {why}" + (f"; to compile them, {fix}" if fix else "")
                            for (why, fix), names in by_cause.items())
        line = f"kvlab: not compiled: {causes}. Meanwhile {fallbacks} (same results, slower)."
        if any(r["fix"] for r in missing.values()):
            self.app.display_warning(line)
        else:  # chosen (KVLAB_NO_EXT) or not for this platform: nothing to fix
            self.app.display_info(line)

    def _write_record(self, record: dict[str, dict], editable: bool, build_data: dict) -> None:
        text = json.dumps(record, indent=1) + "\n"
        if editable:
            Path(self.root, RECORD).write_text(text, encoding="utf-8")
            return
        self._tmp = tempfile.mkdtemp(prefix="kvlab-build-")
        path = Path(self._tmp, "_build.json")
        path.write_text(text, encoding="utf-8")
        build_data["force_include"][str(path)] = RECORD

    def _compile(self, name: str, flags: list[str]) -> Path:
        """Build ``kvlab/fast/<name>.c`` beside its source; the binary's path, or CannotCompile saying why."""
        if flag("KVLAB_NO_EXT"):
            raise CannotCompile("KVLAB_NO_EXT=1 (a pure-Python build)", None)
        src = Path(self.root, "kvlab", "fast", f"{name}.c")
        sha = hashlib.sha256(src.read_bytes()).hexdigest()
        if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
            raise CannotCompile(f"no Python headers (Python.h) for Python {sysconfig.get_python_version()}",
                                what_to_install())
        ldshared = sysconfig.get_config_var("LDSHARED")  # compiler + shared-library flags CPython was built with
        if not ldshared:
            return self._compile_with_setuptools(name, src, sha)
        link = shlex.split(ldshared)
        if os.environ.get("CC", "").strip():
            link = [*shlex.split(os.environ["CC"]), *link[1:]]
        if shutil.which(link[0]) is None:
            raise CannotCompile(f"no C compiler ({link[0]})", what_to_install())
        out = src.with_name(name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
        cmd = [*link, *flags, "-DNDEBUG", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
               f'-DKVLAB_SOURCE_SHA256="{sha}"', *shlex.split(os.environ.get("CFLAGS", "")), str(src), "-o", str(out)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = (getattr(e, "stderr", None) or str(e)).strip()
            self.app.display_info(f"kvlab: {' '.join(cmd)}\n{detail[-2000:]}")
            raise CannotCompile(f"the compiler failed ({detail.splitlines()[-1][:200] if detail else e})",
                                "see its error with pip install -v; if it persists, report it at "
                                "https://github.com/kvlab-course/kvlab/issues") from None
        return out

    def _compile_with_setuptools(self, name: str, src: Path, sha: str) -> Path:
        """Where CPython has no ``LDSHARED`` (Windows): setuptools finds MSVC and links against CPython."""
        if name == "_paged_attention" and sys.platform == "win32":
            raise CannotCompile("needs POSIX threads, which Windows' C runtime lacks", None)
        try:
            from setuptools import Distribution, Extension
            from setuptools.command.build_ext import build_ext
        except ImportError:
            raise CannotCompile("setuptools is missing (it finds the C compiler here)", "pip install setuptools") \
                from None
        with tempfile.TemporaryDirectory(prefix="kvlab-ext-") as tmp:
            ext = Extension(f"kvlab.fast.{name}", [str(src)],
                            define_macros=[("NDEBUG", None), ("KVLAB_SOURCE_SHA256", f'"{sha}"')])
            cmd = build_ext(Distribution({"name": "kvlab", "ext_modules": [ext]}))
            cmd.build_lib, cmd.build_temp = tmp, str(Path(tmp, "obj"))
            try:
                cmd.ensure_finalized()
                cmd.run()
            except Exception as e:  # distutils' errors: no MSVC (DistutilsPlatformError), CompileError, LinkError
                missing = "Microsoft Visual C++" in str(e) or type(e).__name__ == "DistutilsPlatformError"
                raise CannotCompile(f"no C compiler ({str(e).splitlines()[0][:200]})" if missing
                                    else f"the compiler failed ({str(e)[:200]})",
                                    what_to_install() if missing
                                    else "see its error with pip install -v") from None
            built = Path(cmd.get_ext_fullpath(ext.name))
            out = src.with_name(built.name)
            shutil.copyfile(built, out)
        return out
