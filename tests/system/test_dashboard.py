"""The dashboard in a real browser (headless Chromium over CDP): it loads,
its charts and cache table update while requests run, it renders 1,000
requests of history, and it leaves a screenshot in test-artifacts/."""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from compat.launch import OURS, ServerProcess
from testkit.browser import Browser, chromium_path

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

pytestmark = pytest.mark.skipif(
    chromium_path() is None, reason="needs Debian's chromium (scripts/setup installs it)"
)


def points(chart):
    return f"Number(document.getElementById('{chart}').dataset.points || 0)"


async def test_dashboard_updates_live_and_saves_a_screenshot(fixture_path, tmp_path):
    with ServerProcess(OURS, ["--model", str(fixture_path("qwen3"))],
                       log=tmp_path / "server.log") as server:
        async with Browser.start() as browser:
            page = await browser.open(server.url + "/dashboard")
            await page.wait_for("typeof state !== 'undefined' && state.polls >= 1")
            assert await page.evaluate("document.getElementById('status').textContent") == "ok"
            # No --prompt-cache-dir: the disk tier's figure says so.
            assert await page.evaluate("document.getElementById('k-disk').textContent") == "off"
            assert await page.evaluate(points("chart-ttft")) == 0
            assert await page.evaluate("document.querySelectorAll('#entries tbody tr').length") == 0

            def conversation(i):
                messages = [{"role": "system", "content": f"You are assistant number {i}."},
                            {"role": "user", "content": f"Tell me about harbour {i}. " * (1 + i)}]
                status, r = server.post("/v1/chat/completions",
                                        {"messages": messages, "max_tokens": 12})
                assert status == 200, r
                return r

            loop = asyncio.get_running_loop()
            with ThreadPoolExecutor(4) as pool:
                # A first round: the charts and the table fill.
                await asyncio.gather(*(loop.run_in_executor(pool, conversation, i)
                                       for i in range(4)))
                await page.wait_for(f"{points('chart-ttft')} >= 4")
                first_rows = await page.wait_for(
                    "document.querySelectorAll('#entries tbody tr').length")
                first_points = await page.evaluate(points("chart-ttft"))
                # A second round: they update again, without reloading the page.
                await asyncio.gather(*(loop.run_in_executor(pool, conversation, i)
                                       for i in range(4, 10)))
                await page.wait_for(f"{points('chart-ttft')} >= {first_points + 6}")

            status, stats = server.get("/v1/stats")
            await page.wait_for(
                "document.getElementById('k-requests').textContent == "
                f"'{stats['totals']['requests']}'")
            rows = await page.evaluate("document.querySelectorAll('#entries tbody tr').length")
            assert rows >= first_rows and rows == min(len(stats["entries"]), 200)
            first_row = await page.evaluate(
                "[...document.querySelectorAll('#entries tbody tr')[0].cells].map(c => c.textContent)")
            top = stats["entries"][0]
            assert first_row[0] == top["kind"] and int(first_row[1]) == top["tokens"]
            # The models table: the served model, loaded, pinned; a name is text.
            cells = await page.evaluate(
                "[...document.querySelectorAll('#models tbody tr')[0].cells].map(c => c.textContent)")
            assert cells[:3] == [stats["models"][0]["id"], "loaded", "yes"]
            assert await page.evaluate("esc('<b>&')") == "&#60;b&#62;&#38;"
            for chart in ("chart-speed", "chart-match"):
                assert await page.evaluate(points(chart)) == 10, chart
            # The time series charts grow by a point a second.
            series = await page.evaluate(points("chart-memory"))
            await page.wait_for(f"{points('chart-memory')} > {series}")
            assert await page.evaluate("Number(document.getElementById('chart-memory').dataset.max)") \
                == stats["cache"]["budget_bytes"]

            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "dashboard.png"
            await page.screenshot(shot)
            assert shot.stat().st_size > 10_000

            # 1,000 requests of history: the page renders them all, and fast
            # enough to keep polling every second.
            fake = {k: v for k, v in (await page.evaluate("state.requests[0]")).items()}
            elapsed = await page.evaluate(f"""(() => {{
                const one = {json.dumps(fake)};
                state.requests = Array.from({{length: 1000}}, (_, i) =>
                    Object.assign({{}}, one, {{ttft: (i % 50) / 100, cached_tokens: i}}));
                const stats = {json.dumps(stats)};
                const t0 = performance.now(); render(stats); return performance.now() - t0;
            }})()""")
            assert await page.evaluate(points("chart-ttft")) == 1000
            assert await page.evaluate(points("chart-match")) == 1000
            print(f"render of 1,000 requests: {elapsed:.1f} ms; screenshot: {shot}")
            await page.screenshot(ARTIFACTS / "dashboard-1000.png")
            assert page.exceptions == [] and page.console_errors == []
