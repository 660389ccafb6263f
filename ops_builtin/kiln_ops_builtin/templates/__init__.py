"""Kiln's built-in CUDA and CPU schedule templates, contributed through the `kiln_schedules` hook."""
from kiln_ops_builtin.templates import gemm_cpu, conv_depthwise, conv_tc, matmul_simt, matmul_tc, matmul_wgmma

TEMPLATES = [matmul_wgmma.TEMPLATE, matmul_tc.TEMPLATE, matmul_simt.TEMPLATE, conv_tc.TEMPLATE,
             conv_depthwise.TEMPLATE, gemm_cpu.MATMUL, gemm_cpu.CONV]
