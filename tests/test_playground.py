"""The playground page at / (orpheus_common/playground.html, issue 27 item 3), in a real headless browser: Debian's
Chromium driven by Selenium (`make test` installs both). The page lists the registry's voices, says the stack runs
random weights, plays a stream whose bytes arrive with its time to first audio shown, and its stop is a barge-in
that frees the stream (the worker's gauges back to 0). The front serves the same page."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import httpx
import pytest
from served import NOTHING_HELD, CharTokenizerDouble, ScriptedEngineDouble, baseline, serving, settled

from llm_server.speech.prompt import prompt_ids
from orpheus_common.playground import PAGE
from orpheus_front.front import create_front_app

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# The README's docs/playground.png is this test's screenshot: PLAYGROUND_SCREENSHOT=docs/playground.png writes it there.
SCREENSHOT = os.environ.get("PLAYGROUND_SCREENSHOT", "")


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # Headless as root on a machine with no network beyond loopback: no sandbox, no GPU, no background fetches,
    # and audio that may start without a click (the test's click is a script's, not a person's gesture).
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required", "--window-size=900,760"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


async def until(driver, script: str, within_s: float = 60.0):
    """The value of `script` (JavaScript returning something truthy once the page is there), polled."""
    deadline = asyncio.get_running_loop().time() + within_s
    while not (value := await asyncio.to_thread(driver.execute_script, f"return {script}")):
        assert asyncio.get_running_loop().time() < deadline, f"the page never got to: {script}"
        await asyncio.sleep(0.1)
    return value


@pytest.mark.skipif(not shutil.which(CHROMEDRIVER), reason="no Chromium: `make test` installs it (Makefile, BROWSER_STAMP)")
async def test_the_page_lists_voices_plays_a_stream_as_it_arrives_and_stop_frees_it(snac_server, tmp_path):
    engine = ScriptedEngineDouble(frames=600, frames_per_batch=1, batch_delay_s=0.02)  # a long answer, streamed
    async with serving(snac_server, engine) as served:
        quiet = await baseline(served, snac_server)
        driver = await asyncio.to_thread(browser)
        try:
            await asyncio.to_thread(driver.get, served.url + "/")
            voices = await until(driver, "[...document.querySelectorAll('#voice option')].map(o => o.value)")
            assert voices == served.runtime.voices.names()
            assert await until(driver, "!document.getElementById('warning').hidden")  # the tiny model's random weights
            await asyncio.to_thread(driver.execute_script, "document.getElementById('voice').value = 'leo'")
            await asyncio.to_thread(driver.execute_script, "document.getElementById('play').click()")
            assert int(await until(driver, "Number(document.getElementById('received').dataset.bytes) > 48000 && "
                                           "document.getElementById('received').dataset.bytes")) > 48000
            assert (await until(driver, "document.getElementById('ttfa').textContent")).endswith(" ms")
            assert "x real time" in await until(driver, "document.getElementById('rtf').textContent")
            assert served.runtime.admission.active == 1  # still speaking: the stop below is a barge-in
            shot = Path(SCREENSHOT or tmp_path / "playground.png")
            assert await asyncio.to_thread(driver.save_screenshot, str(shot)) and shot.stat().st_size > 10_000
            await asyncio.to_thread(driver.execute_script, "document.getElementById('stop').click()")
            assert await until(driver, "document.getElementById('state').textContent === 'stopped'")
            assert await settled(served, snac_server, quiet, count_tasks=False) == NOTHING_HELD
            text = await asyncio.to_thread(driver.execute_script, "return document.getElementById('text').value")
            assert prompt_ids(CharTokenizerDouble(), "leo", text) in engine.prompts.values()  # the page's text and voice
        finally:
            await asyncio.to_thread(driver.quit)


async def test_the_front_and_the_workers_serve_the_same_page(snac_server):
    async with serving(snac_server) as served:
        front = create_front_app([served.url])
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as via_front, \
                httpx.AsyncClient(base_url=served.url) as worker:
            pages = [await c.get("/") for c in (via_front, worker)]
            models = (await worker.get("/v1/models")).json()
    assert all(p.status_code == 200 and p.headers["content-type"].startswith("text/html") for p in pages)
    assert pages[0].text == pages[1].text == PAGE.read_text()
    assert models["megapod"] == {"random_weights": True}
