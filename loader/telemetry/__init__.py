"""What the loader measures about itself: stats, process CPU time, profile()."""
