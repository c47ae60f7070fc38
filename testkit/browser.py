"""Headless Chromium driven over the DevTools protocol (plain CDP on aiohttp's
websocket client: no Playwright, nothing downloaded).

    async with Browser.start() as browser:
        page = await browser.open(url)
        await page.evaluate("document.title")
        await page.screenshot(path)
"""

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import aiohttp

from compat.launch import free_port

# What works in these containers: no sandbox (root, no user namespaces), no
# GPU, /dev/shm too small for Chromium's default.
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--window-size=1400,1000",
]


def chromium_path() -> Optional[str]:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


class Page:
    def __init__(self, ws):
        self.ws = ws
        self._ids = itertools.count(1)
        self.exceptions = []  # uncaught page exceptions (Runtime.exceptionThrown)
        self.console_errors = []

    async def send(self, method: str, **params):
        message_id = next(self._ids)
        await self.ws.send_str(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            msg = await self.ws.receive(timeout=60)
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"DevTools connection closed: {msg}")
            data = json.loads(msg.data)
            if data.get("method") == "Runtime.exceptionThrown":
                self.exceptions.append(data["params"]["exceptionDetails"])
            elif data.get("method") == "Runtime.consoleAPICalled":
                if data["params"]["type"] == "error":
                    self.console_errors.append(data["params"]["args"])
            if data.get("id") == message_id:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return data.get("result", {})

    async def evaluate(self, expression: str):
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"never true: {expression}")
            await asyncio.sleep(0.1)

    async def screenshot(self, path: Path):
        result = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        Path(path).write_bytes(base64.b64decode(result["data"]))


class Browser:
    def __init__(self, proc, port, profile, session):
        self.proc, self.port, self.profile, self.session = proc, port, profile, session

    @classmethod
    def start(cls):
        return _Starter(cls)

    async def open(self, url: str) -> Page:
        base = f"http://127.0.0.1:{self.port}"
        async with self.session.put(f"{base}/json/new?{url}") as r:
            target = await r.json()
        ws = await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        page = Page(ws)
        await page.send("Runtime.enable")
        await page.send("Page.enable")
        return page

    async def close(self):
        await self.session.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


class _Starter:
    def __init__(self, cls):
        self.cls = cls
        self.browser = None

    async def __aenter__(self) -> Browser:
        path = chromium_path()
        if path is None:
            raise RuntimeError("no chromium on PATH (apt-get install chromium)")
        port = free_port()
        profile = tempfile.mkdtemp(prefix="mlx_lm_plus-chromium-")
        proc = subprocess.Popen(
            [path, *FLAGS, f"--remote-debugging-port={port}", f"--user-data-dir={profile}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "DBUS_SESSION_BUS_ADDRESS": "disabled:"},
        )
        session = aiohttp.ClientSession()
        deadline = time.monotonic() + 60
        while True:
            try:
                async with session.get(f"http://127.0.0.1:{port}/json/version") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                await session.close()
                raise RuntimeError(f"chromium did not start (exit {proc.poll()})")
            await asyncio.sleep(0.2)
        self.browser = self.cls(proc, port, profile, session)
        return self.browser

    async def __aexit__(self, *exc):
        await self.browser.close()
