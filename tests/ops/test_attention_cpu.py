"""The CPU attention template (`attention_cpu`) against PyTorch's scaled_dot_product_attention in
float64: lengths and head dims that are no multiple of its blocks (several query and key blocks),
every mask kind, causal, grouped- and multi-query heads, views read in place, fused epilogues,
float16/bfloat16 within twice eager's error, and what it leaves to the auto-scheduler."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import dtypes
from kiln.ir import Task, TensorInput, compute
from kiln.passes.fused import fold_anchor
from kiln.schedule import build_task, schedules_for
from kiln_ops_builtin import attention as attention_op
from kiln_ops_builtin.templates import attention_cpu
from kiln_ops_builtin.templates.attention_match import match_attention
from tests.cuda.attention_support import attention_task, masks, reference
from tests.frontend.frontend_support import Capture
from tests.support import rand, run_sanitized

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
TOL = dict(atol=2e-5, rtol=1e-4)


def _chosen(q, k, v, mask=None, scale=None, is_causal=False):
    """The name of the schedule the CPU picks for this attention ('auto' for the auto-scheduler)."""
    op = kiln.ops.attention
    args = [kiln.from_torch(t) for t in (q, k, v)] + [None if mask is None else kiln.from_torch(mask)]
    task, _, _ = op.task(op.bind(tuple(args), {"scale": scale, "is_causal": is_causal}))
    found = schedules_for(task, "cpu")
    return found[0].name if found else "auto"


def _run(q, k, v, **kw):
    """Kiln's attention, after asserting that the CPU template takes it."""
    assert _chosen(q, k, v, **kw) == "attention_cpu"
    return kiln.ops.attention(q, k, v, **kw).torch()


def _qkv(shape_q, shape_k, dv, dtype=f32):
    return rand(shape_q, dtype), rand(shape_k, dtype), rand(shape_k[:-1] + (dv,), dtype)


@pytest.mark.parametrize("lq,lk,d,dv", [(37, 53, 40, 40), (37, 53, 64, 64), (70, 140, 64, 24), (1, 75, 17, 5),
                                        (130, 7, 3, 33)])
def test_odd_lengths_and_head_dims(lq, lk, d, dv):
    q, k, v = _qkv((2, 3, lq, d), (2, 3, lk, d), dv)
    out = _run(q, k, v)
    assert out.dtype == f32 and out.shape == (2, 3, lq, dv)
    torch.testing.assert_close(out.double(), reference(q, k, v), **TOL)


def _masks(lq, lk, dtype):
    """`masks`' and a float mask per head [3, 1, lk]."""
    return {**masks(lq, lk, dtype), "float_heads": rand((3, 1, lk), dtype)}


@pytest.mark.parametrize("kind", ["bool", "float", "padding", "additive_padding", "float_heads"])
@pytest.mark.parametrize("causal", [False, True])
def test_masks(kind, causal):
    q, k, v = _qkv((2, 3, 70, 16), (2, 3, 75, 16), 16)
    mask = _masks(70, 75, f32)[kind]
    out = _run(q, k, v, mask=mask, is_causal=causal, scale=0.3)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask=mask, is_causal=causal, scale=0.3), **TOL)


@pytest.mark.parametrize("lq,lk", [(70, 70), (20, 150), (150, 20)])
def test_causal_with_any_lengths(lq, lk):
    q, k, v = _qkv((1, 2, lq, 24), (1, 2, lk, 24), 24)
    out = _run(q, k, v, is_causal=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, is_causal=True), **TOL)


def test_fully_masked_rows_give_zeros_as_torch():
    q, k, v = _qkv((1, 2, 9, 8), (1, 2, 70, 8), 8)
    keep = torch.rand(9, 70) > 0.5
    keep[:, 0], keep[2] = True, False
    for mask in (keep, torch.where(keep, 0.0, float("-inf"))):
        out = _run(q, k, v, mask=mask)
        assert (out[:, :, 2] == 0).all()
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), **TOL)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1)])
def test_grouped_and_multi_query(hq, hkv):
    q, k, v = _qkv((2, hq, 33, 40), (2, hkv, 65, 40), 40)
    if hkv > 1:     # with one key/value head, its index is 0
        assert match_attention(attention_task(q.shape, k.shape, dtype=dtypes.float32), "cpu").group == hq // hkv
    out = _run(q, k, v, is_causal=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, is_causal=True), **TOL)


def test_lower_ranks_and_non_contiguous_inputs():
    q = rand((37, 3, 40)).transpose(0, 1)                 # [3 heads, 37, 40], not contiguous
    k, v = rand((3, 53, 40)), rand((24, 53, 3)).permute(2, 1, 0)
    out = _run(q, k, v, scale=0.7)
    torch.testing.assert_close(out.double(), reference(q, k, v, scale=0.7), **TOL)
    q2, k2, v2 = rand((37, 40)), rand((53, 40)), rand((53, 9))
    torch.testing.assert_close(_run(q2, k2, v2).double(), reference(q2, k2, v2), **TOL)


def _errors(out, ref):
    err = (out.double() - ref).abs()
    return err.mean().item(), err.max().item()


@pytest.mark.parametrize("dtype", [f16, bf16])
@pytest.mark.parametrize("options", [{}, {"mask": "float", "is_causal": True}, {"mask": "bool"}])
def test_16_bit_error_at_most_twice_eager(dtype, options):
    torch.manual_seed(0)
    q, k, v = _qkv((2, 4, 37, 40), (2, 2, 53, 40), 40, dtype)
    kw = dict(options)
    if "mask" in kw:
        kw["mask"] = _masks(37, 53, dtype)[kw["mask"]]
    ref = reference(q, k, v, **kw)
    out = _run(q, k, v, **kw)
    rep = q.shape[1] // k.shape[1]
    eager = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           attn_mask=kw.get("mask"), is_causal=kw.get("is_causal", False))
    (kiln_mean, kiln_max), (eager_mean, eager_max) = _errors(out, ref), _errors(eager, ref)
    assert out.dtype == dtype
    assert kiln_mean <= 2 * eager_mean and kiln_max <= 2 * eager_max, (kiln_mean, eager_mean, kiln_max, eager_max)


def test_one_thread_gives_the_same_result():
    q, k, v = _qkv((2, 4, 70, 40), (2, 4, 75, 40), 40)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(q, k, v, is_causal=True)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(_run(q, k, v, is_causal=True), one, atol=0, rtol=0)


def _attention_tasks(capture):
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    return [n.task for n in graph.nodes if n.task.name == "attention"]


def test_head_views_and_epilogue_fuse_into_the_template():
    """q, k, v as views of projections [B, L, H * D] (heads transposed: no copy) and the output
    transposed back and reshaped, plus a residual: one kernel, the template's."""
    b, lq, h, d = 2, 37, 3, 40

    def fn(x, kv, mask, residual):
        q = x.view(b, lq, h, d).transpose(1, 2)
        k, v = kv.view(b, 53, 2, h, d).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, lq, h * d) + residual

    x, kv, mask, residual = rand((b, lq, h * d)), rand((b, 53, 2 * h * d)), _masks(lq, 53, f32)["padding"], \
        rand((b, lq, h * d))
    capture = Capture()
    torch._dynamo.reset()
    got = torch.compile(fn, backend=capture, fullgraph=True)(x, kv, mask, residual)
    q, k, v = x.view(b, lq, h, d).transpose(1, 2), *kv.view(b, 53, 2, h, d).permute(2, 0, 3, 1, 4)
    want = reference(q, k, v, mask=mask).transpose(1, 2).reshape(b, lq, h * d) + residual
    torch.testing.assert_close(got.double(), want, **TOL)
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    assert len(graph.nodes) == 1 and attention_cpu.applies(graph.nodes[0].task)
    a = match_attention(graph.nodes[0].task, "cpu")
    assert a.q.row_stride == h * d and a.k.row_stride == 2 * h * d and a.v.offset == h * d
    assert (a.batch, a.Lq, a.Dv) == ((b, h), lq, d)


@pytest.mark.parametrize("name", ["transpose", "reshape", "merged_batch_and_heads", "column_split"])
def test_outputs_written_through_views(name):
    """The output folded with views after it: heads and rows swapped, heads and value columns
    merged ([B, L, H * Dv]), batch and heads merged; a value column split in two is declined."""
    views = {
        "transpose": ((2, 37, 3, 40), lambda a: lambda b, i, h, e: a[b, h, i, e], lambda o: o.transpose(1, 2)),
        "reshape": ((2, 37, 120), lambda a: lambda b, i, c: a[b, c // 40, i, c % 40],
                    lambda o: o.transpose(1, 2).reshape(2, 37, 120)),
        "merged_batch_and_heads": ((6, 37, 40), lambda a: lambda x, i, e: a[x // 3, x % 3, i, e],
                                   lambda o: o.reshape(6, 37, 40)),
        "column_split": ((2, 3, 37, 2, 20), lambda a: lambda b, h, i, e, f: a[b, h, i, e * 20 + f],
                         lambda o: o.reshape(2, 3, 37, 2, 20)),
    }
    shape, view, expected = views[name]
    ins = [TensorInput(n, s, dtypes.float32) for n, s in zip("qkv", ((2, 3, 37, 40), (2, 3, 53, 40), (2, 3, 53, 40)))]
    att = attention_op.attention.definition(*ins, None, None, True)
    task = Task("attention", ins, [fold_anchor(compute(shape, view(att)), att)], {"is_causal": True})
    assert attention_cpu.applies(task) == (name != "column_split")
    q, k, v = rand((2, 3, 37, 40)), rand((2, 3, 53, 40)), rand((2, 3, 53, 40))
    (got,) = build_task(task, kiln.device("cpu"))([q, k, v])
    torch.testing.assert_close(got.double(), expected(reference(q, k, v, is_causal=True)), **TOL)


def test_declines_what_it_does_not_read():
    # float64: the auto-scheduler's, and still right
    q, k, v = _qkv((1, 2, 9, 8), (1, 2, 11, 8), 8, torch.float64)
    assert _chosen(q, k, v) == "auto"
    torch.testing.assert_close(kiln.ops.attention(q, k, v).torch(), reference(q, k, v))
    # keys read from k^T's memory (column stride 11): the auto-scheduler's
    q, kt, v = rand((1, 2, 9, 8)), rand((1, 2, 8, 11)), rand((1, 2, 11, 8))
    ins = [TensorInput("q", q.shape, dtypes.float32), TensorInput("kt", kt.shape, dtypes.float32),
           TensorInput("v", v.shape, dtypes.float32)]
    keys = compute((1, 2, 11, 8), lambda b, h, j, d: ins[1][b, h, d, j])
    task = Task("attention", ins, [attention_op.attention.definition(ins[0], keys, ins[2], None, None, False)], {})
    assert not attention_cpu.applies(task) and schedules_for(task, "cpu") == []
    (got,) = build_task(task, kiln.device("cpu"))([q, kt, v])
    torch.testing.assert_close(got.double(), reference(q, kt.transpose(-1, -2), v), **TOL)
    # through torch.compile, that view stays out of the attention's kernel, which the template takes
    capture = Capture()
    torch._dynamo.reset()
    got = torch.compile(lambda q, kt, v: F.scaled_dot_product_attention(q, kt.transpose(-1, -2), v),
                        backend=capture, fullgraph=True)(q, kt, v)
    torch.testing.assert_close(got.double(), reference(q, kt.transpose(-1, -2), v), **TOL)
    (task,) = _attention_tasks(capture)
    assert attention_cpu.applies(task)


_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
void kiln_kernel(const void*, const void*, const void*, const void*, void*);
static void* slurp(const char* path) {
    FILE* f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void* p = malloc(n);
    if (fread(p, 1, n, f) != (size_t)n) exit(2);
    fclose(f);
    return p;
}
int main(int argc, char** argv) {
    long bytes = atol(argv[6]);
    void* out = malloc(bytes);
    kiln_kernel(slurp(argv[1]), slurp(argv[2]), slurp(argv[3]), slurp(argv[4]), out);
    FILE* f = fopen(argv[5], "wb");
    fwrite(out, 1, bytes, f);
    fclose(f);
    return 0;
}
"""


@pytest.mark.parametrize("isa", [[], ["-mno-avx512f"], ["-mno-avx"]])
def test_every_vector_width_is_right_and_clean_under_address_sanitizer(tmp_path, isa):
    """The program built for 16-, 8- and 4-float vectors, with AddressSanitizer: grouped heads,
    a float mask, causal, lengths past one block, odd head dims."""
    q, k, v = _qkv((1, 4, 70, 20), (1, 2, 75, 20), 9)
    mask = rand((70, 75))
    task = attention_task(q.shape, k.shape, v.shape, dtypes.float32, (mask.shape, dtypes.float32), causal=True)
    files = []
    for name, t in zip("qkvm", (q, k, v, mask)):
        (tmp_path / name).write_bytes(t.contiguous().numpy().tobytes())
        files.append(tmp_path / name)
    run_sanitized(tmp_path, attention_cpu.render(task).source, _MAIN,
                  [*files, tmp_path / "out", 70 * 4 * 9 * 4], isa)
    out = torch.frombuffer(bytearray((tmp_path / "out").read_bytes()), dtype=torch.float32).reshape(1, 4, 70, 9)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask=mask, is_causal=True), **TOL)
