"""The chat page at `/`, in a real browser (Debian's chromium, headless, through selenium): it streams a reply equal
to the API's own, keeps the conversation, stops a reply, shows the server's status; --disable-web-ui removes it."""
from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL, start_server

SCREENSHOT = os.environ.get("JVLLM_CHAT_SCREENSHOT")  # where to keep the page's picture (the README's), if set


def _browser_paths() -> tuple[str, str] | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    return found if all(found) else None


@pytest.fixture(scope="module")
def browser():
    paths = _browser_paths()
    if paths is None and os.environ.get("CI") and hasattr(os, "geteuid") and os.geteuid() == 0:
        # CI machines run as root: install Debian's browser and its driver once
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"],
                       capture_output=True, timeout=900)
        paths = _browser_paths()
    if paths is None:
        pytest.skip("no chromium and chromedriver here (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(paths[1]), options=options)
    yield driver
    driver.quit()


def _wait(driver, condition, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))


def _set(driver, element_id: str, value: str) -> None:
    """Type a value and fire `change`, as a person leaving the field does."""
    driver.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                          "e.dispatchEvent(new Event('change'));", element_id, value)


def _send(driver, text: str) -> str:
    """Send a message with Enter; -> the assistant's reply once it has finished streaming."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    before = len(driver.find_elements(By.CSS_SELECTOR, ".turn.assistant"))
    box = driver.find_element(By.ID, "message")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    _wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".turn.assistant[data-done='true']")) > before)
    return driver.find_elements(By.CSS_SELECTOR, ".turn.assistant")[-1].text


def _api_reply(server, messages: list[dict], max_tokens: int) -> str:
    reply = httpx.post(f"{server.v1}/chat/completions", headers=server.headers, timeout=120, json={
        "model": MODEL, "messages": messages, "temperature": 0, "top_p": 1, "max_tokens": max_tokens})
    reply.raise_for_status()
    return reply.json()["choices"][0]["message"]["content"]


def test_the_page_chats_like_the_api(browser, live_server, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(live_server.url + "/")
    _wait(browser, lambda d: "API key" in d.find_element(By.ID, "error").text)  # the server wants a key
    _set(browser, "api_key", API_KEY)
    _wait(browser, lambda d: d.find_element(By.ID, "model").text == MODEL)
    _set(browser, "temperature", "0")
    _set(browser, "max_tokens", "12")
    first = _send(browser, "Hello there")
    assert first and first == _api_reply(live_server, [{"role": "user", "content": "Hello there"}], 12)
    second = _send(browser, "And then?")  # the conversation goes with it
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "And then?"}]
    assert second == _api_reply(live_server, history, 12)
    _wait(browser, lambda d: d.find_element(By.ID, "status").text.startswith("running "))
    assert browser.find_element(By.ID, "error").text == ""

    _set(browser, "max_tokens", "400")  # a long reply, stopped
    box = browser.find_element(By.ID, "message")
    box.send_keys("Tell me everything")
    browser.find_element(By.ID, "send").click()
    stop = browser.find_element(By.ID, "stop")
    _wait(browser, lambda d: stop.is_displayed() or d.find_elements(By.CSS_SELECTOR, ".turn.assistant[data-done]")[2:])
    if stop.is_displayed():
        stop.click()
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".turn.assistant[data-done='true']")) == 3)
    assert not stop.is_displayed() and browser.find_element(By.ID, "send").is_enabled()

    picture_file = tmp_path / "dot.png"  # an image goes with the next message; this text model refuses it
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 30, 30)).save(picture_file)
    browser.find_element(By.ID, "attach").send_keys(str(picture_file))
    _wait(browser, lambda d: d.find_element(By.ID, "attached").text == "dot.png")
    _send(browser, "What is in this picture?")
    assert browser.find_elements(By.CSS_SELECTOR, ".turn.user img")[-1].get_attribute("src").startswith(
        "data:image/png;base64,")
    assert "image" in browser.find_element(By.ID, "error").text.lower()  # the server's 400, shown in the page

    browser.find_element(By.ID, "clear").click()
    assert browser.find_elements(By.CSS_SELECTOR, ".turn") == []
    _set(browser, "max_tokens", "12")
    assert _send(browser, "Hello there") == first  # a new conversation
    picture = browser.get_screenshot_as_png()
    assert picture[:8] == b"\x89PNG\r\n\x1a\n" and len(picture) > 10_000
    if SCREENSHOT:
        with open(SCREENSHOT, "wb") as f:
            f.write(picture)


def test_the_page_and_its_files_are_served_without_a_key(live_server):
    page = httpx.get(live_server.url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "web/chat.js" in page.text and "http" not in page.text.split("<body>")[1].split("</body>")[0]  # no CDN
    for name, kind in (("chat.js", "javascript"), ("chat.css", "text/css")):
        reply = httpx.get(f"{live_server.url}/web/{name}", timeout=30)
        assert reply.status_code == 200 and kind in reply.headers["content-type"]
    assert "/" not in httpx.get(live_server.url + "/openapi.json", timeout=30).json()["paths"]


def test_disable_web_ui_leaves_the_api_only(tiny_llama):
    server = start_server(tiny_llama, settings={"disable_web_ui": True}, max_num_seqs=4,
                          kv_cache_memory_bytes=8 << 20)
    try:
        assert httpx.get(server.url + "/", timeout=30).status_code == 404
        assert httpx.get(server.url + "/web/chat.js", timeout=30).status_code == 404
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        server.stop()
