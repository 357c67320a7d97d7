"""Extracts plain English prose from the Python documentation sources into tools/prose.txt.gz.

The demo checkpoints need an openly licensed prose corpus that travels with the repo (the GPU
box has no network). Source: Debian's `python3.11-doc` package (the reStructuredText sources
under /usr/share/doc/python3.11/html/_sources), licensed under the PSF License Version 2.
This script is run once, by hand, here; the training script only reads the .gz it writes:

    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb /tmp/pydoc
    python tools/extract_prose.py /tmp/pydoc/usr/share/doc/python3.11/html/_sources

Output format (UTF-8, gzip): one section per block, separated by a blank line; the first line
of a block is "## <section title>", each following line is one paragraph.
"""

from __future__ import annotations

import argparse
import gzip
import re
from pathlib import Path

# Top-level folders with explanatory prose; c-api, distutils and whatsnew are mostly
# signatures, changelog entries and names, which make poor language-model text.
FOLDERS = ("tutorial", "faq", "howto", "reference", "library", "using", "glossary.rst.txt",
           "extending", "installing")

# Directives whose body is code, tables or navigation, never prose.
SKIP_DIRECTIVES = {
    "code-block", "sourcecode", "code", "doctest", "testcode", "testsetup", "testcleanup",
    "testoutput", "productionlist", "literalinclude", "highlight", "csv-table", "list-table",
    "table", "toctree", "raw", "image", "figure", "math", "only", "index", "include",
    "moduleauthor", "sectionauthor", "audit-event", "availability", "opcode", "cmdoption",
    "option", "envvar", "grammar-snippet", "impl-detail",
}

TITLE_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+.:_])\1{2,}\s*$")
DIRECTIVE = re.compile(r"^\s*\.\.\s+([\w:-]+)::")


def _clean_inline(text: str) -> str:
    """Turns reST inline markup into the words a reader would see."""
    # :role:`title <target>` -> title ; :role:`~a.b.c` -> c ; :role:`!x` -> x
    text = re.sub(r":[\w:-]+:`([^`<]*?)\s*<[^>`]*>`", r"\1", text)
    text = re.sub(r":[\w:-]+:`~?!?([^`]*)`", lambda m: m.group(1).split(".")[-1]
                  if m.group(0).split("`")[1].startswith("~") else m.group(1), text)
    text = re.sub(r"`([^`<]+?)\s*<[^>`]+>`__?", r"\1", text)  # `link text <url>`_
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"`([^`]+)`_?_?", r"\1", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
    text = re.sub(r"(?<![\w*])\*([^*\s][^*]*?)\*(?![\w*])", r"\1", text)
    text = re.sub(r"\[#\w*\]_|\[\d+\]_", "", text)  # footnote references
    text = re.sub(r"\|[\w -]+\|", "", text)  # substitutions
    text = re.sub(r"\\(.)", r"\1", text)
    return re.sub(r"\s+", " ", text).strip()


def _is_prose(par: str) -> bool:
    words = par.split()
    if len(words) < 8 or not par[0].isalpha() or not par[0].isupper():
        return False
    if any(ch in par for ch in "`|<>{}\\") or "::" in par or ">>>" in par:
        return False
    if not par.isascii():
        return False
    letters = sum(ch.isalpha() or ch == " " for ch in par)
    return letters / len(par) > 0.85 and par[-1] in ".!?:)"


def extract_file(path: Path) -> list[tuple[str, list[str]]]:
    """Returns [(section title, [paragraph, ...]), ...] for one .rst.txt file."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    sections: list[tuple[str, list[str]]] = [("", [])]
    skip_indent: int | None = None  # inside a code/table block: skip lines indented deeper
    i, n = 0, len(lines)
    par: list[str] = []
    par_indent = 0

    def flush() -> None:
        nonlocal par
        if par:
            text = _clean_inline(" ".join(s.strip() for s in par))
            if _is_prose(text):
                sections[-1][1].append(text)
            par = []

    while i < n:
        line = lines[i].rstrip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if line.strip() == "" or indent > skip_indent:
                i += 1
                continue
            skip_indent = None
        if line.strip() == "":
            flush()
            i += 1
            continue
        # Section title: text line followed by an underline (optionally also overlined).
        if i + 1 < n and TITLE_UNDERLINE.match(lines[i + 1]) and not TITLE_UNDERLINE.match(line) \
                and indent == 0 and len(lines[i + 1].rstrip()) >= len(line.strip()):
            flush()
            title = _clean_inline(line.strip())
            sections.append((title, []))
            i += 2
            continue
        if TITLE_UNDERLINE.match(line):
            flush()
            i += 1
            continue
        m = DIRECTIVE.match(line)
        if m:
            flush()
            name = m.group(1).split(":")[-1]
            if name in SKIP_DIRECTIVES:
                skip_indent = indent
            i += 1
            # Directive options (":noindex:") belong to the directive line.
            while i < n and lines[i].strip().startswith(":") and lines[i].strip() != "":
                i += 1
            continue
        stripped = line.strip()
        if stripped.startswith(("..", ">>>", "...", "+-", "|", "* ", "- ", "#. ")) \
                or re.match(r"^\d+\.\s", stripped) or re.match(r"^:[\w ]+:", stripped):
            flush()
            if stripped.startswith(("..", "+-")):
                skip_indent = indent
            i += 1
            continue
        if par and indent != par_indent:
            flush()
        if not par:
            par_indent = indent
        par.append(line)
        if stripped.endswith("::"):
            # A paragraph that introduces a literal block: keep the sentence, skip the code.
            par[-1] = line[:-1] if not stripped.endswith(" ::") else line[:-3]
            flush()
            skip_indent = indent
        i += 1
    flush()
    return [(t, ps) for t, ps in sections if ps]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", type=Path, help="the html/_sources folder of python3.x-doc")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("prose.txt.gz"))
    ap.add_argument("--max-chars", type=int, default=6_000_000)
    args = ap.parse_args()
    files: list[Path] = []
    for name in FOLDERS:
        p = args.sources / name
        files += sorted(p.rglob("*.rst.txt")) if p.is_dir() else [p]
    blocks, total = [], 0
    for f in files:
        for title, pars in extract_file(f):
            block = "## " + (title or f.name.split(".")[0]) + "\n" + "\n".join(pars)
            if total + len(block) > args.max_chars:
                break
            blocks.append(block)
            total += len(block) + 2
    text = "\n\n".join(blocks) + "\n"
    with gzip.open(args.out, "wt", encoding="utf-8", compresslevel=9) as fh:
        fh.write(text)
    print(f"{len(files)} files, {len(blocks)} sections, {len(text)} chars, "
          f"{args.out.stat().st_size} bytes gzipped -> {args.out}")


if __name__ == "__main__":
    main()
