#!/usr/bin/env python3
"""Write the apiserver's OpenAPI document to src/dsec/apiserver/openapi.json.

Usage: .venv/bin/python scripts/gen_openapi.py [--check]

With ``--check`` nothing is written; the exit status is 1 if the checked-in file is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dsec.apiserver.app import render_openapi

TARGET = Path(__file__).resolve().parent.parent / "src" / "dsec" / "apiserver" / "openapi.json"


def main(argv: list[str]) -> int:
    text = render_openapi()
    if "--check" in argv:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != text:
            print(
                f"{TARGET} is stale; run: .venv/bin/python scripts/gen_openapi.py", file=sys.stderr
            )
            return 1
        print(f"{TARGET} is up to date")
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
