#!/usr/bin/env python3
"""The crate's module import graph, from its source text: which module names which.

    python3 scripts/module-graph.py [--level N] [--cycles] [--dot]

A module is a file under src/ (foo/mod.rs is `foo`, foo/bar.rs is `foo::bar`), cut to
its first N path segments (default 2: `kernels::x86`, `format::mlb`). An edge A -> B
means A's source names `crate::B...` (in a `use`, a path or a doc link outside
comments), `super::` / `self::` paths that resolve to B, or a bare path through one of
A's child modules (`scalar::dot`). Test modules count too:
a test that imports back is still a circle in the code a reader follows.

--cycles prints each strongly connected component of more than one module (import
circles) and exits 1 if there is any; with no flag it prints every edge.
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def module_of(path):
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib"):
        rel = rel[:-1]
    return rel


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//")[0] for line in text.split("\n"))


def main():
    level = 2
    args = sys.argv[1:]
    if "--level" in args:
        level = int(args[args.index("--level") + 1])
    files = {}
    for d, _, names in os.walk(ROOT):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(d, n)
                files[tuple(module_of(p))] = p
    mods = set(files)

    def resolve(parts):
        # longest prefix that is a module file
        for k in range(len(parts), 0, -1):
            if tuple(parts[:k]) in mods:
                return tuple(parts[:k])
        return None

    def cut(m):
        return "::".join(m[:level]) if m else "crate"

    def absolute(m, head, rest):
        # the path `head::rest` (head: crate, self or super) names from module m (a
        # mod.rs file is its folder)
        if head == "crate":
            return list(rest)
        if head == "self":
            return list(m) + rest
        base = list(m[:-1])
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
        return base + rest

    edges = set()
    for m, p in files.items():
        text = strip_comments(open(p, encoding="utf-8").read())
        for mt in re.finditer(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)", text):
            target = resolve(absolute(m, mt.group(1), mt.group(2).split("::")[1:]))
            if target is None:
                continue
            a, b = cut(m), cut(target)
            if a != b:
                edges.add((a, b))
        # child modules named by a bare path (`scalar::dot`, `use half::HalfActs`)
        for c in {k[len(m)] for k in mods if len(k) == len(m) + 1 and k[: len(m)] == m}:
            if re.search(r"(?<![A-Za-z0-9_:])" + c + r"::", text):
                a, b = cut(m), cut(m + (c,))
                if a != b:
                    edges.add((a, b))
        # `use {a, b}` groups: crate::x::{y, z}
        for mt in re.finditer(r"\bcrate::([a-z_][a-z0-9_]*)::\{([^}]*)\}", text):
            for item in mt.group(2).split(","):
                item = item.strip().split("::")[0].strip()
                target = resolve([mt.group(1), item]) if item else None
                if target is not None and cut(m) != cut(target):
                    edges.add((cut(m), cut(target)))

        # every `(crate|super|self)::a::{b, c::d}` group, nested braces flattened
        for mt in re.finditer(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{", text):
            depth, k = 1, mt.end()
            while depth and k < len(text):
                depth += {"{": 1, "}": -1}.get(text[k], 0)
                k += 1
            inner = text[mt.end():k - 1]
            pre = absolute(m, mt.group(1), [p for p in mt.group(2).split("::") if p])
            for item in re.split(r"[,{}]", inner):
                item = item.strip().split(" as ")[0]
                if not item or item == "self":
                    target = resolve(pre)
                else:
                    target = resolve(pre + item.split("::"))
                if target is not None and cut(m) != cut(target):
                    edges.add((cut(m), cut(target)))

    if "--dot" in args:
        print("digraph krafla {")
        for a, b in sorted(edges):
            print(f'  "{a}" -> "{b}";')
        print("}")
        return 0
    if "--cycles" not in args:
        for a, b in sorted(edges):
            print(f"{a} -> {b}")
        return 0
    # Tarjan's strongly connected components
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, comps = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = [sorted(c) for c in comps if len(c) > 1]
    for c in circles:
        inner = sorted((a, b) for a, b in edges if a in c and b in c)
        print(f"circle of {len(c)}: " + ", ".join(c))
        for a, b in inner:
            print(f"    {a} -> {b}")
    if not circles:
        print(f"no import circles at level {level}")
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main())
