"""dsec layers."""
