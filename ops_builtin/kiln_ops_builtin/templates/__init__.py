"""Kiln's built-in CUDA and CPU schedule templates, contributed through the `kiln_schedules` hook."""
from kiln_ops_builtin.templates import (attention_cpu, attention_decode, attention_flash, attention_simt, attention_sm90,
                                       attention_train,
                                       conv_cpu, conv_depthwise, conv_depthwise_cpu, conv_depthwise_nhwc, conv_sm90,
                                       conv_tc, conv_winograd_cpu, embedding_grad, gemm_cpu, gemm_sm90, gemv, gemv_tc,
                                       matmul_simt, matmul_tc, matmul_wgmma, pool_cpu, scatter_atomic, sort_bitonic)

TEMPLATES = [gemv.TEMPLATE, gemv_tc.TEMPLATE, gemm_sm90.TEMPLATE, conv_sm90.TEMPLATE, attention_decode.TEMPLATE,
             attention_flash.TEMPLATE, attention_sm90.TEMPLATE, attention_train.FORWARD,
             attention_train.BACKWARD, attention_simt.TEMPLATE, matmul_wgmma.TEMPLATE,
             matmul_tc.TEMPLATE, matmul_simt.TEMPLATE,
             conv_tc.TEMPLATE, conv_depthwise.TEMPLATE, conv_depthwise_nhwc.TEMPLATE, sort_bitonic.TEMPLATE,
             scatter_atomic.TEMPLATE, embedding_grad.TEMPLATE, gemm_cpu.MATMUL, gemm_cpu.CONV, conv_winograd_cpu.TEMPLATE, conv_cpu.TEMPLATE,
             conv_depthwise_cpu.TEMPLATE, pool_cpu.TEMPLATE, attention_cpu.TEMPLATE]
