"""Kiln's built-in operators (compute definitions) and schedule templates, as a plugin."""
