"""A headless Chromium driven through the DevTools protocol over a pipe.

`--remote-debugging-pipe` reads commands on fd 3 and writes replies and events
on fd 4, each a JSON object ended by a NUL byte: no websocket library needed.
Used by tests/test_html_report.py to load a page, collect its console errors,
exceptions and network requests, run a script in it and take a screenshot.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def find() -> str | None:
    """The Chromium executable (Debian's `chromium` package), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


_EXEC = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
         "os.execv(sys.argv[3], sys.argv[3:])")


def _high(fds: tuple[int, int]) -> tuple[int, int]:
    """The pipe moved to fds above 4, so that putting one end on fd 3 or 4 cannot
    overwrite the other."""
    out = []
    for fd in fds:
        out.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10))
        os.close(fd)
    return out[0], out[1]


class Chromium:
    def __init__(self, exe: str, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="rewritec-chromium-")
        to_child, self._write = _high(os.pipe())
        self._read, from_child = _high(os.pipe())
        flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-extensions", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--mute-audio",
                 # nothing may leave the machine: any name resolves to nowhere
                 "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
                 f"--user-data-dir={self.profile}", "--remote-debugging-pipe", "about:blank"]
        # a small Python puts our pipe ends on fds 3 and 4, where Chromium expects them
        self.proc = subprocess.Popen([sys.executable, "-c", _EXEC, str(to_child),
                                      str(from_child), exe, *flags],
                                     pass_fds=(to_child, from_child),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        self._ids = 0
        threading.Thread(target=self._reader, daemon=True).start()
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget",
                                 {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=self.session)

    def _reader(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._read, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                self.messages.put(json.loads(raw))

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None) -> dict[str, Any]:
        self._ids += 1
        msg: dict[str, Any] = {"id": self._ids, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._write, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self.messages.get(timeout=max(0.01, deadline - time.monotonic()))
            if reply.get("id") == self._ids:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> dict[str, Any]:
        for e in self.events:
            if e.get("method") == method:
                return e
        deadline = time.monotonic() + self.timeout
        while True:
            e = self.messages.get(timeout=max(0.01, deadline - time.monotonic()))
            self.events.append(e)
            if e.get("method") == method:
                return e

    def open(self, path: Path) -> None:
        """Load a local file and wait for its load event."""
        self.call("Page.navigate", {"url": path.resolve().as_uri()}, self.session)
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                        self.session)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def screenshot(self, path: Path, width: int = 1400, height: int = 1600) -> None:
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
                  self.session)
        data = self.call("Page.captureScreenshot", {"format": "png"}, self.session)["data"]
        path.write_bytes(base64.b64decode(data))

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions, log errors (CSP, failed loads) and
        dialogs (an `alert` from injected script) seen so far."""
        self.drain()
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('text')} "
                           f"{p['exceptionDetails'].get('exception', {}).get('description')}")
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(f"console.{p['type']}: {[a.get('value') for a in p['args']]}")
            elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            elif m == "Page.javascriptDialogOpening":
                out.append(f"dialog: {p.get('message')}")
        return out

    def requests(self) -> list[str]:
        """Every URL the page asked for."""
        self.drain()
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"]

    def drain(self) -> None:
        while True:
            try:
                self.events.append(self.messages.get_nowait())
            except queue.Empty:
                return

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, queue.Empty, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._write)
        shutil.rmtree(self.profile, ignore_errors=True)
