"""Drive Debian's headless Chromium over the DevTools protocol (no Selenium, no Playwright)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import websocket

from relay.core.proctree import descendants, stop_pids
from relay.core.settings import REPO_ROOT
from relay.tools.services import free_port


def ensure_chromium() -> None:
    """Install Debian's chromium when it is missing, as `make test-services` does (CI runs
    as root); elsewhere scripts/system-deps.sh fails with the command to run."""
    if shutil.which("chromium") is None:
        subprocess.run(["bash", str(REPO_ROOT / "scripts" / "system-deps.sh"), "chromium"],
                       check=True, timeout=900)


class Chromium:
    """One headless Chromium with one page, driven through its DevTools websocket."""

    def __init__(self) -> None:
        exe = shutil.which("chromium")
        if exe is None:
            raise RuntimeError("chromium not found: apt-get install -y chromium")
        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="relay-chromium-")
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--remote-debugging-port={self.port}", "--remote-debugging-address=127.0.0.1",
             f"--user-data-dir={self.profile}", "--window-size=1280,2400", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.ws = websocket.create_connection(self._page_ws(), timeout=60)
        self._id = 0
        self.call("Page.enable")
        self.call("Network.enable")

    def _page_ws(self) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list") as r:
                    pages = [t for t in json.load(r) if t["type"] == "page"]
                if pages:
                    return str(pages[0]["webSocketDebuggerUrl"])
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError("chromium did not open its DevTools port")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def resize(self, width: int, height: int) -> None:
        """Make the page's viewport ``width`` x ``height`` (a screenshot's size for a page
        that fits its window, such as Airflow's or MLflow's UI)."""
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def set_cookie(self, url: str, name: str, value: str) -> None:
        """Set a cookie for ``url`` (how Airflow's UI keeps its login)."""
        self.call("Network.setCookie", url=url, name=name, value=value, path="/")

    def clear_cookies(self) -> None:
        """Forget every cookie (log out)."""
        self.call("Network.clearBrowserCookies")

    def open(self, url: str, settle: float = 1.0) -> str:
        """Load ``url``, wait for images to load, and return the page's visible text."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 90
        expr = ("document.readyState === 'complete' && "
                "Array.from(document.images).every(i => i.complete)")
        while time.monotonic() < deadline:
            done = self.call("Runtime.evaluate", expression=expr, returnByValue=True)
            if done.get("result", {}).get("value") is True:
                break
            time.sleep(0.3)
        time.sleep(settle)
        text = self.call("Runtime.evaluate", expression="document.body.innerText",
                         returnByValue=True)
        return str(text["result"].get("value", ""))

    def text(self) -> str:
        """Return the page's visible text now."""
        return str(self.evaluate("document.body.innerText") or "")

    def wait_for_text(self, until: Callable[[str], bool], timeout: float = 120) -> str:
        """Poll the page's text (a React app renders after its load) until ``until`` holds
        or ``timeout`` seconds passed; return the last text either way."""
        deadline = time.monotonic() + timeout
        text = self.text()
        while not until(text) and time.monotonic() < deadline:
            time.sleep(0.5)
            text = self.text()
        return text

    def evaluate(self, expression: str) -> Any:  # noqa: ANN401 - whatever the page returns
        """Return the value of a JavaScript expression in the page."""
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return res["result"].get("value")

    def images_loaded(self) -> list[int]:
        """Return the natural widths of the page's images (0 = failed to load)."""
        res = self.call("Runtime.evaluate", returnByValue=True,
                        expression="Array.from(document.images).map(i => i.naturalWidth)")
        return list(res["result"]["value"])

    def screenshot(self, path: Path) -> Path:
        """Save a full-page PNG screenshot."""
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        """Stop Chromium and every process it started."""
        try:
            self.ws.close()
        finally:
            pids = [self.proc.pid, *descendants(self.proc.pid)]
            stop_pids(pids, groups=[self.proc.pid], grace=5)
            self.proc.wait(timeout=10)
            shutil.rmtree(self.profile, ignore_errors=True)
