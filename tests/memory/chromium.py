"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol, for the report tests.

    with Browser.start(tmp_path) as browser:
        page = browser.open(html_file)          # loads it, networking off, records every request and error
        page.evaluate("document.title"); page.screenshot(tmp_path / "shot.png")

No Playwright: a websocket (the `websockets` package) and a dozen protocol calls. Networking is off
three ways: the page's network is emulated offline, every host resolves to nothing, and a proxy on
a closed port catches anything left; every request the page makes is still recorded, so a test can
assert that none leaves the file.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0", "--no-first-run",
         "--disable-background-networking", "--disable-extensions", "--disable-sync", "--proxy-server=127.0.0.1:9",
         "--host-resolver-rules=MAP * ~NOTFOUND", "--window-size=1200,900"]


class Page:
    """One tab: send protocol commands, collect its events."""

    def __init__(self, browser: Browser, session_id: str):
        self.browser, self.session_id = browser, session_id
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        return self.browser.send(method, params, self.session_id, sink=self.events)

    def wait_for(self, method: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((e for e in self.events if e.get("method") == method), None)
            if found:
                return found
            self.browser.pump(self.events, deadline - time.monotonic())
        raise TimeoutError(f"no {method} within {timeout} s")

    def evaluate(self, expression: str) -> Any:
        reply = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in reply:
            raise AssertionError(f"{expression!r} raised: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and browser log errors (a CSP violation is one)."""
        out = []
        for e in self.events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                out.append(json.dumps(p["exceptionDetails"])[:300])
            elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(p["entry"]["text"])
        return out

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path


class Browser:
    """A headless Chromium process and its DevTools websocket."""

    def __init__(self, proc: subprocess.Popen, ws):
        self.proc, self.ws, self._ids = proc, ws, itertools.count(1)

    @classmethod
    def start(cls, workdir: Path, timeout: float = 60.0) -> Browser:
        profile = workdir / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + timeout
        while not (port_file.exists() and len(port_file.read_text().splitlines()) == 2):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{CHROMIUM} did not open its DevTools port (exit {proc.poll()})")
            time.sleep(0.1)
        port, path = port_file.read_text().splitlines()
        ws = connect(f"ws://127.0.0.1:{port}{path}", max_size=None, open_timeout=timeout)
        return cls(proc, ws.__enter__())  # closed in close()

    def send(self, method: str, params: dict[str, Any], session_id: str | None = None,
             sink: list[dict[str, Any]] | None = None, timeout: float = 60.0) -> dict[str, Any]:
        ident = next(self._ids)
        message = {"id": ident, "method": method, "params": params}
        if session_id:
            message["sessionId"] = session_id
        self.ws.send(json.dumps(message))
        deadline = time.monotonic() + timeout
        while True:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == ident:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            if sink is not None and "method" in reply:
                sink.append(reply)

    def pump(self, sink: list[dict[str, Any]], timeout: float) -> None:
        try:
            reply = json.loads(self.ws.recv(timeout=max(0.05, min(timeout, 1.0))))
        except TimeoutError:
            return
        if "method" in reply:
            sink.append(reply)

    def open(self, html: Path) -> Page:
        """A new tab with networking off, loading `html` from disk; returns once its load event fired."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session_id = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session_id)
        for domain in ("Page", "Runtime", "Log", "Network"):
            page.send(f"{domain}.enable")
        page.send("Network.emulateNetworkConditions", offline=True, latency=0, downloadThroughput=-1,
                  uploadThroughput=-1)
        page.send("Emulation.setDeviceMetricsOverride", width=1200, height=900, deviceScaleFactor=1, mobile=False)
        page.send("Page.navigate", url=html.resolve().as_uri())
        page.wait_for("Page.loadEventFired")
        return page

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
