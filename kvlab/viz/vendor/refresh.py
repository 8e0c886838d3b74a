"""Refresh the vendored browser code from the npm registry (a maintainer's tool; nothing runs it at view time).

    python kvlab/viz/vendor/refresh.py

For each package pinned in ``package.json`` it runs ``npm pack NAME@VERSION`` (npm checks the tarball against
the registry's integrity hash), copies the files listed in ``FILES`` here, and rewrites ``manifest.json`` with
the tarball's integrity and each copied file's sha256. ``kvlab.viz.assets.vendored_files`` refuses a copy whose
hash differs from the manifest, and a test checks the same, so an edited or truncated file cannot ship.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# package -> (file inside its tarball, name here). html-manager's embed-amd.js is its whole runtime (base and
# controls widgets, jQuery, the renderer that finds widget views in a page); anywidget's dist/index.js is its
# AMD front end (AnyModel/AnyView, which import a view's ES module from its source).
FILES: dict[str, list[tuple[str, str]]] = {
    "@jupyter-widgets/html-manager": [("package/dist/embed-amd.js", "embed-amd.js"),
                                      ("package/dist/embed.js.LICENSE.txt", "embed-amd.bundled-licenses.txt")],
    "anywidget": [("package/dist/index.js", "anywidget.js"), ("package/LICENSE", "LICENSE-anywidget.txt")],
    "requirejs": [("package/require.js", "require.js")],
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def refresh() -> dict[str, dict[str, object]]:
    pins: dict[str, str] = json.loads((HERE / "package.json").read_text())["dependencies"]
    manifest: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, version in pins.items():
            out = subprocess.run(["npm", "pack", f"{name}@{version}", "--json", "--pack-destination", tmp],
                                 check=True, capture_output=True, text=True).stdout
            info = json.loads(out)[0]
            if info["version"] != version:
                raise SystemExit(f"npm gave {name} {info['version']}, not the pinned {version}")
            with tarfile.open(Path(tmp) / info["filename"]) as tar:
                for member, dest in FILES[name]:
                    data = tar.extractfile(member)
                    if data is None:
                        raise SystemExit(f"{member} is not a file in {info['filename']}")
                    (HERE / dest).write_bytes(data.read())
            manifest[name] = {"version": version, "integrity": info["integrity"],
                              "files": {dest: sha256(HERE / dest) for _, dest in FILES[name]}}
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


if __name__ == "__main__":
    for name, entry in refresh().items():
        print(name, entry["version"], ", ".join(entry["files"]))  # type: ignore[arg-type]
