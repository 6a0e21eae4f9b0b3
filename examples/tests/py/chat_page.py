#!/usr/bin/env python3
"""Headless Chromium (Debian's chromium and chromium-driver) driving the chat page of
`powerinfer serve`: types a message, sends it, and waits until the streamed answer has grown
over several updates. Usage: chat_page.py BASE_URL. Prints the updates it saw as JSON."""
import json
import sys
import tempfile
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By


def main():
    base = sys.argv[1]
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--user-data-dir=" + tempfile.mkdtemp()]:
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        driver.get(base + "/")
        box = driver.find_element(By.ID, "input")
        box.send_keys("Hello there")
        driver.find_element(By.ID, "send").click()
        seen = []
        deadline = time.time() + 60
        while time.time() < deadline:
            answers = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")
            text = answers[-1].text if answers else ""
            if text and (not seen or text != seen[-1]):
                seen.append(text)
            status = driver.find_element(By.ID, "status").text
            if status.endswith("tokens") and seen:
                break
            time.sleep(0.005)
        users = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".msg.user")]
        assert users == ["Hello there"], users
        assert seen, "no answer appeared"
        assert len(seen) >= 2, "the answer did not stream: " + json.dumps(seen)
        assert all(seen[i + 1].startswith(seen[i]) for i in range(len(seen) - 1)), seen
        print(json.dumps({"updates": len(seen), "final": seen[-1], "status": status}))
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
