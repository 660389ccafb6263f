"""The entry point of kiln-mappings-builtin."""
