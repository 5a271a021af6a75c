#!/usr/bin/env python3
"""Functions longer than a room allows: every Rust `fn` (methods, closures' enclosing
functions, tests) and Python `def` of the workspace's tracked source, from its first
line to its closing brace or the end of its indented body, comments and blank lines
included. Prints each function over the limit (default 150 lines) and exits 1, or
exits 0.

    tools/long-functions.py [LIMIT]
"""
import os
import re
import subprocess
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
limit = int(sys.argv[1]) if len(sys.argv) > 1 else 150


def tracked():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
        return [f.decode() for f in out.stdout.split(b"\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for top in ("host", "policies", "tests", "tools"):
            for d, dirs, names in os.walk(os.path.join(root, top)):
                dirs[:] = [x for x in dirs if x != "target"]
                files += [os.path.relpath(os.path.join(d, n), root) for n in names]
        return files


def code_of(src):
    """The Rust source with comments, strings and char literals blanked (newlines
    kept), so that braces count."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * src.count("\n", i, j))
            i = j
        elif (m := re.match(r'b?r(#*)"', src[i:])) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            end = '"' + m.group(1)
            j = src.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j + 1
        elif c == "'" and (m := re.match(r"'(\\.[^']*|[^\\'])'", src[i:])):
            out.append("' '")
            i += m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def rust(path, src):
    code = code_of(src)
    lines = code.split("\n")
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)
    for m in re.finditer(r"\bfn\s+([A-Za-z_][A-Za-z_0-9]*)", code):
        # The body: the first `{` after the signature, unless a `;` ends it first.
        j = m.end()
        depth_paren = 0
        while j < len(code):
            ch = code[j]
            if ch in "([":
                depth_paren += 1
            elif ch in ")]":
                depth_paren -= 1
            elif ch == ";" and depth_paren == 0:
                j = -1
                break
            elif ch == "{" and depth_paren == 0:
                break
            j += 1
        if j < 0 or j >= len(code):
            continue
        depth, k = 0, j
        while k < len(code):
            if code[k] == "{":
                depth += 1
            elif code[k] == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, k) + 1
        yield m.group(1), first, last - first + 1


def python(path, src):
    lines = src.split("\n")
    for i, line in enumerate(lines):
        m = re.match(r"(\s*)(?:async\s+)?def\s+([A-Za-z_0-9]+)", line)
        if not m:
            continue
        indent = len(m.group(1))
        end = i
        for j in range(i + 1, len(lines)):
            text = lines[j]
            if text.strip() and len(text) - len(text.lstrip()) <= indent:
                break
            if text.strip():
                end = j
        yield m.group(2), i + 1, end - i + 1


long = []
for f in tracked():
    kind = {".rs": rust, ".py": python}.get(os.path.splitext(f)[1])
    if kind is None:
        continue
    try:
        src = open(os.path.join(root, f), encoding="utf-8").read()
    except (OSError, UnicodeDecodeError):
        continue
    for name, line, count in kind(f, src):
        if count > limit:
            long.append((count, f"{f}:{line}: {name} has {count} lines"))
for _, text in sorted(long, reverse=True):
    print(text)
sys.exit(1 if long else 0)
