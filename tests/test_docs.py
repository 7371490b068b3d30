"""The docs check: README.md and every docs/**/*.md must not name what does not exist.

Conventions the pages follow (and this module enforces). Text inside fenced code blocks and
HTML comments is not checked, except for the runnable blocks of rule 4.

1. **Links.** Every relative link or image target -- ``[text](target)``, ``![alt](target)``,
   a reference definition ``[ref]: target`` and an HTML ``href="..."``/``src="..."`` --
   resolves, relative to the page's own folder, to an existing file or folder. Targets with a
   scheme (``https:``, ``mailto:``) are not checked; a target starting with ``/`` is an error
   (write it relative). An anchor ``#frag`` on a Markdown target must be one of that page's
   heading anchors, made the way GitHub makes them (lower case; characters other than letters,
   digits, ``-``, ``_`` and spaces dropped; spaces become ``-``; a repeated heading gets
   ``-1``, ``-2``, ...), or an explicit ``id="..."``/``name="..."``. An anchor on any other
   file must be a GitHub line anchor, ``#L12`` or ``#L12-L30``.
2. **Paths in code spans.** A code span that is one path with a ``/`` -- ``csrc/core/coll.c``,
   ``backends/tcp/``, ``.ci/run``, ``benchmarks/results/*.json`` -- is a path from the
   repository root and must exist (a glob must match something). It is checked when its first
   part is an entry of the repository root, or when its last part has a file extension (then
   a ``.c``/``.h`` path may also be relative to ``csrc/``, ``csrc/include/`` or
   ``csrc/include/xccl/``, as the sources include them: ``algo/algo.h``). A ``:123`` line
   suffix is ignored. Spans with spaces, ``$``, ``~``, a leading ``/`` or ``://`` are not
   paths (commands, variables, system paths, URLs) and are not checked. A file of another
   project is written with that project's name first, ``nccl:src/proxy.cc``: not checked.
3. **Functions.** A function (or macro, or type) is named in one of two ways, and then must be
   defined or declared in that file:

   - a code span ``path: name`` (or ``path: name()``), e.g. ``csrc/core/coll.c: coll_post``,
     with the path as in rule 2;
   - a link whose whole text is one code span naming an identifier (other than the target's
     own file name, ``[`coll.c`](../csrc/core/coll.c)``), with a ``.c``, ``.h`` or
     ``.py`` target, e.g. ``[`coll_post`](../csrc/core/coll.c)`` (target as in rule 1).

   In C, "defined or declared" means a line that starts in column 0 (not a comment or a
   preprocessor line) and contains ``name(``, a ``#define name``, a ``struct``/``union``/
   ``enum name`` in column 0, or a ``typedef`` ending in ``name;`` or ``} name;``. In Python:
   ``def name``, ``class name`` or a module-level ``name =``/``name:``; a dotted
   ``Class.method`` is checked by its last part. A link text that is not an identifier (a
   path, a call with arguments) is not a function reference.
4. **Runnable blocks.** A fenced ``bash`` block directly after a line ``<!-- docs:run -->``
   runs with ``bash -eo pipefail`` from the repository root, importing the same ``xccl`` as
   this suite (its directory first on ``PYTHONPATH``), and must exit 0 within
   ``RUN_TIMEOUT_S``. Mark only fast commands without
   side effects (no installs, no files written); the quick start and the test command are
   run by CI already and must not be marked. A marker not followed by a ``bash`` fence is an
   error.

The unit tests at the end run the checker on small pages in a scratch repository, so that
each rule is seen to fail.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import signal
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_MARKER = "<!-- docs:run -->"
RUN_TIMEOUT_S = 20.0
C_INCLUDE_ROOTS = ("", "csrc/", "csrc/include/", "csrc/include/xccl/")
C_EXTS = (".c", ".h")
FUNC_EXTS = (".c", ".h", ".py")

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
# a code span on one paragraph: never across a blank line
_CODE = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)
_LINK = re.compile(
    r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>\n]*>|[^\s()]+(?:\([^\s()]*\)[^\s()]*)*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"
)
_REFDEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>\n]*>|\S+)", re.M)
_HTML_ATTR = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""")
_HTML_ID = re.compile(r"""\b(?:id|name)\s*=\s*["']([^"']+)["']""")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t#]*$", re.M)
_SETEXT = re.compile(r"^(?! {4})(\S.*)\n {0,3}(=+|-+)[ \t]*$", re.M)
_IDENT = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
_PATH = re.compile(r"^\.?[\w.\-*]+(?:/[\w.\-*]*)+$")
_FUNC_SPAN = re.compile(r"^(\S+\.(?:c|h|py)):\s+([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(\))?$")
_LINE_ANCHOR = re.compile(r"^L\d+(?:-L\d+)?$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    runnable: bool


def _mask(text: str, spans: list[tuple[int, int]], keep_newlines: bool = True) -> str:
    """text with the given [start, end) spans replaced by spaces (newlines kept)."""
    out = list(text)
    for start, end in spans:
        for i in range(start, end):
            if not (keep_newlines and out[i] == "\n"):
                out[i] = " "
    return "".join(out)


def parse_blocks(text: str) -> tuple[list[Block], list[tuple[int, int]], list[str]]:
    """The fenced blocks, their character spans, and marker errors."""
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln))
    blocks, spans, errors = [], [], []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            if lines[i].strip() == RUN_MARKER:
                nxt = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
                if not nxt or nxt.group(2) != "bash":
                    errors.append(f"line {i + 1}: {RUN_MARKER} is not followed by a ```bash block")
            i += 1
            continue
        fence, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines):
            close = lines[j].strip()
            if close.startswith(fence[0] * len(fence)) and set(close) == {fence[0]}:
                break
            j += 1
        runnable = i > 0 and lines[i - 1].strip() == RUN_MARKER
        blocks.append(Block(i + 1, lang, "".join(lines[i + 1 : j]), runnable))
        spans.append((offsets[i], offsets[min(j + 1, len(lines))]))
        i = j + 1
    return blocks, spans, errors


def _strip_inline(md: str) -> str:
    """A heading's text as rendered: no code ticks, link targets, images, tags or stars."""
    md = re.sub(r"!\[([^\]]*)\]\([^)]*\)", "", md)
    md = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", md)
    md = re.sub(r"<[^>]+>", "", md)
    return md.replace("`", "").replace("*", "")


def github_slug(heading: str) -> str:
    text = _strip_inline(heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page offers: its headings' GitHub slugs and explicit ids."""
    _, spans, _ = parse_blocks(text)
    body = _mask(text, spans)
    headings = [(m.start(), m.group(2)) for m in _HEADING.finditer(body)]
    headings += [(m.start(), m.group(1)) for m in _SETEXT.finditer(body)]
    seen: dict[str, int] = {}
    out = set()
    for _, heading in sorted(headings):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    out.update(_HTML_ID.findall(body))
    return out


def c_defines(source: str, name: str) -> bool:
    n = re.escape(name)
    patterns = [
        rf"^(?![ \t/*#])[^\n]*\b{n}\s*\(",  # a definition or prototype in column 0
        rf"^[ \t]*#[ \t]*define[ \t]+{n}\b",
        rf"^(?:typedef[ \t]+)?(?:struct|union|enum)[ \t]+{n}\b",
        rf"^typedef\b[^;]*\b{n}[ \t]*;",
        rf"^\}}[ \t]*{n}[ \t]*;",
    ]
    return any(re.search(p, source, re.M) for p in patterns)


def py_defines(source: str, name: str) -> bool:
    n = re.escape(name.rsplit(".", 1)[-1])
    patterns = [
        rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{n}\b",
        rf"^[ \t]*class[ \t]+{n}\b",
        rf"^{n}[ \t]*[:=]",
    ]
    return any(re.search(p, source, re.M) for p in patterns)


def defines(path: Path, name: str) -> bool:
    source = path.read_text(encoding="utf-8", errors="replace")
    return py_defines(source, name) if path.suffix == ".py" else c_defines(source, name)


def resolve_repo_path(token: str, root: Path) -> Path | None | bool:
    """Rule 2: the existing path a code span names; None if missing; False if not a path."""
    token = re.sub(r":\d+(?:-\d+)?$", "", token)
    if "://" in token or not _PATH.match(token):
        return False
    parts = token.rstrip("/").split("/")
    has_ext = bool(re.search(r"\.[A-Za-z]\w*$", parts[-1])) and not token.endswith("/")
    if not (os.path.lexists(root / parts[0]) or has_ext):
        return False
    prefixes = C_INCLUDE_ROOTS if token.endswith(C_EXTS) else ("",)
    for prefix in prefixes:
        candidate = root / (prefix + token)
        if "*" in token:
            if glob.glob(str(candidate)):
                return candidate
        elif candidate.exists():
            return candidate
    return None


def path_name(target: str) -> str:
    """The file name a link target points at (``../csrc/core/coll.c#L3`` -> ``coll.c``)."""
    return target.split("#", 1)[0].rstrip("/").rsplit("/", 1)[-1]


def check_markdown(page: Path, root: Path = ROOT) -> list[str]:
    """Every broken link, anchor, path and function name on one page (rules 1-3)."""
    text = page.read_text(encoding="utf-8")
    rel = page.relative_to(root)
    _, block_spans, errors = parse_blocks(text)
    errors = [f"{rel}: {e}" for e in errors]
    body = _mask(text, block_spans + [m.span() for m in _COMMENT.finditer(text)])
    codes = list(_CODE.finditer(body))
    # link syntax inside code spans is not a link: hide the spans' insides from the link scan
    scan = _mask(body, [(m.start(2), m.end(2)) for m in codes])

    def where(pos: int) -> str:
        return f"{rel}:{text.count(chr(10), 0, pos) + 1}"

    def target_path(target: str) -> tuple[Path | None, str]:
        target = target.strip("<>")
        path_part, _, frag = target.partition("#")
        path_part = urllib.parse.unquote(path_part)
        return (page.parent / path_part if path_part else page), frag

    def check_target(target: str, pos: int) -> Path | None:
        if _SCHEME.match(target) or target.startswith("//"):
            return None
        if target.startswith("/"):
            errors.append(f"{where(pos)}: link {target!r} starts with '/': make it relative")
            return None
        path, frag = target_path(target)
        if not path.exists():
            errors.append(f"{where(pos)}: link target {target!r} does not exist")
            return None
        if frag:
            if path.suffix == ".md":
                if frag.lower() not in anchors(path.read_text(encoding="utf-8")):
                    errors.append(f"{where(pos)}: no heading anchor #{frag} in {path.name}")
            elif not _LINE_ANCHOR.match(frag):
                errors.append(f"{where(pos)}: anchor #{frag} on a non-Markdown file: use #L<n>")
        return path

    def scan_links(start: int, end: int) -> None:
        for m in _LINK.finditer(scan, start, end):
            path = check_target(m.group(3), m.start())
            label = text[m.start(2) : m.end(2)].strip()
            fm = re.fullmatch(r"`([A-Za-z_][\w.]*)(?:\(\))?`", label)
            is_name = fm is not None and fm.group(1) != path_name(m.group(3))  # not [`a.c`](a.c)
            if path is not None and is_name and path.suffix in FUNC_EXTS and path.is_file():
                if not defines(path, fm.group(1)):
                    errors.append(
                        f"{where(m.start())}: {fm.group(1)} is not defined or "
                        f"declared in {m.group(3)}"
                    )
            scan_links(m.start(2), m.end(2))  # an image inside a link's text

    scan_links(0, len(scan))
    for m in _REFDEF.finditer(scan):
        check_target(m.group(1), m.start())
    for m in _HTML_ATTR.finditer(scan):
        check_target(m.group(1), m.start())

    for m in codes:
        token = m.group(2).strip()
        fm = _FUNC_SPAN.match(token)
        if fm:
            path = resolve_repo_path(fm.group(1), root)
            if not path:
                errors.append(f"{where(m.start())}: no file {fm.group(1)!r} (in `{token}`)")
            elif not defines(path, fm.group(2)):
                errors.append(
                    f"{where(m.start())}: {fm.group(2)} is not defined or declared in {fm.group(1)}"
                )
            continue
        if resolve_repo_path(token, root) is None:
            errors.append(f"{where(m.start())}: path `{token}` does not exist")
    return errors


def run_block(code: str, root: Path = ROOT, timeout: float = RUN_TIMEOUT_S) -> str | None:
    """Rule 4: None if the block exits 0 in time, else what went wrong."""
    env = dict(os.environ)
    # the xccl this suite tests (installed, or the tree's python/ on PYTHONPATH), not whatever
    # python/ holds: a fresh clone's python/xccl has no built extension
    spec = importlib.util.find_spec("xccl")
    pkg_dir = str(Path(spec.origin).parent.parent) if spec and spec.origin else None
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_dir, env.get("PYTHONPATH")) if p)
    # its own session, so that a timeout ends everything the block started
    proc = subprocess.Popen(
        ["bash", "-eo", "pipefail", "-c", code],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"did not finish in {timeout:g} s"
    if proc.returncode != 0:
        return f"exit status {proc.returncode}\n{out[-2000:]}{err[-2000:]}"
    return None


def doc_pages(root: Path = ROOT) -> list[Path]:
    pages = [root / "README.md"] + sorted((root / "docs").rglob("*.md"))
    return [p for p in pages if p.is_file()]


def runnable_blocks(root: Path = ROOT) -> list[tuple[str, Block]]:
    out = []
    for page in doc_pages(root):
        blocks, _, _ = parse_blocks(page.read_text(encoding="utf-8"))
        out += [(f"{page.relative_to(root)}:{b.line}", b) for b in blocks if b.runnable]
    return out


# --------------------------------------------------------------------------- the real pages


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_references(page: Path) -> None:
    errors = check_markdown(page)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(
    "where,block", runnable_blocks(), ids=lambda v: v if isinstance(v, str) else None
)
def test_runnable_block(where: str, block: Block) -> None:
    error = run_block(block.code)
    assert error is None, f"{where}: {error}\n{block.code}"


def test_readme_links_every_docs_page() -> None:
    """A page nobody links to is a page nobody finds: the README links each one."""
    readme = (ROOT / "README.md").read_text()
    linked = {path_name(m.group(3)) for m in _LINK.finditer(readme) if "docs/" in m.group(3)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"not linked from README.md: {sorted(pages - linked)}"


def test_some_block_is_runnable() -> None:
    assert runnable_blocks(), f"no {RUN_MARKER} block in README.md or docs/"


# --------------------------------------------------------------------------- the checker itself


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "csrc" / "core").mkdir(parents=True)
    (tmp_path / "csrc" / "algo").mkdir()
    (tmp_path / "csrc" / "core" / "coll.c").write_text(
        "/* coll.c */\n#define COLL_MAX 4\n"
        "static xccl_status_t coll_post(int a,\n                             int b)\n{\n"
        "    return helper(a);\n}\n\nint\ncoll_wait(void);\n"
        "typedef struct coll_s {\n    int x;\n} coll_t;\n"
    )
    (tmp_path / "csrc" / "algo" / "algo.h").write_text("int algo_find(const char *name);\n")
    (tmp_path / "python").mkdir()
    (tmp_path / "python" / "mod.py").write_text(
        "LIMIT = 3\n\n\nclass Work:\n    def wait(self):\n        pass\n"
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text(
        "# Other page\n\n## The `ring` (v2)\n\n## A\n\n## A\n"
    )
    return tmp_path


def _check(repo: Path, md: str, name: str = "docs/page.md") -> list[str]:
    page = repo / name
    page.write_text(md)
    return check_markdown(page, repo)


def test_checker_accepts_good_references(repo: Path) -> None:
    md = (
        "# Page\n\nSee [other](other.md), [its ring](other.md#the-ring-v2), [again](other.md#a-1),"
        " [here](#page), [up](../csrc/core/coll.c#L3-L5) and ![fig](other.md).\n"
        "Files: `csrc/core/coll.c`, `csrc/core/`, `csrc/*/coll.c`, `algo/algo.h`, `coll.c`,\n"
        "`csrc/core/coll.c:12`, `make -C tests/c`, `env://`, `/dev/shm`, `lo/hi`.\n"
        "Functions: `csrc/core/coll.c: coll_post`, `csrc/core/coll.c: coll_wait()`,\n"
        "`algo/algo.h: algo_find`, [`COLL_MAX`](../csrc/core/coll.c), [`coll_t`]"
        "(../csrc/core/coll.c), [`Work.wait`](../python/mod.py), [`LIMIT`](../python/mod.py),\n"
        "[`coll.c`](../csrc/core/coll.c) and [`mod.py`](../python/mod.py) (file names).\n"
        "A link [wrapped over\ntwo lines](https://example.com/x) and `[not](a-link.md)`.\n\n"
        "```bash\ncat [no](link.md) `csrc/nothing.c`\n```\n<!-- [hidden](missing.md) -->\n"
    )
    assert _check(repo, md) == []


def test_checker_finds_broken_link(repo: Path) -> None:
    errors = _check(repo, "# T\n\nSee [the page](missing.md) and ![img](img/none.png).\n")
    assert len(errors) == 2 and "missing.md" in errors[0] and "img/none.png" in errors[1]
    assert errors[0].startswith("docs/page.md:3:")


def test_checker_finds_broken_nested_reference_and_html_links(repo: Path) -> None:
    md = '[![badge](nope.png)](other.md)\n\n[r]: gone.md\n\n<img src="img/x.png" alt="x">\n'
    errors = _check(repo, md)
    assert len(errors) == 3, errors
    report = "\n".join(errors)
    assert "'nope.png'" in report and "'gone.md'" in report and "'img/x.png'" in report


def test_checker_finds_broken_anchor(repo: Path) -> None:
    errors = _check(
        repo,
        "# T\n\n[a](other.md#nope), [b](#t), [c](#missing), "
        "[d](../csrc/core/coll.c#coll_post), [e](/README.md)\n",
    )
    assert len(errors) == 4, errors
    assert "#nope" in errors[0] and "#missing" in errors[1] and "#L" in errors[2]
    assert "relative" in errors[3]


def test_checker_finds_missing_path(repo: Path) -> None:
    errors = _check(repo, "Files: `csrc/core/colll.c`, `backends/none/`, `docs/x.md`.\n")
    assert [e.split("path ")[1] for e in errors] == [
        "`csrc/core/colll.c` does not exist",
        "`docs/x.md` does not exist",
    ]  # `backends/none/`: no root entry `backends` and no extension, so not a path


def test_checker_finds_missing_function(repo: Path) -> None:
    md = (
        "`csrc/core/coll.c: coll_start`, `csrc/core/coll.c: helper`, `csrc/core/nope.c: f`,\n"
        "[`coll_finish`](../csrc/core/coll.c), [`Work.result`](../python/mod.py).\n"
    )
    errors = _check(repo, md)
    assert len(errors) == 5, errors
    report = "\n".join(errors)
    assert "coll_start is not defined" in report
    assert "helper is not defined" in report  # only called, indented: not a definition
    assert "no file 'csrc/core/nope.c'" in report
    assert "coll_finish is not defined" in report and "Work.result is not defined" in report


def test_checker_finds_stray_marker(repo: Path) -> None:
    errors = _check(repo, f"{RUN_MARKER}\n```python\nprint(1)\n```\n")
    assert len(errors) == 1 and "not followed" in errors[0]


def test_runnable_blocks_run(repo: Path) -> None:
    (repo / "README.md").write_text(
        f"# R\n\n{RUN_MARKER}\n```bash\ntest -f csrc/core/coll.c\n```\n\n"
        "```bash\nfalse  # not marked\n```\n"
    )
    (repo / "docs" / "fail.md").write_text(f"{RUN_MARKER}\n```bash\nfalse | true\necho hi\n```\n")
    found = runnable_blocks(repo)
    assert [w for w, _ in found] == ["README.md:4", "docs/fail.md:2"]
    assert run_block(found[0][1].code, repo) is None
    assert "exit status 1" in (run_block(found[1][1].code, repo) or "")
    assert "did not finish" in (run_block("sleep 5 & sleep 5; wait", repo, timeout=0.5) or "")
    assert run_block(f"{sys.executable} -c 'import sys; sys.exit(3)'", repo) is not None
