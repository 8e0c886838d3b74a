"""Export a recorded run as one standalone HTML file: the view's JS and CSS inlined, the frames embedded as
base64, and a replay model standing in for the kernel. It opens on the run's last frame and plays (play / pause,
step, slider) offline, with no kernel and no network: a lecture demo that survives a dead projector laptop's
kernel, or a run to hand in with an exercise. The page says it has no kernel (``globalThis.kvlabNoKernel``), so
the views leave out the controls only a kernel could answer (the dashboard's step, stop, speed and settings).
"""
from __future__ import annotations

import base64
import html
import json
from collections.abc import Iterable
from pathlib import Path

from kvlab.core.checks import check_path, is_text, show
from kvlab.core.errors import ConfigError
from kvlab.viz.assets import FONT_STACK, css_source, render_expr, replay_source, script_source
from kvlab.viz.frames import decode_recording
from kvlab.viz.live import Recording

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ margin: 16px; font-family: {fonts}; }}
{css}
</style>
</head>
<body>
<h3>{title}</h3>
<div id="kvlab-app"></div>
<script id="kvlab-frames" type="application/json">{frames}</script>
<script type="module">
globalThis.kvlabNoKernel = true;  // the views drop the controls only a kernel could answer
{script}
{replay}
const frames = JSON.parse(document.getElementById("kvlab-frames").textContent);
window.kvlabReplay = kvReplay(document.getElementById("kvlab-app"), frames, {render});
</script>
</body>
</html>
"""


def export_html(recording: Recording | Iterable[bytes], path: str | Path, *, view: str = "dashboard",
                title: str = "kvlab replay") -> Path:
    """Write ``recording`` as a standalone HTML replay of ``view`` (``pool``, ``eviction``, ``fragmentation``
    or ``dashboard``) to ``path``; returns the path. Every frame is checked before anything is written."""
    frames = [f.data for f in decode_recording(recording)]
    script = script_source(view)  # an unknown view is refused here, before anything is written
    if not is_text(title):
        raise ConfigError(f"title must be a str, got {show(title)}")
    out = check_path(path, "path")
    payload = json.dumps([base64.b64encode(f).decode("ascii") for f in frames])
    page = _PAGE.format(title=html.escape(title), fonts=FONT_STACK, css=css_source(), frames=payload,
                        script=script, replay=replay_source(), render=render_expr(view))
    try:
        out.write_text(page, encoding="utf-8")
    except (OSError, ValueError) as e:  # a missing folder, a directory, no permission, a NUL in the name
        raise ConfigError(f"cannot write the replay to {str(path)[:200]!r}: {getattr(e, 'strerror', None) or e}") \
            from None
    return out
