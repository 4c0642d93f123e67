"""zeppelin contracts."""
