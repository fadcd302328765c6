"""The web page's own cost: its weight, its first paint, and how much later a person sees
the first token than an API client gets it.

    python -P -m sluice.bench.webui [--url http://127.0.0.1:8000] [--rounds 5]

Without ``--url`` it starts ``python -m sluice`` with the default model and flags on a
free port. Headless Chromium (Debian's ``chromium`` and ``chromium-driver``) loads the
page with its cache off for each cold load; then, interleaved (page, API, page, API …),
the same streamed, stored background request is made from the page (clicked Send →
first text drawn) and from the ``openai`` SDK (create → first ``output_text.delta``).
Prints medians and the page ÷ API ratio, with the CPU and every command line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sluice.bench.data_parallel import wait_up
from sluice.bench.machine import print_machine
from sluice.bench.stats import ratio
from sluice.http.webui import load_assets

PROMPT = "Name three colours."
MAX_TOKENS = 16
# Installed in the page: the time Send is clicked, and the first time text is drawn.
WATCH = """
window.__bench = {clicked: null, shown: null};
document.getElementById('send').addEventListener('click', () => {
  window.__bench = {clicked: performance.now(), shown: null};
}, {capture: true});
new MutationObserver(() => {
  const bodies = document.querySelectorAll('#messages article[data-role="assistant"] .body');
  const last = bodies[bodies.length - 1];
  if (window.__bench.clicked !== null && window.__bench.shown === null && last
      && last.textContent) window.__bench.shown = performance.now();
}).observe(document.getElementById('messages'), {childList: true, subtree: true,
                                                  characterData: true});
"""


@contextmanager
def started_server() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-P", "-m", "sluice", "--port", str(port)]
    print("server:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@contextmanager
def browser(width: int = 1200, height: int = 900) -> Iterator[Any]:
    """Debian's headless Chromium through its chromedriver (the page's tests use it too),
    its console kept for reading. Its profile and the singleton socket folder Chromium
    makes under ``TMPDIR`` go in one temporary folder, removed when it quits (Chromium
    leaves the socket folder behind when chromedriver stops it)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="sluice-chromium-") as scratch:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     f"--window-size={width},{height}", "--disable-gpu",
                     f"--user-data-dir={scratch}/profile"):  # fmt: skip
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        print("browser:", CHROMIUM, " ".join(options.arguments), flush=True)
        service = Service(CHROMEDRIVER, env={**os.environ, "TMPDIR": scratch})
        driver = webdriver.Chrome(service=service, options=options)
        try:
            yield driver
        finally:
            driver.quit()


def cold_load(driver: Any, url: str) -> dict[str, float]:
    """One load with the cache off: bytes over the wire and the paint timings (ms)."""
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": True})
    driver.get("about:blank")
    driver.get(url + "/")
    deadline = time.monotonic() + 120
    ready = "return document.body.dataset.ready === 'true' && performance.getEntriesByName("
    while not driver.execute_script(ready + "'first-contentful-paint').length > 0"):
        if time.monotonic() > deadline:
            raise SystemExit("the page did not become ready")
        time.sleep(0.02)
    figures: dict[str, float] = driver.execute_script("""
        const nav = performance.getEntriesByType('navigation')[0];
        const paint = Object.fromEntries(performance.getEntriesByType('paint')
            .map((p) => [p.name, p.startTime]));
        const own = performance.getEntriesByType('resource')
            .filter((r) => r.name.includes('/webui/'));
        return {
            transfer_bytes: nav.transferSize + own.reduce((n, r) => n + r.transferSize, 0),
            body_bytes: nav.encodedBodySize + own.reduce((n, r) => n + r.encodedBodySize, 0),
            first_paint_ms: paint['first-paint'],
            first_contentful_paint_ms: paint['first-contentful-paint'],
            dom_content_loaded_ms: nav.domContentLoadedEventEnd,
        };
    """)
    driver.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": False})
    driver.execute_cdp_cmd("Network.disable", {})
    return figures


def page_ttft(driver: Any, url: str) -> float:
    """Seconds from clicking Send to the first text drawn, in a fresh conversation."""
    from selenium.webdriver.common.by import By

    driver.get(url + "/#/")
    while not driver.execute_script("return document.body.dataset.ready === 'true'"):
        time.sleep(0.02)
    driver.execute_script("localStorage.clear()")
    driver.refresh()
    while not driver.execute_script("return document.body.dataset.ready === 'true'"):
        time.sleep(0.02)
    driver.execute_script(WATCH)
    driver.find_element(By.CSS_SELECTOR, "#settings summary").click()
    for field, value in (("temperature", "0"), ("max-tokens", str(MAX_TOKENS))):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    driver.find_element(By.ID, "prompt").send_keys(PROMPT)
    driver.find_element(By.ID, "send").click()
    deadline = time.monotonic() + 120
    while True:
        bench = driver.execute_script("return window.__bench")
        if bench["shown"] is not None:
            break
        if time.monotonic() > deadline:
            raise SystemExit("no text was shown")
        time.sleep(0.005)
    # Let the reply finish so the next round starts on an idle server.
    while driver.find_element(By.ID, "send").get_attribute("disabled"):
        time.sleep(0.05)
    return float(bench["shown"] - bench["clicked"]) / 1000


def api_ttft(sdk: Any, model: str) -> float:
    """Seconds from the SDK's create to its first ``output_text.delta``: the request the
    page makes."""
    start = time.perf_counter()
    first = None
    stream = sdk.responses.create(
        model=model, input=PROMPT, store=True, background=True, stream=True, temperature=0,
        max_output_tokens=MAX_TOKENS,
    )  # fmt: skip
    for event in stream:
        if first is None and event.type == "response.output_text.delta":
            first = time.perf_counter() - start
    if first is None:
        raise SystemExit("the API stream had no text")
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running Sluice (default: start one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    print_machine()
    print("command:", Path(sys.executable).name, "-P -m sluice.bench.webui", *sys.argv[1:])
    assets = load_assets()
    weight = {name: len(a.body) for name, a in assets.items()}
    print(f"page weight: {sum(weight.values()):,} bytes in {len(weight)} files, uncompressed "
          f"({', '.join(f'{n} {b:,}' for n, b in sorted(weight.items()))})")  # fmt: skip
    with started_server() if args.url is None else _given(args.url) as url:
        import openai

        sdk = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("OPENAI_API_KEY", "x"),
                            max_retries=0)  # fmt: skip
        model = sdk.models.list().data[0].id
        with browser() as driver:
            loads = [cold_load(driver, url) for _ in range(args.rounds)]
            page, api = [], []
            api_ttft(sdk, model)  # warm both paths once
            page_ttft(driver, url)
            for _ in range(args.rounds):
                page.append(page_ttft(driver, url))
                api.append(api_ttft(sdk, model))
    med = {key: statistics.median(load[key] for load in loads) for key in loads[0]}
    print(f"cold load (median of {args.rounds}): {med['transfer_bytes']:,.0f} bytes over the "
          f"wire ({med['body_bytes']:,.0f} in bodies), first paint {med['first_paint_ms']:.0f} ms,"
          f" first contentful paint {med['first_contentful_paint_ms']:.0f} ms, DOM ready "
          f"{med['dom_content_loaded_ms']:.0f} ms")  # fmt: skip
    page_s, api_s = statistics.median(page), statistics.median(api)
    print(f"first token (median of {args.rounds}, interleaved): shown by the page "
          f"{page_s * 1000:.0f} ms, API TTFT {api_s * 1000:.0f} ms, page ÷ API "
          f"{ratio(page_s, api_s) or float('nan'):.2f}")  # fmt: skip
    if args.json:
        figures = {"weight": weight, "cold_load": med, "page_ttft_s": page, "api_ttft_s": api}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1))


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url.rstrip("/")


if __name__ == "__main__":
    main()
