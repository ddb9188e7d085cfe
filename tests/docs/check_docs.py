#!/usr/bin/env python3
"""The project's Markdown renders as written: checks README.md and every .md
under docs/, python/, bench/, tools/ and include/ (the source root is argv[1]).

- A table row has as many cells as its header row. GitHub drops a row's
  extra cells (and pads a short row), so a row with one cell too many loses
  its last column: its description, unseen by the reader.
- A relative link names a file that exists, and its #anchor is a heading of
  that file, as GitHub makes heading anchors (lower case; every character
  but letters, digits, '_', '-' and spaces dropped; spaces become '-'; a
  repeated heading gets -1, -2, ...).

Fenced code blocks are skipped. Exits 1 naming each defect (file:line),
0 when there is none.
"""
import os
import re
import sys

PIPE = re.compile(r"(?<!\\)\|")  # a cell separator: a pipe not escaped (GFM splits inside `code` too)
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def strip_fences(lines):
    """The lines, with those of fenced code blocks (and the fences) blanked."""
    out, inside = [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            inside = not inside
            out.append("")
            continue
        out.append("" if inside else line)
    return out


def cells(row):
    row = row.strip()
    parts = PIPE.split(row)
    # "| a | b |": the empty strings before the first pipe and after the last
    if row.startswith("|"):
        parts = parts[1:]
    if row.endswith("|") and not row.endswith("\\|"):
        parts = parts[:-1]
    return len(parts)


def table_defects(lines):
    """(line number, message) for each row whose cell count is not its header's."""
    out, header = [], None
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("|"):
            c = cells(line)
            if header is None:
                header = c
            elif c != header:
                out.append((n, f"a table row of {c} cells under a header of {header} "
                               f"(GitHub {'drops the extra' if c > header else 'pads the missing'}): {line.strip()[:70]}"))
        else:
            header = None
    return out


def slug(heading):
    text = LINK.sub(lambda m: m.group(1), heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(lines):
    seen, out = {}, set()
    for line in lines:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        k = seen.get(s, 0)
        seen[s] = k + 1
        out.add(s if k == 0 else f"{s}-{k}")
    return out


def link_defects(path, lines, anchors_of):
    out = []
    for n, line in enumerate(lines, 1):
        for m in LINK.finditer(line):
            target = m.group(2)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            file, _, frag = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(dest):
                out.append((n, f"link to {target}: no file {dest}"))
            elif frag and dest.endswith(".md") and frag not in anchors_of(dest):
                out.append((n, f"link to {target}: no heading of {os.path.basename(dest)} has the anchor #{frag}"))
    return out


def self_check():
    """The rules against cases written out, so that a checker that finds
    nothing fails here rather than passing every file."""
    assert slug("`strata`: Strata's own keys") == "strata-stratas-own-keys"
    assert slug("The overlapped step (offload_module)") == "the-overlapped-step-offload_module"
    assert slug("[C guide](c-guide.md): `\"auto\"` budgets") == "c-guide-auto-budgets"
    assert anchors(["# A", "## A", "text", "### A"]) == {"a", "a-1", "a-2"}
    assert cells("| a | b | c |") == 3 and cells("| `x\\|y` | b |") == 2
    bad = table_defects(["| k | v |", "|---|---|", "| a | | b |", "| c | d |", "", "| x |", "|---|"])
    assert [n for n, _ in bad] == [3], bad
    assert table_defects(strip_fences(["```", "| a | b |", "| a |", "```"])) == []


def main():
    self_check()
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
    files = [os.path.join(root, "README.md")]
    for sub in ("docs", "python", "bench", "tools", "include"):
        for d, dirs, names in os.walk(os.path.join(root, sub)):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x != "__pycache__"]
            files += [os.path.join(d, x) for x in sorted(names) if x.endswith(".md")]
    cache = {}

    def lines_of(p):
        if p not in cache:
            with open(p, encoding="utf-8") as f:
                cache[p] = strip_fences(f.read().split("\n"))
        return cache[p]

    defects = []
    for p in files:
        lines = lines_of(p)
        for n, msg in table_defects(lines) + link_defects(p, lines, lambda q: anchors(lines_of(q))):
            defects.append(f"{os.path.relpath(p, root)}:{n}: {msg}")
    for d in defects:
        print(d)
    print(f"check_docs: {len(files)} files, {len(defects)} defects")
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
