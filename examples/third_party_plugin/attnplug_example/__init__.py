"""A minimal third-party attnplug plugin (see ../README.md)."""
