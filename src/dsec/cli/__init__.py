"""dsec cli."""
