"""kvlab as a course hands it out: the wheel's metadata and contents, and an install of that wheel into a fresh
virtual environment outside the checkout, where a student copies the chapters and runs the benchmarks; the
pure-Python wheel (``KVLAB_NO_EXT=1``) and a build without a compiler or without Python's headers, each said once at
install and at import, naming what to install. Also the one version source, the sdist, environment.yml and the
README's links (they must resolve on a package index page)."""
from __future__ import annotations

import email
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import kvlab
from _util import REPO, copy_project
from kvlab.fast.compiled import build_record, compiled_report, extension

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test extra brings tomli on 3.10
    import tomli as tomllib

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
REPO_URL = PYPROJECT["project"]["urls"]["Source"]


def metadata(wheel: zipfile.ZipFile) -> email.message.Message:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    return email.message_from_bytes(wheel.read(name))


def test_the_version_is_written_once():
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["hatch"]["version"]["path"] == "kvlab/__init__.py"
    assert re.fullmatch(r"\d+\.\d+\.\d+", kvlab.__version__)
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert f"## [{kvlab.__version__}]" in changelog  # the release being built has its entry


def test_the_wheel_says_what_it_is(wheel):
    meta = metadata(wheel)
    assert meta["Version"] == kvlab.__version__
    assert meta["License-Expression"] == PYPROJECT["project"]["license"]
    assert meta["Metadata-Version"] >= "2.4"  # PEP 639
    names = set(wheel.namelist())
    licences = meta.get_all("License-File")
    assert "LICENSE" in licences and len(licences) == 3, licences  # kvlab's and the two traces' licences
    assert all(any(n.endswith(f".dist-info/licenses/{f}") for n in names) for f in licences)
    assert "Typing :: Typed" in meta.get_all("Classifier") and "kvlab/py.typed" in names
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Source", "Issues", "Changelog", "Documentation"} <= set(urls)
    assert all(u.startswith(REPO_URL) for u in urls.values()), urls  # one repository, named consistently
    extras = set(meta.get_all("Provides-Extra"))
    assert extras == {"widgets", "llm", "lab", "events", "test", "dev"}
    by_extra: dict[str | None, set[str]] = {}
    for r in meta.get_all("Requires-Dist"):
        extra = re.search(r"extra == ['\"]([\w-]+)['\"]", r)
        by_extra.setdefault(extra and extra[1], set()).add(re.match(r"[\w.-]+", r)[0].lower())
    assert by_extra[None] == {"torch", "numpy", "matplotlib", "tqdm"}  # no Jupyter for `import kvlab`
    assert by_extra["widgets"] == {"anywidget", "ipywidgets"}  # enough for VS Code and Colab: no JupyterLab
    assert by_extra["lab"] == by_extra["widgets"] | {"jupyterlab", "ipykernel"}
    assert by_extra["lab"] < by_extra["test"] < by_extra["dev"]
    assert {"pytest", "playwright", "build", "nbstripout"} <= by_extra["test"] and {"ruff", "mypy"} <= by_extra["dev"]


def test_the_wheel_carries_the_course(wheel):
    names = set(wheel.namelist())
    for folder, pattern in (("chapters", "**/*.ipynb"), ("benchmarks", "bench_*.py")):
        shipped = {f"kvlab/{folder}/{p.relative_to(REPO / folder).as_posix()}" for p in (REPO / folder).glob(pattern)}
        assert shipped and shipped <= names, sorted(shipped - names)
        for n in shipped:
            assert wheel.read(n) == (REPO / n.removeprefix("kvlab/")).read_bytes()


def test_the_sdist_carries_what_a_rebuild_needs(tmp_path):
    src = copy_project(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                    str(src)], check=True, capture_output=True)
    (sdist,) = (tmp_path / "dist").glob("kvlab-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for need in ("LICENSE", "CHANGELOG.md", "README.md", "hatch_build.py", "kvlab/fast/_fastpath.c", "kvlab/py.typed",
                 "chapters/index.ipynb", "benchmarks/bench_pool.py", "widgets/common.js", "environment.yml"):
        assert need in names, need


def install_in_venv(wheel: str | Path, venv: Path) -> Path:
    """``wheel`` installed into a fresh venv (``--no-deps``; torch and the rest come from this venv's
    site-packages through a path file, whose own .pth files, this checkout's editable kvlab among them, are not
    read). Returns the venv's python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    vpy = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "kvlab_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True)
    return vpy


@pytest.fixture(scope="module")
def student(wheel, tmp_path_factory):
    """The wheel installed into a fresh venv outside the checkout (:func:`install_in_venv`). Returns
    ``run(*args)`` for the venv's ``kvlab`` in an empty folder, and the venv."""
    home = tmp_path_factory.mktemp("student")
    venv = home / "venv"
    install_in_venv(wheel.filename, venv)
    cwd = home / "work"
    cwd.mkdir()
    env = {**os.environ, "KVLAB_DEVICE": "cpu"}
    env.pop("KVLAB_BENCHMARKS", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "kvlab"), *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=300)
    return run, venv, cwd


def test_an_installed_wheel_is_kvlab_from_the_wheel(student):
    run, venv, cwd = student
    code = "import kvlab, kvlab.app.resources as r; print(kvlab.__file__); print(r.shipped('chapters'))"
    where, chapters = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=cwd, capture_output=True,
                                     text=True, check=True).stdout.split()
    assert Path(where).is_relative_to(venv), where
    assert Path(chapters).is_relative_to(venv)  # what `kvlab html` and `kvlab chapters` read by default
    p = run("--version")
    assert p.returncode == 0 and p.stdout.startswith(f"kvlab {kvlab.__version__};"), p
    assert "FastBlockPool: compiled" in p.stdout  # the wheel's own binary


def test_a_student_copies_the_chapters_from_the_wheel(student):
    run, _, cwd = student
    p = run("chapters", "course")
    assert p.returncode == 0, p.stderr
    got = sorted(q.relative_to(cwd / "course").as_posix() for q in (cwd / "course").rglob("*.ipynb"))
    want = sorted(q.relative_to(REPO / "chapters").as_posix() for q in (REPO / "chapters").rglob("*.ipynb"))
    assert got == want and "index.ipynb" in got
    assert all((cwd / "course" / n).read_bytes() == (REPO / "chapters" / n).read_bytes() for n in got)
    p = run("lab", "course", "--dry-run", "--no-browser")
    assert p.returncode == 0 and f"--ServerApp.root_dir={cwd / 'course'}" in p.stdout, p


def test_an_installed_wheel_runs_its_benchmarks_and_writes_nothing_unasked(student):
    run, venv, cwd = student
    before = sorted(cwd.iterdir())
    p = run("bench", "--list")
    assert p.returncode == 0, p.stderr
    folder, *names = p.stdout.splitlines()
    assert Path(folder.removeprefix("# in ")).is_relative_to(venv)
    assert names == sorted(q.stem for q in (REPO / "benchmarks").glob("bench_*.py"))
    p = run("bench", "bench_sizing", "--quick", "--json")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    assert result["quick"] and {r["benchmark"] for r in result["rows"]} == {"bench_sizing"}
    assert sorted(cwd.iterdir()) == before  # no bench-results/ folder: --out was not given


# ---------------------------------------------------------------------------------------------------- C parts
def test_the_wheel_records_what_it_compiled(wheel):
    """The build hook's record (kvlab/fast/_build.json) rides in the wheel and says what its binaries are: each
    part it says was built has its binary in the wheel, and a wheel with none is pure (py3-none-any)."""
    names = set(wheel.namelist())
    record = json.loads(wheel.read("kvlab/fast/_build.json"))
    assert set(record) == {"_fastpath", "_paged_attention"}
    for name, r in record.items():
        has_binary = any(n.startswith(f"kvlab/fast/{name}.") and n.endswith((".so", ".pyd")) for n in names)
        assert has_binary == r["built"], (name, r)
        assert r["built"] or r["why"], r
    tag = next(line for line in wheel.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
               .splitlines() if line.startswith("Tag:"))
    assert tag.endswith("py3-none-any") == (not any(r["built"] for r in record.values())), tag


def test_the_build_record_matches_what_loads():
    """The kvlab these tests import: each part the install says it compiled loads (and matches its source), each
    part it left out runs its Python twin for the recorded reason. Without a record, kvlab is a source tree that
    was never built by the hook (an installed wheel always has one)."""
    record = build_record()
    if not record:
        assert (Path(kvlab.__file__).parent.parent / "hatch_build.py").exists(), kvlab.__file__
        return
    for name, r in record.items():
        ext = extension(name)
        if os.environ.get("KVLAB_PURE_PYTHON"):
            assert ext.module is None
        elif r["built"]:
            assert ext.module is not None, (name, ext.why)
        else:
            assert ext.module is None and r["why"] in (ext.why or ""), (name, ext)
            assert r["why"] in compiled_report()


def build_from_copy(tmp_path: Path, **env: str) -> tuple[Path, str]:
    """A wheel built from a copy of the checkout with ``env`` added; its path and what the build printed."""
    src = copy_project(tmp_path / "src")
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(src)]
    built = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    assert built.returncode == 0, (built.stdout + built.stderr)[-4000:]
    (path,) = (tmp_path / "dist").glob("kvlab-*.whl")
    return path, built.stdout + built.stderr


# What a student is told to install where no C compiler or no Python headers were found, by platform
TO_INSTALL = {"linux": "python3-dev", "darwin": "xcode-select --install", "win32": "MSVC"}.get(sys.platform, "")
# Imports every module that loads a C part, with every warning shown, then prints the --version report
IMPORT_ALL = ("import warnings; warnings.simplefilter('always'); import kvlab.fast.pool, kvlab.fast.attention; "
              "from kvlab.fast.compiled import compiled_report; print(compiled_report())")


def test_the_pure_wheel_runs_its_python_paths_and_says_why_quietly(tmp_path):
    """``KVLAB_NO_EXT=1``: a py3-none-any wheel (what the release ships beside the compiled ones) that carries no
    binary, runs the Python twins, warns nothing at import and says why in ``kvlab --version``'s report."""
    path, _ = build_from_copy(tmp_path, KVLAB_NO_EXT="1")
    assert path.name.endswith("-py3-none-any.whl"), path.name
    with zipfile.ZipFile(path) as w:
        assert not [n for n in w.namelist() if n.endswith((".so", ".pyd"))]
    vpy = install_in_venv(path, tmp_path / "venv")
    code = IMPORT_ALL + "; import kvlab; p = kvlab.FastBlockPool(8, with_storage=False); print(p.allocate(3))"
    out = subprocess.run([str(vpy), "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stderr == "", out.stderr
    report, ids = out.stdout.splitlines()
    assert "FastBlockPool: pure Python" in report and "CPU paged decode: gather + SDPA" in report, report
    assert "KVLAB_NO_EXT=1" in report and ids == "[0, 1, 2]"


@pytest.mark.parametrize("missing", ["compiler", "headers"])
def test_a_missing_compiler_or_headers_is_said_once_at_install_and_at_import(tmp_path, missing):
    """No C compiler (``CC`` names none), or no Python headers (the build sees an include folder without
    Python.h, as on Debian without python3-dev): the install goes on, prints one warning line naming what to
    install, and the installed kvlab warns once at import and says the same in ``kvlab --version``'s report."""
    env = {"CC": "kvlab-no-such-cc"}
    if missing == "headers":  # the build's Python sees an empty include folder
        fake = tmp_path / "site"
        fake.mkdir()
        (tmp_path / "include").mkdir()
        (fake / "sitecustomize.py").write_text(
            "import sysconfig\n_paths = sysconfig.get_paths\n"
            f"sysconfig.get_paths = lambda *a, **k: {{**_paths(*a, **k), 'include': {str(tmp_path / 'include')!r}}}\n")
        env = {"PYTHONPATH": str(fake)}
    path, printed = build_from_copy(tmp_path, **env)
    said = [line for line in printed.splitlines() if "kvlab: not compiled" in line]
    assert len(said) == 1 and TO_INSTALL in said[0], printed[-3000:]
    assert ("no Python headers" if missing == "headers" else "no C compiler (kvlab-no-such-cc)") in said[0]
    vpy = install_in_venv(path, tmp_path / "venv")
    out = subprocess.run([str(vpy), "-c", IMPORT_ALL], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k not in ("CC", "PYTHONPATH")})
    warned = [line for line in out.stderr.splitlines() if "not compiled at install" in line]
    assert len(warned) == 1 and TO_INSTALL in warned[0], out.stderr
    assert "FastBlockPool: pure Python" in out.stdout and TO_INSTALL in out.stdout, out.stdout


def test_environment_yml_pins_what_the_tests_run_on():
    """environment.yml pins CPython 3.11 and the torch the Makefile installs (its CPU build, through PyTorch's
    index), then installs kvlab itself with extras that exist: dependencies are declared once, in pyproject.toml."""
    import yaml

    env = yaml.safe_load((REPO / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    assert sorted(d for d in env["dependencies"] if isinstance(d, str)) == ["pip", "python=3.11"]
    (pip_list,) = [d["pip"] for d in env["dependencies"] if isinstance(d, dict)]
    (torch_version,) = re.findall(r"^TORCH_VERSION \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
    index, torch, kvlab_itself = pip_list
    assert index == "--extra-index-url https://download.pytorch.org/whl/cpu" and torch == f"torch=={torch_version}"
    assert kvlab_itself.startswith("-e .[")
    named = set(kvlab_itself.split("[", 1)[1].rstrip("]").split(","))
    assert named and named <= set(PYPROJECT["project"]["optional-dependencies"])


# ---------------------------------------------------------------------------------------------------- README
LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def test_readme_links_resolve_on_a_package_index_page():
    """A package index shows the README without the repository around it: every link is absolute, and every
    link into the repository names a file or folder this checkout has."""
    links = LINK.findall((REPO / "README.md").read_text())
    assert links, "the README links its docs"
    for url in links:
        assert url.startswith(("https://", "http://", "#")), url
        for kind in ("blob", "tree"):
            prefix = f"{REPO_URL}/{kind}/main/"
            if url.startswith(prefix):
                assert (REPO / url.removeprefix(prefix).split("#")[0]).exists(), url


# ---------------------------------------------------------------------------------------------------- notebooks
def _clean_filter() -> list[str]:
    """The nbstripout command ``make install`` configures as git's clean filter, run with this Python."""
    (cmd,) = re.findall(r"filter\.nbstripout\.clean \"'\$\(abspath \$\(BIN\)\)/python' (.+?)\"",
                        (REPO / "Makefile").read_text())
    return [sys.executable, *cmd.split()]


def test_notebooks_go_through_the_output_filter():
    attributes = (REPO / ".gitattributes").read_text().split("\n")
    assert "*.ipynb filter=nbstripout diff=ipynb" in attributes


def test_the_committed_notebooks_pass_the_filter_unchanged():
    """Else every checkout with the filter would show them as modified (nbstripout renumbers cell ids unless told
    to keep them). One run over all of them: ``-t`` writes each result to stdout in turn."""
    paths = sorted((REPO / "chapters").rglob("*.ipynb"))
    out = subprocess.run([*_clean_filter(), "-t", *map(str, paths)], capture_output=True, check=True).stdout
    assert out == b"".join(p.read_bytes() for p in paths)


def test_the_filter_strips_what_an_executed_notebook_gains():
    import nbformat

    src = REPO / "chapters" / "index.ipynb"
    nb = nbformat.read(src, as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="a 354 KB figure\n")]
    code.execution_count = 7
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    out = subprocess.run(_clean_filter(), input=nbformat.writes(nb).encode(), capture_output=True,
                         check=True).stdout
    assert out == src.read_bytes()
