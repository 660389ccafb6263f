"""Kiln's built-in torch -> Kiln mapping rules, as a plugin."""
