"""What every stage shares: atomic storage, configuration files, artifacts, progress lines, processes."""
