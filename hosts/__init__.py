"""The host matrix: dsec proved on the hosts users run, in QEMU guests booting stock Debian
kernels (``make host-matrix``; ``hosts/README.md``).

Modules, in the order a run uses them:

* :mod:`hosts.spec`: the hosts (Debian release, kernel, cgroup layout).
* :mod:`hosts.cache`: the machine-wide cache directory and its locks.
* :mod:`hosts.wheels`: dsec's dependencies as wheels, and a wheel of dsec itself.
* :mod:`hosts.image`: a host's root filesystem image (debootstrap, its kernel, a venv),
  built once per machine.
* :mod:`hosts.payload`: the second disk a guest gets (dsec, image layers, the check).
* :mod:`hosts.guest`: one guest booted, run to its end, its results read back.
* :mod:`hosts.inguest`: what runs inside the guest (standard library, then dsec's SDK).
* :mod:`hosts.matrix`: the command line: every host, a table, JSON.
"""
