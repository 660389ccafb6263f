"""`fused_rms_norm(x, weight, eps)`: RMSNorm over the last dim, one Task (a row reduction and
the scaling that reads it), which the auto-scheduler turns into one kernel."""
from kiln.graph import OperatorError, operator
from kiln.ir import cast, compute, reduce, rsqrt


@operator("fused_rms_norm")
def fused_rms_norm(x, weight, eps: float):
    """x / sqrt(mean(x**2, -1) + eps) * weight, accumulating in float32."""
    if weight.shape != x.shape[-1:]:
        raise OperatorError(f"fused_rms_norm: weight of shape {weight.shape} does not match the "
                            f"last dim of {x.shape}")
    n = x.shape[-1]
    scale = compute(x.shape[:-1], lambda *r: rsqrt(
        reduce([n], lambda k: cast(x[(*r, k)], "float32") * cast(x[(*r, k)], "float32"),
               dtype="float32") / n + eps))
    return compute(x.shape, lambda *i: cast(cast(x[i], "float32") * scale[i[:-1]]
                                           * cast(weight[i[-1:]], "float32"), x.dtype))
