#!/usr/bin/env python3
"""Puts a measured table into a doc between its markers, whole or not at all.

usage: splice-doc.py DOC MARKER TABLE STAMP SCRIPT

Replaces what stands between `<!-- MARKER:begin -->` and `<!-- MARKER:end -->` in DOC with
"Measured STAMP by `SCRIPT`." and the TABLE file's text (the benchmark scripts' WRITE_DOC=1).
"""
import os
import sys


def main():
    if len(sys.argv) != 6:
        sys.exit(__doc__.strip().splitlines()[2])
    doc, marker, table, stamp, script = sys.argv[1:]
    s = open(doc).read()
    b, e = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    i, j = s.index(b) + len(b), s.index(e)
    s = s[:i] + f"\n\nMeasured {stamp} by `{script}`.\n\n" + open(table).read().strip() + "\n\n" + s[j:]
    open(doc + ".tmp", "w").write(s)
    os.replace(doc + ".tmp", doc)


if __name__ == "__main__":
    main()
