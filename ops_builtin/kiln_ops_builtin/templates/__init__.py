"""Kiln's built-in CUDA and CPU schedule templates, contributed through the `kiln_schedules` hook."""
from kiln_ops_builtin.templates import (attention_flash, conv_depthwise, conv_tc, gemm_cpu, gemm_sm90, matmul_simt, matmul_tc,
                                       matmul_wgmma)

TEMPLATES = [gemm_sm90.TEMPLATE, matmul_wgmma.TEMPLATE, matmul_tc.TEMPLATE, matmul_simt.TEMPLATE, conv_tc.TEMPLATE,
             conv_depthwise.TEMPLATE, attention_flash.TEMPLATE, gemm_cpu.MATMUL,
             gemm_cpu.CONV]
