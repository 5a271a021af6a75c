#!/usr/bin/env python3
"""Import circles between the modules of each crate under host/ (Cargo refuses circles
between crates; inside a crate they are kept out by review, with this as the check).

A module's imports are the `crate::...` and `super::...` paths (`super::super::...`
too) its non-test code names, resolved to the longest module path that exists. A parent
and its own children may name each other (a module declares and re-exports its
children); siblings and cousins may not form a circle. A cousin's import counts for its
ancestors: `a::x` naming `b` is `a` naming `b` as far as `a`'s siblings can see, so a
ring through a child module is found. Prints each circle found and exits 1, or exits 0.

    tools/module-circles.py
"""
import collections
import glob
import os
import re
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
found = []
for crate in sorted(glob.glob(os.path.join(root, "host", "*", "src"))) + [os.path.join(root, "host", "src")]:
    mods = {}
    for f in glob.glob(os.path.join(crate, "**", "*.rs"), recursive=True):
        rel = os.path.relpath(f, crate)[:-3]
        m = re.sub(r"(^|/)mod$", "", rel).replace("/", "::")
        mods["" if m in ("lib", "main") else m] = f

    def resolve(path):
        parts = path.split("::")
        for k in range(len(parts), 0, -1):
            cand = "::".join(parts[:k])
            if cand in mods:
                return cand
        return None

    graph = collections.defaultdict(set)
    for m, f in mods.items():
        src = open(f).read()
        cut = src.find("#[cfg(test)]\nmod tests")
        if cut >= 0:
            src = src[:cut]
        src = re.sub(r"(?m)//.*$", "", src)
        # `super` of a `mod.rs` file is its module's parent, as of any other file.
        here = m.split("::") if m else []

        def up(count):
            return "::".join(here[: max(len(here) - count, 0)])

        paths = [x.group(1) for x in re.finditer(r"crate::((?:[a-z_0-9]+::)*[a-z_0-9]+)", src)]
        for x in re.finditer(r"((?:super::)+)((?:[a-z_0-9]+::)*[a-z_0-9]+)", src):
            base = up(x.group(1).count("super::"))
            paths.append((base + "::" if base else "") + x.group(2))
        for x in re.finditer(r"use ((?:super::)+)\{([^}]*)\}", src):
            base = up(x.group(1).count("super::"))
            for name in re.findall(r"\b([a-z_0-9]+)\b", x.group(2)):
                paths.append((base + "::" if base else "") + name)
        for p in paths:
            t = resolve(p)
            related = t is None or t == m or t == "" or m.startswith(t + "::") or t.startswith(m + "::")
            if related:
                continue
            # The edge between the two siblings under the deepest common parent.
            a, b = m.split("::"), t.split("::")
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            graph["::".join(a[: k + 1])].add("::".join(b[: k + 1]))

    def walk(n, stack):
        for t in graph[n]:
            if t in stack:
                found.append((crate, stack[stack.index(t):] + [t]))
            elif len(stack) < 16:
                walk(t, stack + [t])

    for n in list(graph):
        walk(n, [n])

seen = set()
for crate, circle in found:
    key = (crate, frozenset(circle))
    if key not in seen:
        seen.add(key)
        print(f"{os.path.relpath(crate, root)}: {' -> '.join(circle)}")
sys.exit(1 if found else 0)
