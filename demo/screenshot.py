"""Make docs/demo.png: the demo on SmolLM2-135M-Instruct after three greedy turns, in headless Chromium.

    python -m demo.screenshot                      # writes docs/demo.png
    python -m demo.screenshot --out /tmp/demo.png --model tiny-random

It starts `python -m demo` on a free port (float32, the torch backend), sends the messages below
through the page as a user would (each turn reuses the history before it; the third reply runs into
the 48-token limit and says so), and saves the window. Needs chromium and chromedriver on PATH and
selenium (`pip install -e '.[dev]'`); the model is fetched once (`python -m stateful_hf.models fetch`).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = ("What is Paris famous for? Answer in one sentence.", "Which museum should I visit first?",
            "Tell me about the history of the Louvre.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_served(proc: subprocess.Popen, url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the demo exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the demo did not serve {url} within {seconds:.0f} s")


def shoot(url: str, out: Path, messages: tuple[str, ...], size: tuple[int, int]) -> None:
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                 f"--window-size={size[0]},{size[1]}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")),
                              options=opts)
    try:
        driver.set_page_load_timeout(120)
        driver.get(url)
        wait = WebDriverWait(driver, 300)
        box = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#shf-input textarea"))
        for turn, text in enumerate(messages, start=1):
            box.send_keys(text)
            box.send_keys(Keys.ENTER)
            wait.until(lambda d, n=turn: len(d.find_elements(By.CSS_SELECTOR, "#shf-turns tr")) == n + 1)
        time.sleep(1.0)                     # the last stream's final render
        out.parent.mkdir(parents=True, exist_ok=True)
        if not driver.save_screenshot(str(out)):
            raise SystemExit(f"could not save {out}")
    finally:
        driver.quit()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m demo.screenshot", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "demo.png"), help="the PNG to write")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the demo's --model")
    p.add_argument("--size", default="1400x1000", help="the browser window, WIDTHxHEIGHT")
    a = p.parse_args(argv)
    size = tuple(int(v) for v in a.size.split("x"))
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "demo", "--model", a.model, "--dtype", "float32", "--backend",
                             "torch", "--max-new-tokens", "48", "--port", str(port), "--no-hints"], cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}/"
        _wait_served(proc, url, 300)
        shoot(url, Path(a.out), MESSAGES, size)
        print(f"wrote {a.out}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
