#!/usr/bin/env python3
"""Write the type stubs of the generated sync API to src/dsec/sdk/sync_api.pyi.

Usage: .venv/bin/python scripts/gen_sync_stubs.py [--check]

With ``--check`` nothing is written; the exit status is 1 if the checked-in file is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dsec.sdk.stubs import render_sync_stubs

TARGET = Path(__file__).resolve().parent.parent / "src" / "dsec" / "sdk" / "sync_api.pyi"


def main(argv: list[str]) -> int:
    text = render_sync_stubs()
    if "--check" in argv:
        if (TARGET.read_text() if TARGET.exists() else "") != text:
            print(
                f"{TARGET} is stale; run: .venv/bin/python scripts/gen_sync_stubs.py",
                file=sys.stderr,
            )
            return 1
        print(f"{TARGET} is up to date")
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
