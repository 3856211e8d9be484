"""The `make demo` walk-through: one container sandbox, a command, a file, and cleanup."""

from __future__ import annotations

import time

from dsec import Sandbox


def main() -> None:
    t0 = time.perf_counter()
    with Sandbox.create(tier="container", image="busybox", memory_mb=256, ttl_s=300) as sb:
        t_create = time.perf_counter() - t0
        print(f"created {sb.id} (tier=container, image=busybox) in {t_create * 1000:.1f} ms")
        r = sb.commands.run("echo hello from $(hostname); uname -sr; id")
        print(f"$ echo hello ... -> exit {r.exit_code}\n{r.stdout.rstrip()}")
        sb.files.write("/tmp/greeting.txt", "written through the dsec SDK\n")
        print(
            f"read back /tmp/greeting.txt: {sb.files.read('/tmp/greeting.txt').decode().rstrip()!r}"
        )
        r = sb.commands.run("wc -c /tmp/greeting.txt")
        print(f"$ wc -c /tmp/greeting.txt -> {r.stdout.strip()}")
    print(f"killed {sb.id}; total {(time.perf_counter() - t0) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
