"""Importing this module fails, as a plugin with a missing vendor library would if it imported
that library at module level (which the plugin contract forbids)."""

PLUGIN_API_VERSION = "1.0"

raise ImportError("attnplug_broken needs libbroken.so, which is not installed (deliberately broken example plugin)")
