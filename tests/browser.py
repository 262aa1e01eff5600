"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe): no
driver, no websocket library, no download. Debian's `chromium` package provides the browser;
`.ci/run` installs it, and tests that need it skip with the reason where it is absent."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import threading
import time

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MISSING = "Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)"


class Browser:
    """One headless Chromium with its own profile directory; `page(url)` opens a tab."""

    def __init__(self, profile: str):
        cmd_r, self._cmd_w = os.pipe()  # the browser reads commands on its fd 3
        self._out_r, out_w = os.pipe()  # and writes answers and events on its fd 4

        def fds():  # in the child: the pipe ends at 3 and 4, whatever numbers they had here
            a, b = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10), fcntl.fcntl(out_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [
            CHROMIUM,
            "--headless=new",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--window-size=1280,900",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args, preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        os.close(cmd_r)
        os.close(out_w)
        self._next = 0
        self._answers: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.console: list[str] = []  # the page's console errors and exceptions
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        while chunk := os.read(self._out_r, 1 << 16):
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._lock:
                        q = self._answers.get(msg["id"])
                    if q is not None:
                        q.put(msg)
                elif msg.get("method") == "Runtime.exceptionThrown":
                    self.console.append(json.dumps(msg["params"]["exceptionDetails"])[:500])
                elif msg.get("method") == "Runtime.consoleAPICalled" and msg["params"]["type"] == "error":
                    self.console.append(json.dumps(msg["params"]["args"])[:500])

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30.0):
        with self._lock:
            self._next += 1
            n = self._next
            self._answers[n] = q = queue.Queue()
        msg = {"id": n, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        try:
            answer = q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"Chromium did not answer {method} within {timeout} s") from None
        finally:
            with self._lock:
                del self._answers[n]
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer["result"]

    def page(self, url: str) -> Page:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        self.call("Runtime.enable", session=session)
        self.call("Page.enable", session=session)
        self.call("Page.navigate", {"url": url}, session=session)
        page.wait("document.readyState === 'complete' && window.dspark !== undefined")
        return page

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except Exception:  # already gone: kill below
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def eval(self, expression: str):
        r = self.browser.call(
            "Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True}, self.session
        )
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, condition: str, timeout: float = 60.0):
        """Poll a JavaScript expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(condition)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never satisfied: {condition}")
            time.sleep(0.1)

    def screenshot(self, path) -> None:
        data = self.browser.call("Page.captureScreenshot", {"format": "png"}, self.session)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
