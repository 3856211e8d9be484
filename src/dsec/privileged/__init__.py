"""Privileged node operations, kept in one audited place.

Everything here needs root on the node: mount(2), cgroup v1 files, node setup.
Nothing here parses client input; callers pass validated values.
"""
