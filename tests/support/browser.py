"""Headless Chromium (Debian's ``chromium`` and ``chromium-driver``, which ``make test``
installs) driven by Selenium, for the web page's tests; screenshots of each step go
to ``build/webui-screenshots`` (not committed)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sluice.bench.webui import CHROMEDRIVER, CHROMIUM, browser
from tests.conftest import REPO, missing

SCREENSHOTS = REPO / "build" / "webui-screenshots"
T = TypeVar("T")


@contextmanager
def chromium(width: int = 1200, height: int = 900) -> Iterator[Any]:
    """A fresh browser profile (empty localStorage) for one test."""
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        missing("Chromium and chromedriver are not installed", "installs them (`make browser`)")
    with browser(width, height) as driver:
        yield driver


def screenshot(driver: Any, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SCREENSHOTS / f"{name}.png"))


def wait_until(what: Callable[[], T], timeout: float = 120, every: float = 0.05) -> T:
    """``what()`` once it is truthy; an AssertionError naming the wait after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {getattr(what, '__name__', what)}")
        time.sleep(every)


def open_page(driver: Any, url: str) -> None:
    """Load the page and wait until it has read the model card and drawn its view."""
    driver.get(url)
    wait_until(lambda: driver.execute_script("return document.body.dataset.ready === 'true'"))


def js_errors(driver: Any) -> list[str]:
    """The console's errors so far (a page that throws fails its test)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def type_prompt(driver: Any, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def set_parameter(driver: Any, field: str, value: str) -> None:
    """Open the parameters and replace one field's value."""
    from selenium.webdriver.common.by import By

    if not driver.find_element(By.ID, "settings").get_attribute("open"):
        driver.find_element(By.CSS_SELECTOR, "#settings summary").click()
    box = driver.find_element(By.ID, field)
    box.clear()
    box.send_keys(value)


def last_reply(driver: Any) -> dict[str, str]:
    """The last model message as the page shows it (``text``: rendered, so markdown's
    marks are gone), its status and response id; ``raw``: the text the page kept for
    it in the browser's storage (written when the reply ends)."""
    return dict(
        driver.execute_script(
            """
            const all = document.querySelectorAll('#messages article[data-role="assistant"]');
            const m = all[all.length - 1];
            if (!m) return {text: '', status: '', id: '', raw: ''};
            const link = m.querySelector('.lifecycle-link');
            const id = link ? link.getAttribute('href').split('/').pop() : '';
            const kept = JSON.parse(localStorage.getItem('sluice.conversations') || '[]')
                .flatMap((c) => c.messages).find((k) => id && k.responseId === id);
            return {text: m.querySelector('.body').textContent,
                    status: m.querySelector('.stats').dataset.status,
                    id, raw: kept ? kept.text : ''};
            """
        )
    )


FINAL = ("completed", "incomplete", "cancelled", "failed")


def settled_reply(driver: Any, *statuses: str, after: str = "") -> dict[str, str]:
    """The last reply once it has one of ``statuses`` (any final one if none are named),
    its turn is over (the send button is back) and the page has drawn it for the last
    time, so elements found in it stay attached.

    The page redraws a reply in an animation frame queued as the turn ends, after the
    final status is already shown; a frame requested after that one runs after it.
    ``after``: a previous reply's id that this one must differ from."""
    wanted = statuses or FINAL

    def done() -> dict[str, str] | None:
        reply = last_reply(driver)
        over = driver.execute_script("return !document.getElementById('send').disabled")
        return reply if reply["status"] in wanted and reply["id"] != after and over else None

    wait_until(done)
    driver.execute_async_script("requestAnimationFrame(arguments[arguments.length - 1])")
    return last_reply(driver)
