"""dsec sdk."""
