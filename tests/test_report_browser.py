"""report.html in a real browser (headless Chromium, offline): no console errors, every plot
drawn with a size, the trials table sorts by a click on its header; a full-page screenshot
goes to tests/artifacts/report.png for a human to look at."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("selenium", reason="the browser test needs selenium (pip install -e '.[test]')")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

from autotune.report.render import write_report
from conftest import ROOT
from test_report import load, tiny_search

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOT = ROOT / "tests" / "artifacts" / "report.png"

pytestmark = [pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver): "
           "apt-get install chromium chromium-driver"),
    pytest.mark.slow]  # the report comes from one real search (test_report.tiny_search) and a browser


@pytest.fixture(scope="module")
def browser(tiny_cpu_search, tmp_path_factory):
    out = tiny_search(tiny_cpu_search, tmp_path_factory)
    study, config = load(out)
    files = write_report(study, out, config)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        driver.set_window_size(1280, 1000)
        driver.get(files["report.html"].resolve().as_uri())
        driver.study = study
        driver.report_page = files["report.html"]
        yield driver
    finally:
        driver.quit()


def _open(driver, page: Path) -> None:
    driver.set_window_size(1280, 1000)
    driver.get(page.resolve().as_uri())


@pytest.fixture(scope="module")
def wide_reports(tmp_path_factory):
    """The committed reports whose tables spilled out of their boxes, written afresh: gpt2-h200 (reasons
    of up to 345 characters, squeezed to a six-character column) and resnet50-h200-24gib (a mangled
    kernel name of 1,676 characters on one line: a 12,680 px table)."""
    import shutil

    import optuna

    pages = {}
    for name in ("gpt2-h200", "resnet50-h200-24gib"):
        out = tmp_path_factory.mktemp(name)
        for f in ("study.db", "config.json"):
            shutil.copy(ROOT / "reports" / name / f, out / f)
        study, config = load(out)
        pages[name] = write_report(study, out, config)["report.html"]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return pages


_BOXES = """
const main = document.querySelector('main').getBoundingClientRect();
return {
  page: [document.documentElement.scrollWidth, window.innerWidth],
  main: [main.left, main.right],
  wraps: Array.from(document.querySelectorAll('.table-wrap')).map(w => {
    const r = w.getBoundingClientRect();
    return [w.querySelector('table').id || w.querySelector('table').className, r.left, r.right,
            w.clientWidth, w.scrollWidth, getComputedStyle(w).overflowX];
  }),
  reasons: Array.from(document.querySelectorAll('#trials td.reason')).filter(td => td.textContent.length > 80)
    .map(td => td.getBoundingClientRect().width),
  kernels: Array.from(document.querySelectorAll('table.kernels')).map(t => [t.getBoundingClientRect().width,
    t.closest('.table-wrap').clientWidth]),
};
"""


@pytest.mark.parametrize("name", ["gpt2-h200", "resnet50-h200-24gib"])
def test_wide_tables_stay_in_their_boxes(browser, wide_reports, name):
    _open(browser, wide_reports[name])
    try:
        boxes = browser.execute_script(_BOXES)
    finally:  # the other tests read the tiny search's page
        _open(browser, browser.report_page)
    width, viewport = boxes["page"]
    assert width <= viewport, f"the page scrolls sideways: {width} px in a {viewport} px window"
    left, right = boxes["main"]
    for table, box_left, box_right, inner, content, overflow in boxes["wraps"]:
        # every table inside its box, within the page's column; a wider one scrolls inside its box
        assert left - 1 <= box_left and box_right <= right + 1, (table, box_left, box_right, left, right)
        assert content <= inner or overflow in ("auto", "scroll"), (table, inner, content, overflow)
    # a long reason reads as lines of words, not a column a few characters wide
    assert all(w >= 200 for w in boxes["reasons"]), boxes["reasons"]
    if name == "gpt2-h200":
        assert boxes["reasons"], "gpt2-h200 has reasons of more than 80 characters"
    else:
        assert boxes["kernels"]
        for table_width, box_width in boxes["kernels"]:  # a kernel's name breaks: no sideways scroll
            assert table_width <= box_width + 1, (table_width, box_width)


def column(driver, key: str) -> list[float | None]:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#trials tbody td[data-key=\"' + arguments[0] + '\"]'))"
        ".map(td => td.dataset.value === '' ? null : parseFloat(td.dataset.value));", key)


def expected(values: list[float | None], descending: bool) -> list[float | None]:
    """The order the page promises: numeric, empty cells last either way."""
    present = sorted((v for v in values if v is not None), reverse=descending)
    return present + [None] * (len(values) - len(present))


def test_every_plot_is_drawn(browser):
    boxes = browser.execute_script(
        "return Array.from(document.querySelectorAll('.plot svg')).map(svg => {"
        "  const r = svg.getBoundingClientRect();"
        "  return [svg.closest('.plot').dataset.plot, r.width, r.height]; });")
    assert {"throughput-memory", "knob-precision-memory_format", "batch-size"} <= {name for name, _, _ in boxes}
    for name, width, height in boxes:
        assert width > 50 and height > 50, (name, width, height)


def test_clicking_a_header_sorts_the_table(browser):
    header = browser.find_element(By.CSS_SELECTOR, '#trials th[data-key="samples_per_s"]')
    before = column(browser, "samples_per_s")
    assert len(before) == len(browser.study.trials)
    assert sum(v is not None for v in before) >= 2
    header.click()
    first = column(browser, "samples_per_s")
    direction = header.get_attribute("aria-sort")
    assert direction in ("ascending", "descending")
    assert first == expected(before, descending=direction == "descending")
    header.click()
    second = column(browser, "samples_per_s")
    assert header.get_attribute("aria-sort") == ("ascending" if direction == "descending" else "descending")
    assert second == expected(before, descending=direction != "descending")
    # the rows move whole: each row's trial number still goes with its own figures
    numbers = browser.execute_script(
        "return Array.from(document.querySelectorAll('#trials tbody tr')).map(tr => +tr.dataset.number);")
    rates = {t.number: t.user_attrs.get("figures", {}).get("samples_per_s") for t in browser.study.trials}
    assert [rates[n] for n in numbers] == pytest.approx(second)
    browser.find_element(By.CSS_SELECTOR, '#trials th[data-key="number"]').click()  # back to trial order
    browser.find_element(By.CSS_SELECTOR, '#trials th[data-key="number"]').click()


def test_full_page_screenshot(browser):
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    height, chrome = browser.execute_script(
        "return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight]")
    browser.set_window_size(1280, height + chrome)  # the viewport holds the whole page
    browser.execute_script("window.scrollTo(0, 0)")
    assert browser.save_screenshot(str(SCREENSHOT))
    assert SCREENSHOT.stat().st_size > 20_000


def test_no_console_errors(browser):
    # last, so errors raised by the clicks above count too
    severe = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert severe == []
