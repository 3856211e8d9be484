"""dsec apiserver."""
