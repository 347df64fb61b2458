"""A headless Chromium driven by Selenium: what the labelling page's browser test and the
UI check (`python -m tests.ui_check`) look at pages with.

The browser is the system's (Debian's `chromium` and `chromium-driver`, which
scripts/setup.sh installs with apt when it runs as root); selenium comes with the `test`
extra. Nothing here downloads a browser or a driver.
"""

from __future__ import annotations

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL_HINT = (
    "install Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; "
    "scripts/setup.sh does as root) and selenium (pip install -e .[test])"
)


def missing_browser() -> list[str]:
    """What a headless browser session lacks here (paths or the selenium package); empty when
    one can start."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium")
    return missing


def headless_chromium(profile_dir: str | Path, width: int = 1280, height: int = 900):
    """A Selenium driver for a headless Chromium with its profile in `profile_dir`, no
    network of its own (no sync, updates or background requests). The caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    missing = missing_browser()
    if missing:
        raise RuntimeError(f"no headless browser ({', '.join(missing)} missing): {INSTALL_HINT}")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        # Software WebGL: Prefect's run graph is drawn on a WebGL canvas.
        "--enable-unsafe-swiftshader",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        f"--user-data-dir={Path(profile_dir).resolve()}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    return driver
