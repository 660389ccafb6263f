"""kiln-mappings-aten: rules from core ATen operators (and the few AOTAutograd leaves undecomposed)
to Kiln operators, for the forward and backward graphs of training, and Kiln's own
decompositions of the ATen ops whose torch decomposition suits it badly."""
