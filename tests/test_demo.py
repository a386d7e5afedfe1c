"""The Gradio demo, launched as `python -m demo` on 127.0.0.1: two concurrent users driven through
gradio_client, and the page in headless Chromium (Debian's chromium + chromium-driver)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("gradio", reason="the demo needs gradio: pip install -e '.[demo]'")
gradio_client = pytest.importorskip("gradio_client", reason="pip install -e '.[dev]' (gradio_client)")

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 24
USERS = {
    "alice": ["Hello! How are you today?", "Tell me about the sea.", "Summarize that in one sentence."],
    "bob": ["What would you like to talk about?", "The mountains and the stars at night.", "Thank you."],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("demo") / "demo.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "demo", "--host", "127.0.0.1", "--port", str(port),
                                 "--max-new-tokens", str(MAX_NEW), "--backend", "torch", "--model", "tiny-random",
                                 "--dtype", "float32"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the demo exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the demo did not serve {url} within 120 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
            pytest.fail(f"the demo did not shut down within 20 s of SIGTERM:\n{log.read_text()[-3000:]}")
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert "engine stopped, store closed" in log.read_text()


def _texts(chat: list[dict]) -> list[tuple[str, str]]:
    """(role, text) of each message the Chatbot returned (its content is a list of parts)."""
    out = []
    for m in chat:
        c = m["content"]
        out.append((m["role"], c if isinstance(c, str) else "".join(p.get("text", "") for p in c)))
    return out


def _reply(text: str) -> tuple[str, bool]:
    """(a displayed reply without its note, whether the note says it stopped at its token limit)."""
    body, note, _ = text.partition("\n\n*(stopped at the ")
    return body, bool(note)


def test_the_api_names_its_endpoints_and_values(demo_url):
    """The demo's API (what gradio_client lists) names its endpoints and every value they take and
    return: no Gradio placeholder (`value_6`, `parameter_7`) for a component without a label."""
    api = gradio_client.Client(demo_url, verbose=False).view_api(print_info=False, return_format="dict")
    assert set(api["named_endpoints"]) == {"/send", "/retry", "/undo"} and not api["unnamed_endpoints"]
    returns = ["Chat", "message", "turns", "store tiers", "last turn"]
    for name, ep in api["named_endpoints"].items():
        assert [r["label"] for r in ep["returns"]] == returns, (name, ep["returns"])
        for p in ep["parameters"] + ep["returns"]:
            assert not re.fullmatch(r"(value|parameter)_\d+", p["label"]), (name, p)
    assert [p["label"] for p in api["named_endpoints"]["/send"]["parameters"]][0] == "message"


def test_two_concurrent_sessions_three_turns(demo_url):
    from stateful_hf import Engine, SamplingParams
    from stateful_hf.testing import tiny_llama, tiny_tokenizer

    results: dict[str, list] = {}
    errors = []

    def user(name: str) -> None:
        try:
            client = gradio_client.Client(demo_url, verbose=False)     # its own Gradio session
            for msg in USERS[name]:
                job = client.submit(msg, MAX_NEW, 0.0, api_name="/send")
                final = job.result(timeout=120)
                results.setdefault(name, []).append((len(job.outputs()), final))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=user, args=(n,)) for n in USERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors, errors
    # The engine's own chat front-end on the same model gives the same replies.
    engine = Engine(tiny_llama(), tiny_tokenizer(), device_capacity=4096)
    greedy = SamplingParams(max_new_tokens=MAX_NEW)
    for name, turns in results.items():
        assert len(turns) == 3
        for i, (n_updates, (chat, box, turns_html, tiers_html, raw)) in enumerate(turns):
            want = engine.chat_submit(name, USERS[name][i], greedy).result().text
            msgs = _texts(chat)
            assert len(msgs) == 2 * (i + 1)
            assert msgs[-2] == ("user", USERS[name][i]) and msgs[-1][0] == "assistant"
            assert _reply(msgs[-1][1]) == (want, raw["finish_reason"] == "length")
            assert n_updates > 3, "the reply was not streamed"
            assert raw["turn"] == i + 1 and raw["output_tokens"] > 0 and raw["ttft_ms"] > 0
            # the table's counts add up: the prompt is reused + computed; generated tokens are apart
            assert raw["reused_tokens"] + raw["computed_tokens"] == raw["prompt_tokens"], raw
            assert raw["generated_tokens"] == raw["output_tokens"], raw
            if i == 0:
                assert raw["reused_tokens"] == 0
            else:
                assert raw["reused_tokens"] > 0 and raw["at_send_device"] + raw["at_send_host"] > 0, raw
            assert "TTFT" in turns_html and "device" in tiers_html and box == ""
    engine.stop()


def test_failed_turn_is_rolled_back_and_later_sends_work(demo_url):
    """A prompt longer than the model's context fails: the conversation stays, the failed message is shown
    with its error and handed back to the input box, and the next send works as if it never happened."""
    from stateful_hf import Engine, SamplingParams
    from stateful_hf.testing import tiny_llama, tiny_tokenizer

    client = gradio_client.Client(demo_url, verbose=False)
    first = "Hello! How are you today?"
    chat, *_ = client.predict(first, MAX_NEW, 0.0, api_name="/send")
    assert len(_texts(chat)) == 2
    huge = "The quick brown fox jumps over the lazy dog. " * 300          # > the tiny model's 2048 positions
    chat, box, turns_html, tiers_html, raw = client.predict(huge, MAX_NEW, 0.0, api_name="/send")
    msgs = _texts(chat)
    assert msgs[:2] == _texts(chat)[:2] and msgs[0] == ("user", first)   # the conversation is still shown
    assert msgs[2] == ("user", huge) and msgs[3][0] == "assistant"
    assert "failed and was rolled back" in msgs[3][1] and "does not fit" in msgs[3][1], msgs[3][1][:300]
    assert box == huge                                                  # handed back for editing
    assert raw["turn"] == 1                                             # no turn was recorded
    # the next send is a normal second turn: the failed message is not part of the conversation
    second = "Tell me about the sea."
    chat, box, *_ = client.predict(second, MAX_NEW, 0.0, api_name="/send")
    msgs = _texts(chat)
    assert [m[1] for m in msgs if m[0] == "user"] == [first, second] and len(msgs) == 4 and box == ""
    engine = Engine(tiny_llama(), tiny_tokenizer(), device_capacity=4096)
    greedy = SamplingParams(max_new_tokens=MAX_NEW)
    engine.chat_submit("x", first, greedy).result()
    assert _reply(msgs[3][1])[0] == engine.chat_submit("x", second, greedy).result().text
    assert _reply(msgs[1][1])[0] == engine.conversation("x")[1]["content"]
    engine.stop()
    # Retry has its own temperature: at 0 it repeats the greedy reply; above 0 it samples another one
    again, *_ = client.predict(MAX_NEW, 0.0, api_name="/retry")
    assert _texts(again) == msgs
    replies = {_texts(client.predict(MAX_NEW, 1.5, api_name="/retry")[0])[-1][1] for _ in range(3)}
    assert replies - {msgs[3][1]}, "Retry at temperature 1.5 gave the greedy reply every time"


def test_finish_reason_shown_and_undone_turns_leave_the_table(demo_url):
    """A reply cut by the token limit says so (in its bubble and the table's `end` column); an undone
    exchange leaves the per-turn table and the next turn takes its number."""
    client = gradio_client.Client(demo_url, verbose=False)
    chat, box, turns_html, tiers_html, raw = client.predict("Hello! How are you today?", 3, 0.0, api_name="/send")
    assert raw["turn"] == 1 and raw["finish_reason"] in ("stop", "length") and raw["output_tokens"] <= 3
    text, capped = _reply(_texts(chat)[-1][1])
    assert capped == (raw["finish_reason"] == "length") and text
    assert f"<td class='shf-end'>{raw['finish_reason']}</td>" in turns_html
    chat, box, turns_html, tiers_html, raw = client.predict("Tell me about the sea.", 3, 0.0, api_name="/send")
    assert raw["turn"] == 2 and turns_html.count("<tr>") == 3 and "hit rate" in tiers_html
    chat, box, turns_html, tiers_html, raw = client.predict(api_name="/undo")
    assert box == "Tell me about the sea." and len(_texts(chat)) == 2
    assert turns_html.count("<tr>") == 2 and raw["turn"] == 1, turns_html        # turn 2's row is gone
    chat, box, turns_html, tiers_html, raw = client.predict("Tell me about the mountains.", 3, 0.0, api_name="/send")
    assert raw["turn"] == 2 and turns_html.count("<tr>") == 3 and raw["reused_tokens"] > 0
    # Retry replaces the last reply: its row is replaced too, not added
    chat, box, turns_html, tiers_html, raw = client.predict(3, 0.0, api_name="/retry")
    assert raw["turn"] == 2 and turns_html.count("<tr>") == 3 and len(_texts(chat)) == 4


def test_runs_as_a_script():
    out = subprocess.run([sys.executable, "demo/app.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--model" in out.stdout and "--hidden-states" in out.stdout and "--port" in out.stdout


CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                    reason="Debian's chromium and chromium-driver are not installed "
                           "(apt-get install -y chromium chromium-driver)")
def test_page_in_headless_chromium(demo_url, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install -e '.[dev]' (selenium)")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=opts)
    try:
        driver.set_page_load_timeout(60)
        driver.get(demo_url)
        wait = WebDriverWait(driver, 60)
        box = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#shf-input textarea"))
        assert "random" in driver.find_element(By.ID, "shf-random-note").text
        for turn, msg in enumerate(["Hello! How are you today?", "Tell me about the sea."], start=1):
            box.send_keys(msg)
            box.send_keys(Keys.ENTER)
            # Streamed: the reply bubble appears, then the turn's row lands in the side panel.
            wait.until(lambda d, n=turn: len(d.find_elements(By.CSS_SELECTOR, "#shf-turns tr")) == n + 1)
        bubbles = driver.find_elements(By.CSS_SELECTOR, "#shf-chat .message")
        assert len(bubbles) >= 4 and any("Tell me about the sea." in b.text for b in bubbles)
        rows = driver.find_elements(By.CSS_SELECTOR, "#shf-turns tr")
        reused = int(rows[2].find_elements(By.TAG_NAME, "td")[3].text)
        assert reused > 0, rows[2].text
        assert driver.find_element(By.CSS_SELECTOR, "#shf-retry-temperature input")
        shots = Path(os.environ.get("STATEFUL_HF_SCREENSHOT_DIR", tmp_path))
        shots.mkdir(parents=True, exist_ok=True)
        for w, h in ((1280, 800), (1920, 1080)):
            driver.set_window_size(w, h)
            time.sleep(1.0)
            inner = driver.execute_script("return window.innerWidth")
            assert abs(inner - w) <= 20, f"the viewport is {inner} px wide, wanted {w}"
            shot = shots / f"demo-{w}x{h}.png"
            assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
            scroll, client = driver.execute_script(
                "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
            assert scroll <= client, f"{w}x{h}: the page overflows horizontally ({scroll} > {client} px)"
            # the per-turn table is entirely inside its panel (not clipped by it)
            table_right, panel_right = driver.execute_script(
                "const t = document.querySelector('table.shf-turns').getBoundingClientRect();"
                "const p = document.querySelector('#shf-side').getBoundingClientRect();"
                "return [t.right, p.right]")
            assert table_right <= panel_right + 1, f"{w}x{h}: the turns table is clipped ({table_right}, {panel_right})"
            if w == 1280 and os.environ.get("STATEFUL_HF_SCREENSHOT"):    # docs/demo.png
                assert driver.save_screenshot(os.environ["STATEFUL_HF_SCREENSHOT"])
    finally:
        driver.quit()
