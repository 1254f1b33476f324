"""Drive Debian's headless Chromium over the DevTools protocol (a websocket, aiohttp's
client): load a page, collect its console errors and uncaught exceptions, evaluate JS, and
take a full-page screenshot."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp


@dataclass
class PageVisit:
    value: Any
    """What ``expression`` evaluated to (awaited when a promise)."""
    errors: list[str] = field(default_factory=list)
    """console.error calls, uncaught exceptions and error log entries, in order."""
    screenshot: Path | None = None
    requests: list[str] = field(default_factory=list)
    """Every URL the page asked for (the page itself included)."""


class _Session:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.ids = ws, itertools.count(1)
        self.errors: list[str] = []
        self.events: list[str] = []
        self.requests: list[str] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self.ids)
        await self.ws.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads((await self.ws.receive(timeout=120)).data)
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self._event(message)

    async def wait_event(self, name: str) -> None:
        while name not in self.events:
            self._event(json.loads((await self.ws.receive(timeout=120)).data))

    def _event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        self.events.append(method)
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = [a.get("value", a.get("description")) for a in params.get("args", [])]
            self.errors.append("console: " + " ".join(map(str, args)))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"exception: {text}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry.get('text')} ({entry.get('url', '')})")


async def _visit(port: int, page: Path, expression: str, shot: Path | None) -> PageVisit:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        async with http.ws_connect(url, max_msg_size=0) as ws:
            s = _Session(ws)
            for domain in ("Runtime", "Log", "Page", "Network"):
                await s.call(f"{domain}.enable")
            await s.call("Page.navigate", url=page.resolve().as_uri())
            await s.wait_event("Page.loadEventFired")
            result = await s.call(
                "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
            )
            if "exceptionDetails" in result:
                s.errors.append(f"evaluate: {result['exceptionDetails']}")
            visit = PageVisit(result.get("result", {}).get("value"), s.errors)
            visit.requests = s.requests
            if shot is not None:
                size = (await s.call("Page.getLayoutMetrics"))["cssContentSize"]
                clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"]}
                image = await s.call(
                    "Page.captureScreenshot",
                    format="png",
                    captureBeyondViewport=True,
                    clip={**clip, "scale": 1},
                )
                shot.write_bytes(base64.b64decode(image["data"]))
                visit.screenshot = shot
            return visit


def visit(chromium: str, page: Path, expression: str, screenshot: Path | None = None) -> PageVisit:
    """Load ``page`` in a fresh headless Chromium, evaluate ``expression`` once it loaded."""
    # chromium's helper processes outlive the browser process for a moment: the whole process
    # group (its own session) is ended, and a profile file written late does not fail the test
    with tempfile.TemporaryDirectory(
        prefix="chromium-profile-", ignore_cleanup_errors=True
    ) as profile:
        proc = subprocess.Popen(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--window-size=1400,1000",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            active = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not (active.exists() and active.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"chromium did not open its DevTools port (rc {proc.poll()})"
                    )
                time.sleep(0.1)
            port = int(active.read_text().split()[0])
            return asyncio.run(_visit(port, page, expression, screenshot))
        finally:
            _end_group(proc)


def _end_group(proc: subprocess.Popen) -> None:
    """End the browser and every helper process of its session (this test started them)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(0.2)  # helpers exit after the browser
