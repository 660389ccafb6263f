"""An example Kiln plugin: the fused operator `fused_rms_norm` and the torch rules that use it.

Installed on its own (`pip install -e plugins/kiln_example_rmsnorm`), it is found through its
entry point in the group `kiln`; nothing in Kiln imports it by name.
"""
