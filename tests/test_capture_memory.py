"""Memory of a CUDA graph capture that the CPU can check: the warm-up call before a capture
copies only the caller's tensors it writes into."""
import torch

from kiln.runtime.cuda_graph import warm_up_inputs


def test_warm_up_copies_only_the_inputs_it_writes():
    """Before, the warm-up ran on copies of every input: capturing a training step's backward
    held a second copy of every value the forward saved (and the forward's capture one of every
    parameter) at the first step, the step of peak memory. Now the inputs read in place and the
    graph's own static buffers are used as they are; a caller's tensor written into (a KV cache)
    is still copied."""
    saved, cache, batch = torch.randn(1000), torch.zeros(10), torch.randn(4)
    inputs = warm_up_inputs([saved, cache, batch], written=[1])
    assert inputs[0] is saved and inputs[2] is batch
    assert inputs[1] is not cache and inputs[1].data_ptr() != cache.data_ptr()
    torch.testing.assert_close(inputs[1], cache)
    copied = sum(t.nbytes for t, s in zip(inputs, (saved, cache, batch)) if t is not s)
    assert copied == cache.nbytes


def test_inputs_copied_in_and_outputs_copied_out_share_the_workspace(monkeypatch):
    """A captured graph's copied inputs and outputs, planned by lifetime with the intermediates.
    Before, a capture of this chain held its 32 KB workspace and a 16 KB buffer each for the
    input it copies in and the output it copies out (64 KB); now the input's memory is reused
    once read, the output takes a dead intermediate's: 32 KB in all."""
    from tests.test_compiled_graph import chain
    compiled, one = chain(n=6).compile(), 64 * 64 * 4
    x = torch.randn(64, 64)
    expected = compiled.run([x])[0]
    transient = compiled.transient_slots(inputs=[0], outputs=[0])
    assert transient == {compiled.inputs[0], compiled.outputs[0]}
    assert compiled.workspace_bytes == 2 * one
    assert sum(p.size for p in compiled.plans_with(transient).values()) == 2 * one
    buffer = torch.empty(3 * one, dtype=torch.uint8)     # memory the caller provides
    workspace = compiled.workspace_set(transient, buffers={torch.device("cpu"): buffer})
    allocations, empty = [], torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocations.append(a) or empty(*a, **k))
    out = compiled.run([x], workspace)[0]
    monkeypatch.undo()
    assert not allocations, "the run allocates nothing: its output is in the workspace"
    assert out.untyped_storage().data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(out, expected)
    # a capture copies into the input's slot itself and reads the run's output from its slot
    static = workspace.slots[compiled.inputs[0]]
    static.copy_(2 * x)
    torch.testing.assert_close(compiled.run([static], workspace)[0], compiled.run([2 * x])[0])
