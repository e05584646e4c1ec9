"""The docs site (mkdocs.yml, docs_site/hooks.py): it builds with ``--strict``, needs no network, and in
headless Chromium every page loads with nothing failing, every notebook page shows its plots (decoded:
naturalWidth > 0) and its math typeset by the vendored MathJax (no raw ``$$`` left).

One screenshot per page goes to site-screenshots/ (gitignored; MINIKV_SITE_SCREENSHOTS moves it), named in
the test output. Needs the docs extra (pip install -e '.[docs]') and Debian's chromium + chromium-driver
(apt-get install -y chromium chromium-driver); without them the tests skip, unless CI or
MINIKV_REQUIRE_BROWSER=1 is set: then they fail.
"""

from __future__ import annotations

import base64
import functools
import html.parser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.conftest import missing

ROOT = Path(__file__).resolve().parent.parent
REQUIRE = "MINIKV_REQUIRE_BROWSER"
SHOTS = Path(os.environ.get("MINIKV_SITE_SCREENSHOTS", ROOT / "site-screenshots"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Every page: docs/*.md, docs/zh/*.md, notebooks/*.ipynb, as its path in the built site (mkdocs.yml:
# use_directory_urls: false).
PAGES = ([p.with_suffix(".html").name for p in sorted((ROOT / "docs").glob("*.md"))]
         + ["zh/" + p.with_suffix(".html").name for p in sorted((ROOT / "docs" / "zh").glob("*.md"))]
         + ["notebooks/" + p.with_suffix(".html").name for p in NOTEBOOKS])
WIDTH, HEIGHT, MAX_SHOT_PX = 1280, 900, 16000
# Resources a page loads (not <a href>): any of these with http(s):// or // would need the network.
LOADED = {("script", "src"), ("img", "src"), ("iframe", "src"), ("source", "src"), ("video", "src"),
          ("audio", "src"), ("embed", "src"), ("object", "data")}
LOADED_LINK_RELS = {"stylesheet", "preload", "modulepreload", "icon", "manifest", "prefetch"}
REMOTE_IN_SCRIPT = re.compile(r"""["'`]((?:https?:)?//[^"'`\s]+?\.(?:m?js|css|woff2?|otf|ttf|json)\b[^"'`\s]*)""")
# MathJax 2 probes web-font loading with an about:blank font, which Chromium reports; nothing else may fail.
BENIGN_LOG = re.compile(r"'about:blank'|^about:blank ")
RAW_INLINE_MATH = re.compile(r"\$[^\s$][^$\n]*\$")


def expected_images(nb: Path) -> int:
    """Plots in a notebook's committed outputs."""
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    return sum(1 for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])
               if {"image/png", "image/jpeg", "image/svg+xml"} & set(o.get("data", {})))


def has_math(nb: Path) -> bool:
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    return any("$" in "".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built from scratch with ``mkdocs build --strict`` (what CI requires)."""
    for module in ("mkdocs", "material", "mkdocs_jupyter", "jupyter_server_mathjax"):
        if importlib.util.find_spec(module) is None:
            missing(f"{module} is not installed; install the docs extra: pip install -e '.[docs]'", REQUIRE)
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if "WARNING" in ln or "ERROR" in ln or "Error" in ln]
        pytest.fail("mkdocs build --strict failed:\n" + "\n".join(lines or proc.stderr.splitlines()[-30:]),
                    pytrace=False)
    return out


def test_every_page_is_built(site):
    absent = [p for p in PAGES if not (site / p).is_file()]
    assert not absent, f"pages missing from the site: {absent}"


def load_hooks():
    spec = importlib.util.spec_from_file_location("minikv_docs_hooks", ROOT / "docs_site" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_links_out_of_docs_are_rewritten_and_broken_ones_kept_for_mkdocs_to_report():
    """A link to a file outside docs/ is pointed at its copy in the site; a link to nothing is left as written,
    so MkDocs reports it and --strict fails (mkdocs.yml keeps not_found, unrecognized_links, anchors at warn)."""
    if importlib.util.find_spec("mkdocs") is None:
        missing("mkdocs is not installed; install the docs extra: pip install -e '.[docs]'", REQUIRE)
    hooks = load_hooks()
    nb = ROOT / "notebooks" / NOTEBOOKS[0].name
    hooks.SOURCE.update({"index.md": hooks.DOCS / "index.md", "zh/index.md": hooks.DOCS / "zh" / "index.md"})
    hooks.ADDED[nb] = f"notebooks/{nb.name}"
    page = f"See [it](../notebooks/{nb.name}#top), `[code](../notebooks/{nb.name})`, [gone](../no_such_file.md),\n" \
           f"[gone dir](../no_such_dir), [docs](02_kv_cache.md).\n```\n[fenced](../notebooks/{nb.name})\n```\n"
    out = hooks.map_links(page, lambda url: hooks._rewrite("index.md", url))
    assert f"[it](notebooks/{nb.name}#top)" in out
    assert f"`[code](../notebooks/{nb.name})`" in out and f"[fenced](../notebooks/{nb.name})" in out
    assert "[gone](../no_such_file.md)" in out and "[gone dir](../no_such_dir)" in out
    assert "[docs](02_kv_cache.md)" in out
    assert hooks._rewrite("zh/index.md", f"../../notebooks/{nb.name}") == f"../notebooks/{nb.name}"
    validation = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nvalidation:", 1)[1]
    for rule in ("absolute_links: warn", "unrecognized_links: warn", "anchors: warn"):
        assert rule in validation
    assert "not_found" not in validation  # MkDocs's default for it is warn


class _Refs(html.parser.HTMLParser):
    """(tag, attribute, url) of every href/src/data in a page, and whether the tag loads it."""

    def __init__(self):
        super().__init__()
        self.refs: list[tuple[str, str, bool]] = []
        self.in_script = False

    def handle_data(self, data):
        if self.in_script:  # a script that would fetch a remote file (an import(), a created <script>)
            self.refs += [("inline script", m.group(1), True) for m in REMOTE_IN_SCRIPT.finditer(data)]

    def handle_endtag(self, tag):
        self.in_script = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.in_script = tag == "script"
        rels = set((a.get("rel") or "").lower().split())
        for name in ("href", "src", "data"):
            if a.get(name):
                loads = (tag, name) in LOADED or (tag == "link" and name == "href" and bool(rels & LOADED_LINK_RELS))
                self.refs.append((tag, a[name], loads))


def refs_of(page: Path) -> list[tuple[str, str, bool]]:
    parser = _Refs()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser.refs


def html_pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if "assets" not in p.relative_to(site).parts)


def test_no_page_loads_anything_from_the_network(site):
    """No CDN: scripts, stylesheets, images, fonts all come from the site (mkdocs-jupyter's MathJax included)."""
    remote = [f"{p.relative_to(site)}: <{tag}> {url}" for p in html_pages(site) for tag, url, loads in refs_of(p)
              if loads and re.match(r"^(https?:)?//", url, re.I)]
    css = [f"{p.relative_to(site)}: {m.group(0)}" for p in site.rglob("*.css")
           for m in re.finditer(r"(url\(\s*['\"]?(https?:)?//|@import\s+['\"]?(url\()?\s*['\"]?(https?:)?//)[^)'\"]*",
                                p.read_text(encoding="utf-8", errors="replace"))]
    assert not remote + css, "the site needs the network for:\n" + "\n".join(remote + css)


def test_every_relative_link_in_the_site_resolves(site):
    """Links MkDocs does not check (the notebooks' HTML, generated pages) reach a file of the site too."""
    broken = []
    for page in html_pages(site):
        for _tag, url, _loads in refs_of(page):
            parts = urlsplit(url)
            if parts.scheme or parts.netloc or not parts.path or url.startswith("/"):
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if not (target.is_file() or (target / "index.html").is_file()):
                broken.append(f"{page.relative_to(site)} -> {url}")
    assert not broken, "links to nothing:\n" + "\n".join(sorted(set(broken)))


# ------------------------------------------------------------------------------------------- the browser

@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through chromedriver, with every host but 127.0.0.1 unresolvable (offline)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if importlib.util.find_spec("selenium") is None:
        missing("selenium is not installed; install the docs extra: pip install -e '.[docs]'", REQUIRE)
    if not (chromium and chromedriver):
        missing("Chromium is not installed: apt-get install -y chromium chromium-driver", REQUIRE)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WIDTH},{HEIGHT}", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                "--disable-extensions", "--no-first-run", "--lang=en-US"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=chromedriver))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def shots():
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    return SHOTS


STATE_JS = r"""
const article = document.querySelector("article") || document.body;
const imgs = Array.from(article.querySelectorAll("img")).map(i => ({src: i.src.slice(0, 80),
    complete: i.complete, width: i.naturalWidth, output: !!i.closest(".jp-OutputArea-output")}));
const prose = article.cloneNode(true);
prose.querySelectorAll("pre, code, script, style, .MathJax, .MathJax_Display, .MathJax_Preview, .highlight-ipynb,"
                       + " .jp-OutputArea").forEach(e => e.remove());
return {imgs: imgs, h1: (article.querySelector("h1") || {}).textContent || "", text: prose.textContent,
        math: document.querySelectorAll(".MathJax, .MathJax_Display, mjx-container").length,
        tex: document.querySelectorAll('script[type^="math/tex"]').length,
        errors: document.querySelectorAll(".MathJax_Error, merror, .noError").length};
"""

WAIT_MATHJAX_JS = """
const done = arguments[arguments.length - 1], start = Date.now();
// MathJax.isReady: its startup is over (the page's config has queued its Typeset); then wait for that queue
const tick = () => {
  if (window.MathJax && MathJax.isReady) { MathJax.Hub.Queue(() => done("ok")); }
  else if (Date.now() - start > 30000) { done(window.MathJax ? "MathJax did not start" : "MathJax did not load"); }
  else { setTimeout(tick, 50); }
};
tick();
"""


def screenshot(driver, path: Path) -> None:
    """The whole page (scaled down when it is taller than MAX_SHOT_PX), through the DevTools protocol."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    scale = min(1.0, MAX_SHOT_PX / max(height, 1))
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": WIDTH, "height": height, "scale": scale}})
    path.write_bytes(base64.b64decode(shot["data"]))


ANNOUNCED: list[Path] = []


def cjk_font() -> bool:
    fc_list = shutil.which("fc-list")
    return bool(fc_list and subprocess.run([fc_list, ":lang=zh"], capture_output=True, text=True).stdout.strip())


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_page_in_chromium(page, site, server, browser, shots, capsys):
    browser.get(server + page)
    notebook = ROOT / "notebooks" / Path(page).with_suffix(".ipynb").name if page.startswith("notebooks/") else None
    mathjax = browser.execute_async_script(WAIT_MATHJAX_JS) if notebook else "ok"
    state = browser.execute_script(STATE_JS)
    logs = [e["message"] for e in browser.get_log("browser")
            if e["level"] == "SEVERE" and not BENIGN_LOG.search(e["message"])]
    screenshot(browser, shots / (page.replace("/", "__").removesuffix(".html") + ".png"))
    if not ANNOUNCED:
        ANNOUNCED.append(shots)
        with capsys.disabled():
            print(f"\n[test_site] screenshots, one per page: {shots}/")
    if page.startswith("zh/") and not cjk_font():
        missing("no Chinese font: the zh pages would show boxes; apt-get install -y fonts-wqy-microhei", REQUIRE)

    assert not logs, f"{page}: the browser reported errors:\n" + "\n".join(logs)
    assert state["h1"].strip(), f"{page}: no <h1>"
    bad = [i for i in state["imgs"] if not (i["complete"] and i["width"] > 0)]
    assert not bad, f"{page}: images not decoded: {bad}"
    assert "$$" not in state["text"], f"{page}: raw $$ in the rendered text"
    if notebook is None:
        return
    plots = [i for i in state["imgs"] if i["output"]]
    assert len(plots) == expected_images(notebook), f"{page}: {len(plots)} plots shown, " \
        f"{expected_images(notebook)} in {notebook.name}'s outputs"
    assert mathjax == "ok", f"{page}: {mathjax}"
    if has_math(notebook):
        assert state["tex"] > 0 and state["math"] >= state["tex"], \
            f"{page}: {state['tex']} formulas found, {state['math']} typeset"
    assert state["errors"] == 0, f"{page}: {state['errors']} MathJax errors"
    raw = RAW_INLINE_MATH.findall(state["text"])
    assert not raw, f"{page}: math left untypeset: {raw[:5]}"
