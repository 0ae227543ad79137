"""Runtime backends: one object per backend (open a bundle, where it can run, its checks)."""
