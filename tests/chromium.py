"""Where a headless Chromium for the console tests is: `DSASERVE_CHROMIUM`, Debian's `chromium`
(or `chromium-browser`, `google-chrome`) on PATH, else the browser `playwright install chromium`
put in Playwright's own cache. `python tests/chromium.py` prints it (exit 1 when there is none).
"""

from __future__ import annotations

import os
import shutil
import sys

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    given = os.environ.get("DSASERVE_CHROMIUM")
    if given:
        return given
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    return _playwright_chromium()


def _playwright_chromium() -> str | None:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    with sync_playwright() as driver:
        path = driver.chromium.executable_path  # where Playwright's own build is, if installed
    return path if path and os.path.exists(path) else None


if __name__ == "__main__":
    path = find_chromium()
    print(path or "no Chromium found")
    sys.exit(0 if path else 1)
