"""Kiln's built-in CUDA schedule templates, contributed through the `kiln_schedules` hook."""
from kiln_ops_builtin.templates import conv_depthwise, conv_tc, matmul_simt, matmul_tc, matmul_wgmma

TEMPLATES = [matmul_wgmma.TEMPLATE, matmul_tc.TEMPLATE, matmul_simt.TEMPLATE, conv_tc.TEMPLATE,
             conv_depthwise.TEMPLATE]
