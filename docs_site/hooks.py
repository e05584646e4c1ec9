"""MkDocs hooks of the minikv docs site (mkdocs.yml, ``make docs``).

The pages in docs/ link to files outside docs/: the executed notebooks (``../notebooks/X.ipynb``,
``../../notebooks/X.ipynb`` from docs/zh/), ``../exercises/README.md``, results JSON, directories. MkDocs
only knows files under docs_dir, so these hooks

* add every notebook, and every repository file or directory a page links to (followed through the Markdown
  pages and notebooks they bring in), to the site at its repository path (``notebooks/02_kv_cache.ipynb``);
  a linked directory without a README.md becomes a generated listing page;
* rewrite those links, before MkDocs validates them, to point at the added files. A link whose target does not
  exist is left as written, so MkDocs reports it and ``mkdocs build --strict`` fails on it;
* rewrite the links inside the notebooks' HTML (which MkDocs does not validate) the same way, warning on a
  target that is not in the site;
* make the notebook pages work offline: MathJax 2 comes from the PyPI package jupyter-server-mathjax (copied
  to assets/mathjax/), not from cdnjs; nbconvert's Mermaid loader is dropped from pages without diagrams and
  its ipywidgets loader (unpkg.com) from every page (a widget output, e.g. a tqdm bar, then shows nothing).

The navigation is built from globs (docs/*.md, notebooks/*.ipynb, docs/zh/*.md), never from a list of pages.
"""

from __future__ import annotations

import logging
import posixpath
import re
import shutil
from pathlib import Path
from urllib.parse import unquote

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File
from mkdocs.utils import get_relative_url

log = logging.getLogger("mkdocs.hooks.minikv")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MATHJAX_DEST = "assets/mathjax"
# jupyter-server-mathjax ships only the STIX-Web web fonts: HTML-CSS uses them, and the @font-face rules of
# the NativeMML output (in the combined config, unused in Chromium) that name TeX fonts go, else they 404.
MATHJAX_FONTS = """<script type="text/x-mathjax-config">
MathJax.Hub.Config({"HTML-CSS": {availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null,
                                  linebreaks: {automatic: true}}});
MathJax.Hub.Register.StartupHook("NativeMML Jax Config", function () {
  var styles = MathJax.OutputJax.NativeMML.config.styles;
  for (var key in styles) { if (/^@font-face/.test(key)) { delete styles[key]; } }
});
</script>"""

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+).+?\1")
INLINE_LINK = re.compile(r"(\]\(\s*<?)([^)\s>]+)")
REF_DEF = re.compile(r"^( {0,3}\[[^\]]+\]:\s*<?)(\S+?)(?=>|\s|$)")
HTML_REF = re.compile(r"""(\s(?:href|src)=")([^"]+)(")""")
# mkdocs.yml sets mkdocs-jupyter's custom_mathjax_url to this site-root path; each page gets it relative.
VENDORED_MATHJAX = re.compile(r"""<script src="(assets/mathjax/MathJax\.js[^"]*)">\s*</script>""")
MERMAID_LOADER = re.compile(r"""<script type="module">(?:(?!</script>).)*?mermaid(?:(?!</script>).)*</script>""",
                            re.S)
# nbconvert's loader of the ipywidgets renderer (unpkg.com): the notebooks' widget outputs are tqdm bars.
WIDGETS_LOADER = re.compile(r"""<script>(?:(?!</script>).)*?addWidgetsRenderer(?:(?!</script>).)*</script>""", re.S)
SKIP_NAMES = {"__pycache__", ".ipynb_checkpoints"}

# Filled by on_files: site src_uri -> the real path it stands for (docs pages, added files, listing pages),
# and real path -> src_uri for everything outside docs/ (a directory maps to its README or listing page).
SOURCE: dict[str, Path] = {}
ADDED: dict[Path, str] = {}


# ---------------------------------------------------------------------------------------------- Markdown links

def map_prose(text: str, fn) -> str:
    """``text`` with ``fn`` applied to every stretch of prose: fenced code blocks and code spans stay as written."""
    out, fence = [], None
    for line in text.splitlines(keepends=True):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            out.append(line)
            continue
        if m:
            fence = m.group(1)
            out.append(line)
            continue
        pos = 0
        for span in CODE_SPAN.finditer(line):
            out += [fn(line[pos:span.start()]), span.group(0)]
            pos = span.end()
        out.append(fn(line[pos:]))
    return "".join(out)


def map_links(text: str, fn) -> str:
    """``text`` with every Markdown link/image target and reference definition in prose replaced by ``fn(url)``."""
    def prose(s: str) -> str:
        s = INLINE_LINK.sub(lambda m: m.group(1) + fn(m.group(2)), s)
        return REF_DEF.sub(lambda m: m.group(1) + fn(m.group(2)), s)
    return map_prose(text, prose)


def relative_target(url: str) -> tuple[str, str] | None:
    """``(path, '#anchor' or '')`` of a relative link to a file, None for URLs, absolute paths and anchors."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", url, re.I) or url.startswith(("/", "#", "\\")):
        return None
    path, sep, anchor = url.partition("#")
    path = path.partition("?")[0]
    return (unquote(path), sep + anchor) if path else None


def resolve(base: Path, url: str) -> tuple[Path, str] | None:
    """The real path a relative ``url`` written in the file ``base`` points at, and its anchor."""
    target = relative_target(url)
    if target is None:
        return None
    return Path(posixpath.normpath((base.parent / target[0]).as_posix())), target[1]


def markdown_of(path: Path) -> str:
    """The Markdown of a page: a .md file's text, or a notebook's Markdown cells."""
    if path.suffix == ".ipynb":
        import json

        cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
        return "\n\n".join("".join(c["source"]) for c in cells if c.get("cell_type") == "markdown")
    return path.read_text(encoding="utf-8") if path.suffix == ".md" else ""


# ------------------------------------------------------------------------------------- files outside docs/

def inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def site_uri(real: Path) -> str | None:
    """The site src_uri of a real file: its path under docs/, or the uri it was added under."""
    if inside(real, DOCS) and real.is_file():
        return real.relative_to(DOCS).as_posix()
    return ADDED.get(real)


def mirror_uri(real: Path, taken: set[str]) -> str:
    """Where a repository file outside docs/ goes: its repository path, or repo/<path> if docs/ holds that."""
    uri = real.relative_to(ROOT).as_posix()
    clash = uri in taken or (real.name == "README.md" and posixpath.join(posixpath.dirname(uri), "index.md") in taken)
    return "repo/" + uri if clash else uri


def add(real: Path, taken: set[str], queue: list[Path], listings: dict[Path, str]) -> None:
    """Bring ``real`` (a file or directory outside docs/) into the site; queue the pages whose links to follow."""
    if real in ADDED or not inside(real, ROOT) or inside(real, DOCS) or not real.exists():
        return
    if real.is_dir():
        readme = next((real / n for n in ("README.md", "index.md") if (real / n).is_file()), None)
        if readme is not None:
            add(readme, taken, queue, listings)
            ADDED[real] = ADDED[readme]
            return
        ADDED[real] = mirror_uri(real / "index.md", taken)
        listings[real] = ADDED[real]
        for child in sorted(real.iterdir()):
            if child.is_file() and not child.name.startswith(".") and child.name not in SKIP_NAMES:
                add(child, taken, queue, listings)
        return
    ADDED[real] = mirror_uri(real, taken)
    if real.suffix in (".md", ".ipynb"):
        queue.append(real)


def listing(real: Path, uri: str) -> str:
    """A generated page for a linked directory that has no README.md: a list of its files."""
    rel = real.relative_to(ROOT).as_posix()
    lines = [f"# {rel}/", "", f"The files of the repository directory `{rel}/`.", ""]
    for child in sorted(real.iterdir()):
        if child in ADDED:
            lines.append(f"- [{child.name}]({posixpath.relpath(ADDED[child], posixpath.dirname(uri))})")
    return "\n".join(lines) + "\n"


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns the added notebooks into pages
def on_files(files, config):
    SOURCE.clear()
    ADDED.clear()
    taken = {f.src_uri for f in files}
    for f in files.documentation_pages():
        SOURCE[f.src_uri] = Path(f.abs_src_path)
    queue: list[Path] = list(SOURCE.values())
    listings: dict[Path, str] = {}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        add(nb, taken, queue, listings)
    while queue:
        page = queue.pop(0)
        for url in _links(markdown_of(page)):
            target = resolve(page, url)
            if target is not None:
                add(target[0], taken, queue, listings)
    for real, uri in sorted(ADDED.items()):
        if real in listings:
            files.append(File.generated(config, uri, content=listing(real, uri)))
            SOURCE[uri] = real / "index.md"
        elif real.is_file():
            if uri == real.relative_to(ROOT).as_posix():  # a real File: mkdocs-jupyter's wrapper needs src_dir
                files.append(File(uri, str(ROOT), config.site_dir, config.use_directory_urls))
            else:
                files.append(File.generated(config, uri, abs_src_path=str(real)))
            SOURCE[uri] = real
    return files


def _links(text: str) -> list[str]:
    found: list[str] = []
    map_links(text, lambda url: found.append(url) or url)
    return found


def _rewrite(page_uri: str, url: str, files=None, page_url: str = "") -> str:
    """The link ``url`` of the page ``page_uri`` pointed at the target's place in the site.

    With ``files`` (the notebooks' HTML) the result is a URL relative to ``page_url``; without, a src path
    relative to the page that MkDocs then validates and converts. A target that does not exist stays as written.
    """
    real = SOURCE.get(page_uri)
    target = resolve(real, url) if real is not None else None
    if target is None:
        return url
    path, anchor = target
    uri = site_uri(path)
    if files is None:
        if uri is None or (inside(path, DOCS) and inside(real, DOCS)):
            return url  # a docs page linking inside docs/ (MkDocs checks it) or a missing target (MkDocs reports it)
        return posixpath.relpath(uri, posixpath.dirname(page_uri) or ".") + anchor
    file = files.get_file_from_path(uri) if uri else None
    if file is None:
        log.warning("Notebook '%s' links to '%s', which is not in the site.", page_uri, url)
        return url
    return get_relative_url(file.url, page_url) + anchor


# ------------------------------------------------------------------------------------------------- pages

def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.endswith(".ipynb"):
        return markdown
    return map_links(markdown, lambda url: _rewrite(page.file.src_uri, url))


def on_page_content(html, page, config, files):
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    def link(m: re.Match) -> str:
        url = m.group(2)
        if not url.startswith(MATHJAX_DEST):
            url = _rewrite(page.file.src_uri, url, files, page.url)
        return m.group(1) + url + m.group(3)
    html = HTML_REF.sub(link, html)
    def local(m: re.Match) -> str:
        path, _, query = m.group(1).partition("?")
        return f'{MATHJAX_FONTS}\n<script src="{get_relative_url(path, page.url)}?{query}"></script>'
    html, n = VENDORED_MATHJAX.subn(local, html)
    if n != 1:
        log.warning("Notebook '%s': expected one <script src=\"assets/mathjax/MathJax.js...\"> (mkdocs.yml "
                    "custom_mathjax_url), found %d.", page.file.src_uri, n)
    if not re.search(r'class="[^"]*\bjp-Mermaid\b', html):  # no diagram (the loader names the class too)
        html = MERMAID_LOADER.sub("", html)
    html, n = WIDGETS_LOADER.subn("", html)
    if n:
        log.info("Notebook '%s': widget outputs shown without the ipywidgets renderer (unpkg.com).",
                 page.file.src_uri)
    return html


def on_post_page(output, page, config):
    if page.file.src_uri.startswith("zh/"):  # the Chinese edition: lang="zh" (CJK glyph choice, screen readers)
        output = re.sub(r'<html lang="[^"]*"', '<html lang="zh"', output, count=1)
    return output


def on_post_build(config):
    import jupyter_server_mathjax

    src = Path(jupyter_server_mathjax.__file__).parent / "static"
    shutil.copytree(src, Path(config.site_dir) / MATHJAX_DEST, dirs_exist_ok=True)


# -------------------------------------------------------------------------------------------- navigation

def nav() -> list:
    """English pages (home, the steps in order, the rest), the notebooks, then the Chinese edition."""
    def pages(folder: Path, prefix: str) -> list:
        found = sorted(folder.glob("*.md"), key=lambda p: (p.stem != "index", not p.stem[:1].isdigit(), p.stem))
        return [prefix + p.name for p in found]
    notebooks = ["notebooks/" + p.name for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    return [*pages(DOCS, ""), {"Notebooks": notebooks}, {"中文": pages(DOCS / "zh", "zh/")}]


def on_config(config):
    if not config.nav:
        config.nav = nav()
    return config
