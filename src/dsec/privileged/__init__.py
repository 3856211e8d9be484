"""Privileged node operations, kept in one audited place.

Everything here needs root on the node (mount(2), cgroup v1 files, node setup) or changes
process-wide kernel state of the edge (``reaper``: the child subreaper and its reaper).
Nothing here parses client input; callers pass validated values.
"""
