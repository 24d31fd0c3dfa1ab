"""A page screenshotted by Debian's headless Chromium (``apt-get install chromium``; scripts/system-packages.sh),
with nothing fetched from outside: no sync, no component updates, no background networking, a fresh profile."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

BINARY = shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(url: str, png: str, width: int, height: int, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Render `url` (http:// or file://) at width x height into `png`; raises when Chromium fails or writes no
    picture."""
    if BINARY is None:
        raise FileNotFoundError("no chromium here: apt-get install chromium (scripts/system-packages.sh)")
    with tempfile.TemporaryDirectory(prefix="yeto-chromium-") as profile:
        r = subprocess.run([BINARY, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                            "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                            f"--user-data-dir={profile}", f"--window-size={width},{height}",
                            f"--screenshot={os.path.abspath(png)}", url],
                           timeout=timeout, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(png) or os.path.getsize(png) == 0:
        raise RuntimeError(f"chromium failed ({r.returncode}): {r.stderr[-2000:]}")
    return r


def dump_dom(url: str, timeout: float = 120.0) -> str:
    """The DOM Chromium built from `url`, serialized (``--dump-dom``)."""
    if BINARY is None:
        raise FileNotFoundError("no chromium here: apt-get install chromium (scripts/system-packages.sh)")
    with tempfile.TemporaryDirectory(prefix="yeto-chromium-") as profile:
        r = subprocess.run([BINARY, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                            "--disable-component-update", "--disable-sync", "--no-first-run",
                            f"--user-data-dir={profile}", "--dump-dom", url],
                           timeout=timeout, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"chromium failed ({r.returncode}): {r.stderr[-2000:]}")
    return r.stdout
